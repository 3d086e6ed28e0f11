"""gpt2_fused/kernels/cublaslt.py: the ctypes cuBLASLt matmul, its layouts and its algorithm timing.

The matmul itself needs a GPU (tests/test_mlp.py and tests/test_fused_loss.py run it at real sizes
under `-m gpu`); the layout logic and what the timing may touch are tested here on CPU.
"""

import pytest
import torch

from gpt2_fused.kernels import cublaslt


def test_operand_layouts():
    """cuBLAS is column-major: a row-major (r, c) tensor is its transpose with ld = row stride,
    a transposed view is read with op T; anything else is refused, not misread."""
    t = torch.empty(6, 10)
    assert cublaslt._operand(t) == (cublaslt.OP_N, 10, 6, 10)
    assert cublaslt._operand(t.t()) == (cublaslt.OP_T, 10, 6, 10)
    assert cublaslt._operand(torch.empty(6, 16)[:, :10]) == (cublaslt.OP_N, 10, 6, 16)
    with pytest.raises(ValueError, match="neither row- nor column-major"):
        cublaslt._operand(torch.empty(6, 10, 2)[:, :, 0])


def test_matmul_refuses_strided_outputs():
    """out and aux are written as contiguous (m, n): other layouts are refused before any call."""
    a, b = torch.empty(4, 8), torch.empty(8, 16)
    with pytest.raises(ValueError, match="contiguous"):
        cublaslt.matmul(a, b, torch.empty(16, 4).t())
    with pytest.raises(ValueError, match="contiguous"):
        cublaslt.matmul(a, b, torch.empty(4, 16), aux=torch.empty(16, 4).t())


def test_matmul_refuses_a_bad_c_or_bias(monkeypatch):
    """c is read as out's layout (cuBLASLt's C shares D's): another shape, dtype or stride is
    refused before any library call, as is a bias epilogue without its bias (n,) in out's dtype
    (the cached descriptor would keep the previous call's pointer). Well-formed ones get past."""

    class Reached(Exception):
        pass

    def plan(key):
        raise Reached

    monkeypatch.setattr(cublaslt, "_plan", plan)
    a, b, out = torch.empty(4, 8), torch.empty(8, 16), torch.empty(4, 16)
    bias = torch.empty(16)
    for c in (
        torch.empty(4, 8),
        torch.empty(4, 16, dtype=torch.bfloat16),
        torch.empty(16, 4).t(),
        torch.empty(4, 32)[:, :16],
    ):
        with pytest.raises(ValueError, match="c must be contiguous"):
            cublaslt.matmul(a, b, out, c=c, beta=1.0, bias=bias, epilogue=cublaslt.EPI_BIAS)
    for bad in (None, torch.empty(8), torch.empty(16, dtype=torch.bfloat16), torch.empty(32)[::2]):
        with pytest.raises(ValueError, match="bias epilogue needs bias"):
            cublaslt.matmul(
                a, b, out, c=torch.empty(4, 16), beta=1.0, bias=bad, epilogue=cublaslt.EPI_BIAS
            )
    with pytest.raises(Reached):
        cublaslt.matmul(
            a, b, out, c=torch.empty(4, 16), beta=1.0, bias=bias, epilogue=cublaslt.EPI_BIAS
        )


def test_available_is_false_without_the_library(monkeypatch):
    """No libcublasLt to load: available() says so with one warning (the MLP and the fused loss
    then use torch's GEMMs) instead of raising; the loader's own error names the problem."""
    monkeypatch.setattr(cublaslt, "_candidates", lambda: ["/nonexistent/libcublasLt.so.99"])
    cublaslt._lib.cache_clear()
    cublaslt.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="not found.*torch's GEMMs"):
            assert cublaslt.available() is False
        assert cublaslt.available() is False  # cached: no second warning, no second search
        with pytest.raises(RuntimeError, match="libcublasLt"):
            cublaslt._lib()
    finally:
        cublaslt._lib.cache_clear()
        cublaslt.available.cache_clear()


