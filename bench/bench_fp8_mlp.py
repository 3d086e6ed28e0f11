"""The MLP half of a GPT-2 block, x + MLP(LN(x)), forward and backward, at 1558M:16's shape:
bf16 (the default path's op), torchao's tensorwise FP8, and mlp_fp8 (FP8 with the casts made
where the data is, delayed scales): issue 56's fused design against both, per block.

    python -m bench.bench_fp8_mlp [--tokens 16384] [--width 1600] [--out DIR]

Each variant: median ms of a forward + backward over random bf16 input and gradient (CUDA events,
synchronised each call), after a warm-up that compiles and fills the FP8 state, and the
MLP output's and x-gradient's relative error against fp32 torch on the same inputs. Scaled to
48 blocks, the ms difference to bf16 is what the variant would move a 1558M step.
"""

import torch
from torch import nn

from bench.common import timed, write_json, xl_shape_args
from gpt2_fused.kernels.mlp import mlp_cublaslt
from gpt2_fused.kernels.mlp_fp8 import mlp_fp8, mlp_fp8_reference, mlp_state


class HalfBlock(nn.Module):
    """x + MLP(LN(x)) as model.Block's second half: the default (bf16 cuBLASLt op) or torch's
    Linears (for torchao's conversion) or mlp_fp8."""

    def __init__(self, D, how):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.c_fc, self.c_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.how = how
        self.state = mlp_state("cuda") if how == "fused" else None

    def forward(self, x):
        if self.how == "fused":
            return mlp_fp8(x, self.ln, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                           self.c_proj.bias, self.state)  # fmt: skip
        y = self.ln(x)
        if self.how == "bf16":
            return mlp_cublaslt(y, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                                self.c_proj.bias, residual=x)  # fmt: skip
        return x + self.c_proj(nn.functional.gelu(self.c_fc(y), approximate="tanh"))


def variants(D):
    out = {}
    for how in ("bf16", "torchao_tensorwise", "fused"):
        torch.manual_seed(0)
        m = HalfBlock(D, how).cuda()
        if how == "torchao_tensorwise":
            try:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            except ImportError:
                print("torchao not installed: its variant is skipped")
                continue
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        out[how] = m if how == "fused" else torch.compile(m)
    return out


def main():
    args = xl_shape_args(__doc__)
    M, D = args.tokens, args.width
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=g).bfloat16().requires_grad_(True)
    dout = (torch.randn(M, D, device="cuda", generator=g) * 1e-3).bfloat16()
    rows = {}
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
        ms = timed(step, reps=10, warmup=3)
        rows[how] = dict(ms=ms, mlp_rel_err=err)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: {M} tokens, width {D}")
    print("| variant | fwd+bwd ms | vs bf16 | x 48 blocks vs bf16, ms | MLP output rel. err |")
    print("|---|---|---|---|---|")
    base = rows["bf16"]["ms"]
    for how, r in rows.items():
        print(f"| {how} | {r['ms']:.3f} | {base / r['ms']:.3f}x | {48 * (r['ms'] - base):+.1f} "
              f"| {r['mlp_rel_err']:.4f} |")  # fmt: skip
    write_json(args.out, "bench_fp8_mlp.json", dict(tokens=M, width=D, results=rows))


if __name__ == "__main__":
    main()
