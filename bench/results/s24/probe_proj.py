"""c_proj with the residual in its cuBLASLt epilogue (mlp.linear_add, ours) against the GEMM
alone (torch.addmm, bias epilogue; the add then goes to the next LayerNorm) and addmm + add_,
at the MLP's and the attention's c_proj shapes of 124M:64 and 1558M:16; and c_fc's GELU_AUX_BIAS
GEMM with 8 (ours) or 32 candidates timed. GPU ms a call (bench.common.timed, host hidden,
median of 30). A probe, not kept.
    PYTHONPATH=. python3 bench/results/s24/probe_proj.py"""

import torch

from bench.common import timed
from gpt2_fused.kernels.cublaslt import EPI_BIAS, EPI_GELU_AUX_BIAS, matmul
from gpt2_fused.kernels.mlp import linear_add


def ms(fn, *args):
    return timed(lambda: fn(*args), 30, hide_host=True)


def epi32(a, w, b, r):
    """linear_add's GEMM with the heuristic's first 32 candidates timed, not 8."""
    out = torch.empty_like(r)
    return matmul(a, w.t(), out, bias=b, c=r, beta=1.0, epilogue=EPI_BIAS, candidates=32)


def gelu_up(x, w, b, candidates):
    """c_fc's GELU_AUX_BIAS GEMM (mlp.mlp_gelu's first)."""
    h = x.new_empty((x.shape[0], w.shape[0]))
    a = torch.empty_like(h)
    return matmul(x, w.t(), a, bias=b, aux=h, epilogue=EPI_GELU_AUX_BIAS, candidates=candidates)


def randn(*shape, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale


def proj_row(name, M, K, C):
    a, w, b, r = randn(M, K), randn(C, K, scale=K**-0.5), randn(C), randn(M, C)
    ref = r.float() + a.float() @ w.float().t() + b.float()
    err = (linear_add(a, w, b, r).float() - ref).abs().max().item()
    print(f"{name} (M {M}, K {K}, N {C}): epilogue {ms(linear_add, a, w, b, r):.4f} "
          f"(32 candidates {ms(epi32, a, w, b, r):.4f}), addmm {ms(torch.addmm, b, a, w.t()):.4f}, "
          f"addmm+add {ms(lambda: torch.addmm(b, a, w.t()).add_(r)):.4f}, "
          f"r + r {ms(torch.add, r, r):.4f} ms; epilogue err {err:.3g}")  # fmt: skip


def main():
    torch.manual_seed(0)
    for name, M, C in (("124M:64", 65536, 768), ("1558M:16", 16384, 1600)):
        proj_row(f"{name} mlp", M, 4 * C, C)
        proj_row(f"{name} attn", M, C, C)
        x, w, b = randn(M, C), randn(4 * C, C, scale=C**-0.5), randn(4 * C)
        t8, t32 = ms(gelu_up, x, w, b, 8), ms(gelu_up, x, w, b, 32)
        print(f"{name} c_fc GELU_AUX_BIAS: 8 candidates {t8:.4f}, 32 {t32:.4f}, "
              f"addmm {ms(torch.addmm, b, x, w.t()):.4f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
