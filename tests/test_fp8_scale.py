"""gpt2_fused/kernels/fp8_scale.py through Fp8State and the casting kernels (the Triton
interpreter on CPU): each call's scale comes from the previous call's amax, 1 / scale is
written for the GEMM, and each call reports its own amax, not a running maximum."""

import torch

from gpt2_fused.kernels.act_fp8 import act_fp8
from gpt2_fused.kernels.fp8_gemm import E4, E5, Fp8State
from gpt2_fused.kernels.fp8_scale import FP8_MAX, fp8_scale_reference
from gpt2_fused.kernels.ln_fp8 import ln_fp8, ln_fp8_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_scales_follow_the_previous_call_through_the_slots():
    """Five calls of one tensor whose range changes each time (x 4, 1, 0.5, 8, 2): call k's scale
    is FP8_MAX / (2 amax_{k-1}), the first call's from a dry run of its own values, and the amax
    each call leaves is its own (the slot it writes was zeroed)."""
    g0 = torch.Generator(device="cpu").manual_seed(0)
    base = torch.randn(64, 96, generator=g0).to(DEV)
    state = Fp8State(DEV, ["d"])
    prev = None
    for factor in (4.0, 1.0, 0.5, 8.0, 2.0):
        g = base * factor
        inv, (q, qt) = state.cast("d", lambda dl, g=g: act_fp8("copy", g=g, fp8=E5, delayed=dl,
                                                                transposed=True))  # fmt: skip
        amax = g.abs().max()
        want_scale = fp8_scale_reference(amax if prev is None else prev, E5)
        torch.testing.assert_close(inv[0], 1 / want_scale, rtol=1e-6, atol=0)
        want_q = (g * want_scale).clamp(-FP8_MAX[E5], FP8_MAX[E5]).to(E5)
        assert torch.equal(q.float(), want_q.float()) and torch.equal(qt.float(), q.float().t())
        torch.testing.assert_close(state.last_amax("d")[0], amax, rtol=0, atol=0)
        prev = amax
    assert state.calls["d"] == 6  # the dry run, then five


def test_weights_and_layernorm_take_delayed_scales_too():
    """Fp8State.cast_weight (act_fp8 copy, e4m3) and ln_fp8 with a Delayed: the same rule."""
    g0 = torch.Generator(device="cpu").manual_seed(1)
    w = torch.randn(48, 32, generator=g0).to(DEV)
    x = (torch.randn(16, 32, generator=g0) * 3).to(DEV)
    lw, lb = torch.ones(32, device=DEV), torch.zeros(32, device=DEV)
    state = Fp8State(DEV, ["w", "y"])
    for step in range(2):
        inv, w8, w8t = state.cast_weight("w", w * (1 + step))
        torch.testing.assert_close(inv[0], 1 / fp8_scale_reference(w.abs().max(), E4))
        assert torch.equal(w8t.float(), w8.float().t())
        inv_y, (_, y8, s_out, _, _) = state.cast(
            "y", lambda dl: ln_fp8(x, lw, lb, 1e-5, delayed=dl, store_y=False)
        )
        ry, *_ = ln_fp8_reference(x, lw, lb, 1e-5)
        assert s_out is inv_y
        torch.testing.assert_close(inv_y[0], 1 / fp8_scale_reference(ry.abs().max(), E4))
        want = (ry.float() / inv_y).clamp(-448, 448)
        assert ((y8.float() - want).abs() <= want.abs() / 8 + 2**-9).all()