def test_alignment_of_addresses():
    """The heuristic is told each operand's real alignment (its default assumes 256 bytes): a
    slice starting one bf16 element in is 2-byte aligned."""
    t = torch.empty(512, dtype=torch.bfloat16)
    t = t[(-t.data_ptr()) % 256 // 2 :]  # from a 256-byte boundary (CPU allocations: 64)
    assert cublaslt._alignment(t) == 256
    assert cublaslt._alignment(t[1:]) == 2
    assert cublaslt._alignment(t[8:]) == 16
    assert cublaslt._alignment(t[64:]) == 128
    assert cublaslt._alignment(t[128:]) == 256  # capped: more is never asked for


@pytest.mark.parametrize("m, transposed", [(7, False), (3, True)])
def test_timing_an_accumulating_call_leaves_out_unchanged(m, transposed):
    """A first call with beta != 0 times its candidates on out itself: the smaller dense operand
    (b at m = 7, a transposed view at m = 3) is replaced by zeros of the same strides, so out
    keeps exactly the sum it holds."""
    torch.manual_seed(0)
    a = torch.randn(24, m).t() if transposed else torch.randn(m, 24)
    b = torch.randn(24, 5)
    out = torch.randn(m, 5)
    before = out.clone()
    ops = cublaslt._timing_operands(a, b, beta=1.0)
    for _ in range(3):  # as the candidates' timing launches would run
        torch.addmm(out, ops["a"], ops["b"], beta=1.0, out=out)
    assert torch.equal(out, before)
    kept, zeroed, orig = ("a", "b", b) if m == 7 else ("b", "a", a)
    assert ops[kept] is (a if kept == "a" else b)
    assert not ops[zeroed].any() and ops[zeroed].stride() == orig.stride()
    # an overwriting call (beta = 0) times on its own operands: its own launch rewrites out
    ops = cublaslt._timing_operands(a, b, beta=0.0)
    assert ops["a"] is a and ops["b"] is b
    # so does one that adds a separate c (out = a @ b + c): out is only written
    ops = cublaslt._timing_operands(a, b, beta=1.0, c=torch.randn(m, 5))
    assert ops["a"] is a and ops["b"] is b


def test_timing_without_a_dense_operand_is_skipped():
    """Neither operand dense (strided slices both ways): no stand-in, so no timing (None)."""
    a = torch.randn(8, 20)[:, ::2]
    b = torch.randn(10, 12)[:, ::2]
    assert cublaslt._timing_operands(a, b, 1.0) is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pick", ["cublaslt", "reference"])
def test_gpu_first_call_accumulates_once(pick, monkeypatch):
    """A key's first call with beta = 1 (timed on a zero stand-in) adds a @ b to out exactly once,
    whichever candidate wins; so do later calls, and a reference pick runs the reference."""
    timed = cublaslt._fastest

    def fastest(runs, key):  # every candidate still runs (on the stand-in); the pick is forced,
        timed(runs, key)  # since which one wins at this small shape varies by machine
        return 0 if pick == "cublaslt" else len(runs) - 1  # the caller's own GEMM is last

    monkeypatch.setattr(cublaslt, "_fastest", fastest)
    torch.manual_seed(0)
    a = torch.randn(300, 96, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(96, 130, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(300, 130, device="cuda")
    expect = out + a.float() @ b.float()
    used = []

    def reference(beta, a, b, real=(a, b)):
        used.append((beta, a is real[0] and b is real[1]))
        torch.addmm(out, a, b, beta=beta, out_dtype=torch.float32, out=out)

    cublaslt.ALGOS.clear()
    cublaslt.matmul(a, b, out, beta=1.0, candidates=4, max_workspace=0, reference=reference)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-4)
    cublaslt.matmul(a, b, out, beta=1.0, candidates=4, max_workspace=0, reference=reference)
    torch.testing.assert_close(out, expect + a.float() @ b.float(), rtol=1e-5, atol=1e-4)
    real_calls = [u for u in used if u[1]]  # timing ran it on a zero stand-in for b
    assert real_calls == ([(1.0, True)] * 2 if pick == "reference" else [])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_bias_epilogue_adds_a_separate_c(dtype, offset):
    """out = a @ b + c + bias in one call (C = c, D = out, out's old values never read), on a
    key's first (timed) call and a cached one: within a rounding in out's dtype of torch's
    result, c left as it was. offset 1: c starts one element into its buffer, 2-byte aligned,
    which matmul refuses (on the H200 such a call rounded a @ b before adding c: 2e-3 off where
    the sum is near 0)."""
    torch.manual_seed(0)
    m, k, n = 300, 96, 136
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).t()  # a transposed view, as mlp's c_proj
    c = torch.randn(m * n + offset, device="cuda", dtype=dtype)[offset:].view(m, n)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    if offset:
        out = torch.empty((m, n), device="cuda", dtype=dtype)
        with pytest.raises(ValueError, match="16-byte aligned"):
            cublaslt.matmul(a, b, out, bias=bias, c=c, beta=1.0, epilogue=cublaslt.EPI_BIAS)
        return
    before = c.clone()
    expect = a.double() @ b.double() + c.double() + bias.double()
    u = 2**-8 if dtype == torch.bfloat16 else 2**-11  # unit roundoff
    cublaslt.ALGOS.clear()
    for _ in range(2):
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        cublaslt.matmul(
            a, b, out, bias=bias, c=c, beta=1.0, epilogue=cublaslt.EPI_BIAS, candidates=4
        )
        torch.testing.assert_close(out.double(), expect, rtol=2 * u, atol=1e-3)
        assert torch.equal(c, before)
    assert len(cublaslt.ALGOS) == 1  # the second call ran the first one's pick
