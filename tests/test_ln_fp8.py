"""gpt2_fused/kernels/ln_fp8.py against its torch reference (the Triton interpreter on CPU, the
compiled kernel on the GPU): the LayerNorm output, its FP8 copy, the scales and the amax."""

import pytest
import torch

from gpt2_fused.kernels.ln_fp8 import (
    E4M3_MAX,
    ln_backward,
    ln_backward_reference,
    ln_fp8,
    ln_fp8_reference,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(M, D, dtype, seed=0, spread=3.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(M, D, generator=g) * spread + 0.5).to(dtype).to(DEV)
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(DEV)
    b = (0.1 * torch.randn(D, generator=g)).to(DEV)
    return x, w, b


def assert_fp8_close(got, want_values):
    """got (float8_e4m3fn) against exact values: within one e4m3 step (3 mantissa bits: 2^-3 of
    the value, 2^-9 at the subnormal end); the interpreter may round where torch does not."""
    err = (got.float() - want_values.float()).abs()
    assert (err <= want_values.float().abs() * 2**-3 + 2**-9).all(), err.max()


@pytest.mark.parametrize("M, D", [(7, 96), (33, 200), (16, 1600)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_tensorwise_matches_torch(M, D, dtype, bias):
    x, w, b = inputs(M, D, dtype)
    b = b if bias else None
    scale = torch.tensor([100.0], device=DEV)
    amax = torch.tensor([0.5], device=DEV)  # below the true amax: it must rise to it
    y, y8, s_out, mean, rstd = ln_fp8(x, w, b, 1e-5, scale=scale, amax=amax)
    ry, ry8, _, ramax, rmean, rstd_ref = ln_fp8_reference(x, w, b, 1e-5, scale=scale)
    torch.testing.assert_close(y, ry, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    torch.testing.assert_close(mean, rmean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(amax[0], ramax, rtol=1e-5, atol=0)
    assert s_out is scale and y8.dtype == torch.float8_e4m3fn
    exact = (ry.float() * scale).clamp(-E4M3_MAX, E4M3_MAX)
    assert_fp8_close(y8, exact)
    assert y8.float().abs().max() <= E4M3_MAX  # saturated: y * 100 reaches ~400-1500 here


def test_tensorwise_amax_only_rises():
    x, w, b = inputs(8, 64, torch.float32)
    amax = torch.tensor([1e6], device=DEV)
    ln_fp8(x, w, b, 1e-5, scale=torch.ones(1, device=DEV), amax=amax)
    assert amax.item() == 1e6


@pytest.mark.parametrize("M, D", [(5, 96), (16, 1600)])
def test_rowwise_scales_each_row_to_the_e4m3_range(M, D):
    x, w, b = inputs(M, D, torch.bfloat16, spread=1.0)
    x[1] *= 50  # rows of very different ranges get scales of their own
    y, y8, inv, _, _ = ln_fp8(x, w, b, 1e-5, store_y=False)
    ry, ry8, rinv, _, _, _ = ln_fp8_reference(x, w, b, 1e-5)
    assert y is None
    torch.testing.assert_close(inv, rinv, rtol=1e-5, atol=0)
    # each row's largest element maps to the top of the range; dequantised, y8 is y
    assert torch.allclose(y8.float().abs().amax(-1), torch.full((M,), E4M3_MAX, device=DEV))
    assert_fp8_close(y8, ry.float() / rinv[:, None])


def test_bad_tensorwise_arguments_are_refused():
    x, w, b = inputs(4, 32, torch.float32)
    with pytest.raises(ValueError, match="needs amax"):
        ln_fp8(x, w, b, 1e-5, scale=torch.ones(1, device=DEV))


def backward_inputs(M, D, dtype, seed=0):
    x, w, _ = inputs(M, D, dtype, seed)
    xf = x.float()
    mean, rstd = xf.mean(-1), torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    dy = torch.randn(M, D, generator=g).to(dtype).to(DEV)
    res = torch.randn(M, D, generator=g).to(dtype).to(DEV)
    return dy, x, mean, rstd, w, res


@pytest.mark.parametrize("M, D, rows", [(7, 96, 4), (33, 200, 16), (16, 1600, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_res", [True, False])
def test_backward_matches_torch_autograd(M, D, rows, dtype, with_res):
    """ln_backward's dx (+ residual), dw, db against torch's own LayerNorm under autograd, in
    fp32 (the torch reference of this file is checked the same way)."""
    dy, x, mean, rstd, w, res = backward_inputs(M, D, dtype)
    b = torch.zeros(D, device=DEV, requires_grad=True)
    xf, wf = x.float().requires_grad_(True), w.clone().requires_grad_(True)
    torch.nn.functional.layer_norm(xf, (D,), wf, b, 1e-5).backward(dy.float())
    want_dx = xf.grad + (res.float() if with_res else 0)
    residual = res if with_res else None
    for fn in (ln_backward, ln_backward_reference):
        kw = dict(rows=rows) if fn is ln_backward else {}
        dx, dw, db = fn(dy, x, mean, rstd, w, residual=residual, out_dtype=torch.float32, **kw)
        assert dx.dtype == torch.float32 and dw.dtype == db.dtype == w.dtype
        tol = dict(rtol=1e-4, atol=1e-4 * D**0.5)
        torch.testing.assert_close(dx, want_dx, **tol)
        torch.testing.assert_close(dw, wf.grad, **tol)
        torch.testing.assert_close(db, b.grad, **tol)
    dx, _, _ = ln_backward(dy, x, mean, rstd, w, residual=residual)
    assert dx.dtype == x.dtype


def test_backward_refuses_mismatched_shapes():
    dy, x, mean, rstd, w, res = backward_inputs(4, 32, torch.float32)
    with pytest.raises(ValueError, match="must be x's shape"):
        ln_backward(dy[:, :16], x, mean, rstd, w)
    with pytest.raises(ValueError, match="must be x's shape"):
        ln_backward(dy, x, mean, rstd, w, residual=res[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_backward_at_1558m_shape():
    """The compiled backward at 1558M:16's shape (bf16 in, bf16 dx) against the torch reference."""
    dy, x, mean, rstd, w, res = backward_inputs(16384, 1600, torch.bfloat16, seed=2)
    got = ln_backward(dy, x, mean, rstd, w, residual=res)
    want = ln_backward_reference(dy, x, mean, rstd, w, residual=res)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    for g, r in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rowwise", [False, True])
def test_gpu_at_1558m_shape(rowwise):
    """The compiled kernel at 1558M:16's LayerNorm (16K rows of 1600): the hardware's e4m3
    rounding is nearest-even and saturating, as torch's reference."""
    x, w, b = inputs(16384, 1600, torch.bfloat16, seed=1)
    kw = (
        {}
        if rowwise
        else dict(scale=torch.tensor([60.0], device=DEV), amax=torch.zeros(1, device=DEV))
    )
    y, y8, s_out, mean, rstd = ln_fp8(x, w, b, 1e-5, **kw)
    ry, ry8, rs, ramax, rmean, rrstd = ln_fp8_reference(x, w, b, 1e-5, scale=kw.get("scale"))
    torch.testing.assert_close(y, ry, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s_out, rs, rtol=1e-5, atol=0)
    mismatched = (y8.float() != ry8.float()).float().mean().item()
    assert mismatched < 1e-3, mismatched  # bf16 y vs fp32 y may round a few values apart
    if not rowwise:
        torch.testing.assert_close(kw["amax"][0], ramax, rtol=1e-5, atol=0)
