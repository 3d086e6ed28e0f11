"""gpt2_fused/kernels/act_fp8.py against its torch reference (the Triton interpreter on CPU, the
compiled kernel on the GPU): GELU, its gradient and a plain copy, cast to e4m3 / e5m2, the
transposed copy and the amax."""

import pytest
import torch

from gpt2_fused.kernels.act_fp8 import (
    FP8_MAX,
    act_fp8,
    act_fp8_reference,
    kernel_transposes_right,
    transpose_fp8,
)
from gpt2_fused.kernels.fp8_gemm import Fp8State

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def pair(M, N, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(M, N, generator=g) * 2).bfloat16().to(DEV)
    grad = (torch.randn(M, N, generator=g) * 1e-3).bfloat16().to(DEV)
    return h, grad


def assert_fp8_close(got, exact, fp8):
    """Within one step of `fp8` (its mantissa bits) of the exact values, plus its subnormal step,
    plus 1e-5 of the largest (in tanh's tail torch's fp32 tanh is -1 where 2 sigmoid - 1 is not)."""
    tiny = 2.0**-9 if fp8 == torch.float8_e4m3fn else 2.0**-16
    step = exact.abs() * 2.0 ** -MANTISSA[fp8] + tiny + 1e-5 * exact.abs().max()
    err = (got.float() - exact).abs()
    assert (err <= step).all(), err.max()


@pytest.mark.parametrize("mode, fp8, scale", [
    ("gelu", torch.float8_e4m3fn, 50.0),
    ("dgelu", torch.float8_e5m2, 2.0**14),
    ("copy", torch.float8_e5m2, 2.0**13),
])  # fmt: skip
@pytest.mark.parametrize("M, N", [(50, 70), (64, 128)])
@pytest.mark.parametrize("transposed, split", [(False, None), (True, None), (True, True)])
def test_matches_torch(mode, fp8, scale, M, N, transposed, split):
    """split None: qt made where this device gets it right; True: by transpose_fp8 after."""
    h, grad = pair(M, N)
    ins = dict(gelu=dict(h=h), dgelu=dict(h=h, g=grad), copy=dict(g=grad))[mode]
    s = torch.tensor([scale], device=DEV)
    amax = torch.zeros(1, device=DEV)
    q, qt = act_fp8(mode, s, amax, fp8=fp8, transposed=transposed, block=(32, 32), split=split,
                    **ins)  # fmt: skip
    out, rq, ramax = act_fp8_reference(mode, s, fp8=fp8, **ins)
    assert q.dtype == fp8 and q.shape == (M, N)
    assert_fp8_close(q, (out * scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]), fp8)
    torch.testing.assert_close(amax[0], ramax, rtol=1e-5, atol=0)
    if transposed:
        assert qt.shape == (N, M) and qt.is_contiguous()
        assert torch.equal(qt.float(), q.float().t())
    else:
        assert qt is None


@pytest.mark.parametrize("mode, fp8", [
    ("gelu", torch.float8_e4m3fn), ("dgelu", torch.float8_e5m2), ("copy", torch.float8_e5m2),
])  # fmt: skip
def test_kernel_transposes_right_is_false_where_the_kernels_copy_is_wrong(mode, fp8):
    """kernel_transposes_right's probe stands for every mode: where the kernel's own copy
    (split=False), stored either way, is wrong at another shape and seed, it says so (on an
    H200 under Triton 3.6's bundled ptxas the GELU gradient's is wrong with how 0; the
    interpreter is always right); and act_fp8's default way is right either way."""
    h, grad = pair(256, 384, seed=5)
    ins = dict(gelu=dict(h=h), dgelu=dict(h=h, g=grad), copy=dict(g=grad))[mode]
    s, amax = torch.tensor([2.0**13], device=DEV), torch.zeros(1, device=DEV)
    for how in (0, 2):
        q, qt = act_fp8(mode, s, amax, fp8=fp8, transposed=True, how=how, split=False, **ins)
        if not torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t()):
            assert not kernel_transposes_right(h.device, how)
        assert DEV == "cuda" or kernel_transposes_right(h.device, how)
    q, qt = act_fp8(mode, s, amax, fp8=fp8, transposed=True, **ins)
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())


@pytest.mark.parametrize("how", [0, 2])
def test_every_way_of_storing_the_transpose_stores_q_transposed(how):
    """store_transposed's ways (tl.trans, read back after a barrier, then tl.trans), in
    the kernel (split=False), at a shape that leaves partial tiles, with a delayed scale."""
    h, grad = pair(70, 100, seed=6)
    state = Fp8State(DEV, ["t"])
    for _ in range(2):
        _, (q, qt) = state.cast("t", lambda dl: act_fp8("dgelu", h=h, g=grad, fp8=torch.float8_e5m2,
                                                         transposed=True, how=how, split=False,
                                                         block=(32, 32), delayed=dl))  # fmt: skip
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())


def test_saturates_instead_of_overflowing():
    h, _ = pair(8, 16)
    q, _ = act_fp8("gelu", torch.tensor([1e6], device=DEV), torch.zeros(1, device=DEV), h=h)
    assert q.float().abs().max() == FP8_MAX[torch.float8_e4m3fn]
    assert torch.isfinite(q.float()).all()


def test_bad_arguments_are_refused():
    h, grad = pair(4, 4)
    s, a = torch.ones(1, device=DEV), torch.zeros(1, device=DEV)
    with pytest.raises(ValueError, match="takes h and g"):
        act_fp8("dgelu", s, a, h=h)
    with pytest.raises(ValueError, match="mode must be"):
        act_fp8("relu", s, a, h=h)
    with pytest.raises(ValueError, match="contiguous"):
        act_fp8("gelu", s, a, h=h.t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dgelu_at_1558m_shape():
    """The compiled kernel at 1558M:16's MLP (16K rows of 6400), transposed copy included."""
    h, grad = pair(16384, 6400, seed=2)
    s, amax = torch.tensor([2.0**14], device=DEV), torch.zeros(1, device=DEV)
    q, qt = act_fp8("dgelu", s, amax, h=h, g=grad, fp8=torch.float8_e5m2, transposed=True)
    out, rq, ramax = act_fp8_reference("dgelu", s, h=h, g=grad, fp8=torch.float8_e5m2)
    assert (q.float() != rq.float()).float().mean().item() < 1e-3
    assert torch.equal(qt, q.t().contiguous()) or torch.equal(qt.float(), q.float().t())
    torch.testing.assert_close(amax[0], ramax, rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", ["dgelu", "copy"])
def test_column_sums_are_the_unrounded_outputs(mode):
    """sums=True: the bias gradient, summed in fp32 from the values before the cast."""
    h, grad = pair(70, 40, seed=3)
    ins = dict(h=h, g=grad) if mode == "dgelu" else dict(g=grad)
    s = torch.tensor([2.0**14], device=DEV)
    *_, sums = act_fp8(mode, s, torch.zeros(1, device=DEV), fp8=torch.float8_e5m2, sums=True,
                       block=(32, 32), **ins)  # fmt: skip
    out = act_fp8_reference(mode, s, fp8=torch.float8_e5m2, **ins)[0]
    torch.testing.assert_close(sums, out.sum(0), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("M, N", [(3, 5), (50, 70), (128, 64)])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_transpose_fp8_is_torchs_transpose(M, N, fp8):
    g = torch.Generator(device="cpu").manual_seed(M)
    q = (torch.randn(M, N, generator=g) * 8).to(fp8).to(DEV)
    qt = transpose_fp8(q, block=(32, 32))
    assert qt.dtype == fp8 and qt.is_contiguous()
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())
