"""A half of a GPT-2 block, forward and backward, at 1558M:16's shape: the MLP half x + MLP(LN(x))
or (--half attn) the attention half x + c_proj(attention(c_attn(LN(x)))); bf16 (the default
path's ops), torchao's tensorwise FP8, and mlp_fp8 / attn_fp8 (FP8 with the casts made where the
data is, delayed scales): the fused design against both, per block.

    python -m bench.bench_fp8_mlp [--half mlp|attn] [--tokens 16384] [--width 1600] [--out DIR]

Each variant: median ms of a forward + backward over random bf16 input and gradient (CUDA events,
synchronised each call; and the GPU's time alone, the host's latency hidden), after a warm-up
that compiles and fills the FP8 state, and the half's own output's relative error against fp32
torch on the same inputs. Scaled to 48 blocks, the ms difference to bf16 is what the variant
would move a 1558M step. "fused_fast_grads" has cuBLAS's fast accumulation in the backward's
GEMMs too. Then where the time goes: the GPU kernels of one fused forward + backward (the
profiler), and the half's GEMMs alone, bf16 against FP8 with and without fast accumulation: the
floor that FP8 GEMMs set for the half block. The attention half runs T = 1024, head size 64.
"""

import torch
from torch import nn

from bench.common import events, timed, write_json, xl_shape_args
from gpt2_fused.kernels.attn_fp8 import attn_fp8, attn_fp8_reference, attn_state
from gpt2_fused.kernels.fp8_gemm import E4, E5, scaled_mm
from gpt2_fused.kernels.mlp import mlp_cublaslt
from gpt2_fused.kernels.mlp_fp8 import mlp_fp8, mlp_fp8_reference, mlp_state
from gpt2_fused.training.compile_cache import use_keyed_cache
from model import CausalSelfAttention, GPTConfig

T = 1024  # the attention half's sequence length

VARIANTS = ("bf16", "torchao_tensorwise", "fused", "fused_fast_grads")


class HalfBlock(nn.Module):
    """A half of model.Block, x + MLP(LN(x)) or x + attention(LN(x)): the default path's ops
    (bf16), or torch's Linears (for torchao's conversion), or mlp_fp8 / attn_fp8."""

    def __init__(self, D, how, half):
        super().__init__()
        self.ln, self.how, self.half = nn.LayerNorm(D), how, half
        fused, fast = how.startswith("fused"), how == "fused_fast_grads"
        if half == "attn":  # torchao converts Linears: the torch path, where they are called
            impl = "fast" if how == "bf16" else "torch"
            self.attn = CausalSelfAttention(GPTConfig(n_embd=D, n_head=D // 64, block_size=T,
                                                      attn_impl=impl))  # fmt: skip
            self.c_fc = self.attn.c_attn  # the names the reference reads
            self.c_proj = self.attn.c_proj
            self.state = attn_state("cuda", fast_grads=fast) if fused else None
        else:
            self.c_fc, self.c_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
            self.state = mlp_state("cuda", fast_grads=fast) if fused else None

    def forward(self, x):
        w = (self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias)
        if self.half == "attn":
            if self.state is not None:
                return attn_fp8(x, self.ln, *w, self.attn.n_head, self.state)
            return self.attn(self.ln(x), residual=x)
        if self.state is not None:
            return mlp_fp8(x, self.ln, *w, self.state)
        y = self.ln(x)
        if self.how == "bf16":
            return mlp_cublaslt(y, *w, residual=x)
        return x + self.c_proj(nn.functional.gelu(self.c_fc(y), approximate="tanh"))

    def reference(self, x):
        """The same half in fp32 torch."""
        w = (self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias)
        if self.half == "attn":
            return attn_fp8_reference(x, self.ln, *w, self.attn.n_head)
        return mlp_fp8_reference(x, self.ln, *w)


def variants(D, half):
    out = {}
    for how in VARIANTS:
        torch.manual_seed(0)
        m = HalfBlock(D, how, half).cuda()
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


def gemm_floor(M, D, half):
    """{gemm: {bf16, fp8, fp8_fast} ms} for the half's six GEMMs at M tokens, width D (layouts
    as mlp_fp8 / attn_fp8 call them; "fc" is c_attn in the attention half), GPU time alone."""
    H, P = (3 * D, D) if half == "attn" else (4 * D, 4 * D)  # c_fc's outputs, c_proj's inputs
    shapes = {  # (rows, inner, cols) of a @ b
        "fc fwd": (M, D, H), "proj fwd": (M, P, D), "proj dgrad": (M, D, P),
        "proj wgrad": (D, M, P), "fc dgrad": (M, H, D), "fc wgrad": (H, M, D),
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
    args = xl_shape_args(__doc__, halves=True)
    use_keyed_cache()  # not another version's custom-op graphs
    M, D = args.tokens, args.width
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M // T, T, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    dout = (torch.randn(M // T, T, D, device="cuda", generator=g) * 1e-3).bfloat16()
    rows, steps = {}, {}
    for how, m in variants(D, args.half).items():

        def step(m=m):
            x.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(x)
            out.backward(dout)
            return out

        out = step()
        want = getattr(m, "_orig_mod", m).reference(x.detach())
        err = (torch.linalg.vector_norm(out.float() - want) / torch.linalg.vector_norm(
            want - x.detach().float())).item()  # fmt: skip
        ms, gpu_ms = timed(step, reps=10, warmup=3), timed(step, reps=10, hide_host=True)
        rows[how] = dict(ms=ms, gpu_ms=gpu_ms, mlp_rel_err=err)
        steps[how] = step
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: the {args.half} half, "
          f"{M} tokens, width {D}")  # fmt: skip
    kernels = top_kernels(steps["fused"])
    print("\nfused, one forward + backward: | kernel | calls | ms |")
    for name, calls, ms in kernels:
        print(f"| {name} | {calls} | {ms:.3f} |")
    floor = gemm_floor(M, D, args.half)
    print("\n| GEMM | bf16 ms | fp8 ms | fp8 fast-accum ms |\n|---|---|---|---|")
    floor["sum"] = {k: sum(f[k] for f in floor.values()) for k in ("bf16", "fp8", "fp8_fast")}
    for name, r in floor.items():
        print(f"| {name} | {r['bf16']:.3f} | {r['fp8']:.3f} | {r['fp8_fast']:.3f} |")
    print("\n| variant | fwd+bwd ms | GPU alone ms | vs bf16 | x 48 blocks vs bf16, ms | "
          "output rel. err |\n|---|---|---|---|---|---|")  # fmt: skip
    base = rows["bf16"]["ms"]
    for how, r in rows.items():
        print(f"| {how} | {r['ms']:.3f} | {r['gpu_ms']:.3f} | {base / r['ms']:.3f}x | "
              f"{48 * (r['ms'] - base):+.1f} | {r['mlp_rel_err']:.4f} |")  # fmt: skip
    found = dict(half=args.half, tokens=M, width=D, results=rows, fused_kernels=kernels,
                 gemms=floor)  # fmt: skip
    name = "bench_fp8_mlp.json" if args.half == "mlp" else "bench_fp8_attn.json"
    write_json(args.out, name, found)


if __name__ == "__main__":
    main()
