# ruff: noqa
# Under Triton's bundled ptxas: which transposed FP8 copies are right? (issue 56 fallback probe)
import os, sys, torch, triton
from gpt2_fused.kernels.act_fp8 import act_fp8, transpose_fp8

print("ptxas:", os.environ.get("TRITON_PTXAS_PATH", "bundled"), "triton", triton.__version__)
g = torch.Generator(device="cuda").manual_seed(0)
one, zero = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
for M, N in ((512, 1024), (16384, 6400), (16384, 1600)):
    h, dy = (torch.randn(M, N, device="cuda", generator=g).bfloat16() for _ in range(2))
    for kind, kw in (
        ("dgelu", dict(h=h, g=dy, fp8=torch.float8_e5m2)),
        ("gelu", dict(h=h)),
        ("copy", dict(g=dy, fp8=torch.float8_e5m2)),
    ):
        q, qt = act_fp8(kind, one, zero, transposed=True, **kw)
        q2 = act_fp8(kind, one, zero, transposed=False, **kw)
        q2 = q2[0]
        want = q.view(torch.uint8).t()
        bad_qt = (qt.view(torch.uint8) != want).float().mean().item()
        bad_tr = (transpose_fp8(q).view(torch.uint8) != want).float().mean().item()
        same_rm = torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
        print(
            f"{M}x{N} {kind:5s}: qt wrong {bad_qt:.3f}, transpose_fp8(q) wrong {bad_tr:.3f}, row-major same without transposed: {same_rm}"
        )
