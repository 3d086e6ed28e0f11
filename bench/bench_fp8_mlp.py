"""The MLP half of a GPT-2 block, x + MLP(LN(x)), forward and backward, at 1558M:16's shape:
bf16 (the default path's op), torchao's tensorwise FP8, and mlp_fp8 (FP8 with the casts made
where the data is, delayed scales): issue 56's fused design against both, per block.

    python -m bench.bench_fp8_mlp [--tokens 16384] [--width 1600] [--out DIR]

Each variant: median ms of a forward + backward over random bf16 input and gradient (CUDA events,
synchronised each call; and the GPU's time alone, the host's latency hidden), after a warm-up
that compiles and fills the FP8 state, and the
MLP output's relative error against fp32 torch on the same inputs. Scaled to 48 blocks, the ms
difference to bf16 is what the variant would move a 1558M step. "fused_fast_grads" is mlp_fp8
with cuBLAS's fast accumulation in the backward's GEMMs too.
Then where the time goes: the GPU kernels of one fused forward + backward (the profiler), and
the MLP's six GEMMs alone, bf16 against FP8 with and without fast accumulation: the floor that
FP8 GEMMs set for the half block.
"""

import torch
from torch import nn

from bench.common import events, timed, write_json, xl_shape_args
from gpt2_fused.kernels.fp8_gemm import E4, E5, scaled_mm
from gpt2_fused.kernels.mlp import mlp_cublaslt
from gpt2_fused.kernels.mlp_fp8 import mlp_fp8, mlp_fp8_reference, mlp_state

VARIANTS = ("bf16", "torchao_tensorwise", "fused", "fused_fast_grads")


class HalfBlock(nn.Module):
    """x + MLP(LN(x)) as model.Block's second half: the default (bf16 cuBLASLt op) or torch's
    Linears (for torchao's conversion) or mlp_fp8."""

    def __init__(self, D, how):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.c_fc, self.c_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.how = how
        fused = how.startswith("fused")
        self.state = mlp_state("cuda", fast_grads=how == "fused_fast_grads") if fused else None

    def forward(self, x):
        if self.state is not None:
            return mlp_fp8(x, self.ln, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                           self.c_proj.bias, self.state)  # fmt: skip
        y = self.ln(x)
        if self.how == "bf16":
            return mlp_cublaslt(y, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                                self.c_proj.bias, residual=x)  # fmt: skip
        return x + self.c_proj(nn.functional.gelu(self.c_fc(y), approximate="tanh"))


def variants(D):
    out = {}
    for how in VARIANTS:
        torch.manual_seed(0)
        m = HalfBlock(D, how).cuda()
        if how == "torchao_tensorwise":
            try:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            except ImportError:
                print("torchao not installed: its variant is skipped")
                continue
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        out[how] = m if m.state is not None else torch.compile(m)
    return out


def top_kernels(step, n=14):
    """[(kernel name, calls, ms)] of the GPU kernels of one step(), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:70]
            calls, us = total.get(name, (0, 0.0))
            total[name] = (calls + 1, us + e.device_time)
    rows = sorted(total.items(), key=lambda kv: -kv[1][1])
    return [(name, calls, us / 1e3) for name, (calls, us) in rows[:n]]


def gemm_floor(M, D):
    """{gemm: {bf16, fp8, fp8_fast} ms} for the MLP's six GEMMs at M tokens, width D (layouts
    as mlp_fp8 calls them), GPU time alone."""
    H = 4 * D
    shapes = {  # (rows, inner, cols) of a @ b
        "fc fwd": (M, D, H), "proj fwd": (M, H, D), "proj dgrad": (M, D, H),
        "proj wgrad": (D, M, H), "fc dgrad": (M, H, D), "fc wgrad": (H, M, D),
    }  # fmt: skip
    one = torch.ones((), device="cuda")
    out = {}
    for name, (r, k, c) in shapes.items():
        a, b = torch.randn(r, k, device="cuda"), torch.randn(c, k, device="cuda").t()
        a16, b16 = a.bfloat16(), b.bfloat16()
        a8, b8 = a.to(E5 if "grad" in name else E4), b.to(E4)
        wgrad = "wgrad" in name
        dt = torch.float32 if wgrad else torch.bfloat16
        out[name] = dict(
            bf16=events(lambda a16=a16, b16=b16: a16 @ b16),
            fp8=events(lambda a8=a8, b8=b8, dt=dt: scaled_mm(a8, b8, one, one, dt, fast=False)),
            fp8_fast=events(lambda a8=a8, b8=b8, dt=dt: scaled_mm(a8, b8, one, one, dt)),
        )
    return out


def main():
    args = xl_shape_args(__doc__)
    M, D = args.tokens, args.width
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    dout = (torch.randn(M, D, device="cuda", generator=g) * 1e-3).bfloat16()
    rows, steps = {}, {}
    for how, m in variants(D).items():

        def step(m=m):
            x.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(x)
            out.backward(dout)
            return out

        out = step()
        raw = getattr(m, "_orig_mod", m)
        want = mlp_fp8_reference(x.detach(), raw.ln, raw.c_fc.weight, raw.c_fc.bias,
                                 raw.c_proj.weight, raw.c_proj.bias)  # fmt: skip
        err = (torch.linalg.vector_norm(out.float() - want) / torch.linalg.vector_norm(
            want - x.detach().float())).item()  # fmt: skip
        ms, gpu_ms = timed(step, reps=10, warmup=3), timed(step, reps=10, hide_host=True)
        rows[how] = dict(ms=ms, gpu_ms=gpu_ms, mlp_rel_err=err)
        steps[how] = step
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: {M} tokens, width {D}")
    kernels = top_kernels(steps["fused"])
    print("\nfused, one forward + backward: | kernel | calls | ms |")
    for name, calls, ms in kernels:
        print(f"| {name} | {calls} | {ms:.3f} |")
    floor = gemm_floor(M, D)
    print("\n| GEMM | bf16 ms | fp8 ms | fp8 fast-accum ms |\n|---|---|---|---|")
    floor["sum"] = {k: sum(f[k] for f in floor.values()) for k in ("bf16", "fp8", "fp8_fast")}
    for name, r in floor.items():
        print(f"| {name} | {r['bf16']:.3f} | {r['fp8']:.3f} | {r['fp8_fast']:.3f} |")
    print("\n| variant | fwd+bwd ms | GPU alone ms | vs bf16 | x 48 blocks vs bf16, ms | "
          "MLP output rel. err |\n|---|---|---|---|---|---|")  # fmt: skip
    base = rows["bf16"]["ms"]
    for how, r in rows.items():
        print(f"| {how} | {r['ms']:.3f} | {r['gpu_ms']:.3f} | {base / r['ms']:.3f}x | "
              f"{48 * (r['ms'] - base):+.1f} | {r['mlp_rel_err']:.4f} |")  # fmt: skip
    found = dict(tokens=M, width=D, results=rows, fused_kernels=kernels, gemms=floor)
    write_json(args.out, "bench_fp8_mlp.json", found)


if __name__ == "__main__":
    main()
