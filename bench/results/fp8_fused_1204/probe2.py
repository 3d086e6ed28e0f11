# ruff: noqa  (a one-off GPU probe, kept as it ran; formatted since)
"""dgelu's q^T from a launch that stores only q^T (bundled ptxas), against the reference."""

import torch
import triton

from bench.common import events
from gpt2_fused.kernels.act_fp8 import FP8_MAX, act_fp8_kernel, act_fp8_reference

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
print(torch.__version__, triton.__version__)
for M, N in ((2048, 1024), (16384, 6400)):
    g0 = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(M, N, device="cuda", generator=g0).bfloat16()
    g = (torch.randn(M, N, device="cuda", generator=g0) * 1e-3).bfloat16()
    for fp8 in (E5, E4):
        sc = torch.tensor([4.0 if fp8 == E4 else 2.0**12], device="cuda")
        amax = torch.zeros(1, device="cuda")
        rq = act_fp8_reference("dgelu", sc, h=h, g=g, fp8=fp8)[1].view(torch.uint8)
        for how in (1, 2):
            for warps in (4, 8):
                q = torch.empty(M, N, device="cuda", dtype=torch.uint8)
                qt = torch.zeros(N, M, device="cuda", dtype=torch.uint8)

                def launch(store_q, transposed):
                    act_fp8_kernel[(triton.cdiv(M, 64), triton.cdiv(N, 64))](
                        g,
                        h,
                        q,
                        qt,
                        sc,
                        amax,
                        torch.empty(0, device="cuda"),
                        M,
                        N,
                        FP8_MAX=FP8_MAX[fp8],
                        E5M2=fp8 == E5,
                        MODE=1,
                        STORE_Q=store_q,
                        TRANSPOSED=transposed,
                        HOW=how,
                        SUMS=False,
                        BM=64,
                        BN=64,
                        INTERPRETED=False,
                        num_warps=warps,
                    )

                launch(True, False)
                launch(False, True)
                t_two = events(lambda: (launch(True, False), launch(False, True)))
                t_one = events(lambda: launch(True, True))
                print(
                    f"| {M}x{N} | {str(fp8)[-6:]} | how {how} | warps {warps} | q vs ref "
                    f"{(q != rq).float().mean().item():.5f} | qt^T vs ref {(qt.t() != rq).float().mean().item():.5f} "
                    f"| two launches {t_two:.3f} ms | one (wrong) {t_one:.3f} ms |",
                    flush=True,
                )
