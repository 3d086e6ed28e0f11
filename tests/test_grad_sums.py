"""gpt2_fused/kernels/grad_sums.py: bias-gradient column sums, and the qkv gradient laid out in the
same pass, against colsum_reference / qkv_grad_reference (on CPU under the Triton interpreter)."""

import pytest
import torch
from sm90 import PTXAS_V, compile_for_sm90, needs_nvidia_backend

from gpt2_fused.kernels import grad_sums

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M, C", [(1000, 48), (77, 40), (3, 16)])
def test_qkv_grad_lays_out_and_sums_the_three_parts(M, C, dtype):
    """The concatenation bit for bit; the sums against the fp64 reference within fp32 summation
    error (M terms of size ~1: a few ulps of fp32 at these M), also for parts with a wider row
    stride."""
    g = torch.Generator(DEV).manual_seed(M + C)
    wide = torch.randn(3, M, C + 8, device=DEV, generator=g).to(dtype)
    parts = [wide[i, :, :C] for i in range(3)]  # row stride C + 8
    cat, sums = grad_sums.qkv_grad(*parts)
    want, exact = grad_sums.qkv_grad_reference(*(p.double() for p in parts))
    assert torch.equal(cat, want.to(dtype)) and cat.is_contiguous()
    assert sums.dtype == torch.float32 and sums.shape == (3 * C,)
    assert (sums.double() - exact).abs().max() <= 1e-6 * M + 1e-6


@pytest.mark.parametrize("N", [1, 37, 300])
def test_colsum_against_fp64(N):
    t = torch.randn(513, N, device=DEV, generator=torch.Generator(DEV).manual_seed(N))
    for dtype in (torch.bfloat16, torch.float32):
        x = t.to(dtype)
        got = grad_sums.colsum(x)
        assert got.dtype == torch.float32
        assert (got.double() - grad_sums.colsum_reference(x.double())).abs().max() <= 1e-4, dtype
        assert torch.equal(got, grad_sums.colsum(x))  # fixed order: the same bits every time


def test_colsum_inputs_are_checked():
    a = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError, match="one shape and dtype"):
        grad_sums.qkv_grad(a, a, torch.zeros(8, 8, device=DEV))
    with pytest.raises(ValueError, match="one shape and dtype"):
        grad_sums.qkv_grad(a, a, a.bfloat16())
    with pytest.raises(ValueError, match="row-major"):
        grad_sums.colsum(a.t())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M, C", [(32768, 768), (16384, 1600)])
def test_gpu_qkv_grad_at_gpt2_shapes(M, C):
    g = torch.Generator("cuda").manual_seed(C)
    parts = [torch.randn(M, C, device="cuda", generator=g).bfloat16() for _ in range(3)]
    cat, sums = torch.compile(grad_sums.qkv_grad, fullgraph=True)(*parts)
    want, want_sums = grad_sums.qkv_grad_reference(*parts)
    assert torch.equal(cat, want)
    torch.testing.assert_close(sums, want_sums, rtol=1e-5, atol=1e-3)
    t = torch.randn(M, 4 * C, device="cuda", generator=g).bfloat16()
    want = grad_sums.colsum_reference(t)
    torch.testing.assert_close(grad_sums.colsum(t), want, rtol=1e-5, atol=1e-3)
    # compiled: Inductor launches the triton_op's kernels itself (its own functionalised copy)
    compiled = torch.compile(lambda t: grad_sums.colsum(t) * 2, fullgraph=True)(t)
    torch.testing.assert_close(compiled, 2 * want, rtol=1e-5, atol=2e-3)


# Pass 1 at its CUDA launch (the qkv layout at 124M's C = 768, and the plain column sum):
# LAUNCH's per_sm programs of num_warps warps must fit one SM's registers, so the grid the launch
# sizes runs as one wave; its 16-bit loads and stores must be 16 bytes wide.
COMPILE = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpt2_fused.kernels import grad_sums

cfg = grad_sums.LAUNCH["cuda"]
sig = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", cat_ptr="*bf16", part_ptr="*fp32",
           M="i32", C="i32", stride_in="i32")
attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
out = {}
for three in (True, False):
    BN = 256  # what _launch picks for C = 768 (three) and N = 3072
    BM = cfg["tile"] // BN
    consts = dict(ROWS=8 * BM, BM=BM, BN=BN, THREE=three)
    src = ASTSource(fn=grad_sums.partial_sums_kernel,
                    signature=dict(sig, **{k: "constexpr" for k in consts}),
                    constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=cfg["num_warps"])).asm["ptx"]
    info = ptxas_v(ptx)
    regs = re.search(r"Used (\d+) registers", info)
    out[f"three={three}"] = dict(
        regs=int(regs.group(1)) if regs else info[-500:],
        v4=[len(re.findall(rf"{op}\.global(?:\.\w+)*\.v4\.b32", ptx)) for op in ("ld", "st")])
limit = 65536 // (32 * cfg["num_warps"] * cfg["per_sm"])
print(json.dumps(dict(kernels=out, limit=limit)))
"""


@needs_nvidia_backend
def test_colsum_launch_keeps_its_programs_resident_with_16_byte_accesses():
    """Programs beyond what fits an SM's registers wait for a second wave (bench/bench_grad_sums.py
    times the launches: bench/RESULTS.md#attention)."""
    res = compile_for_sm90(PTXAS_V + COMPILE)
    for name, k in res["kernels"].items():
        assert isinstance(k["regs"], int), (name, k)  # else ptxas's own words
        assert k["regs"] <= res["limit"], (name, k, res["limit"])
        loads, stores = k["v4"]
        assert loads >= 2 and (stores >= 2 if name == "three=True" else stores == 0), (name, k)


@pytest.mark.parametrize("P, N", [(1024, 768), (256, 1600), (5, 3), (1, 1)])
def test_row_sum_against_fp64(P, N):
    """The stacks Inductor leaves for a LayerNorm's dw and db (1024 x 768 at 124M, 256 x 1600 at
    1558M) and odd sizes: the fp64 sum within fp32 summation error, the same bits every call."""
    t = torch.randn(P, N, device=DEV, generator=torch.Generator(DEV).manual_seed(P + N))
    got = grad_sums.row_sum(t)
    assert got.dtype == torch.float32 and got.shape == (N,)
    assert (got.double() - t.double().sum(0)).abs().max() <= 1e-6 * P + 1e-6
    assert torch.equal(got, grad_sums.row_sum(t))


def test_row_sum_takes_only_row_major_fp32():
    t = torch.randn(8, 4, device=DEV)
    for bad in (t.bfloat16(), t.t(), t[:, :2], t[0]):
        with pytest.raises(ValueError, match="row_sum"):
            grad_sums.row_sum(bad)
