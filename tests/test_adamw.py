"""fused_loss/adamw.py: MultiTensorAdamW against torch.optim.AdamW (the reference), on CPU through
the Triton interpreter and on CUDA."""

import math

import pytest
import torch

from core import optim
from fused_loss.adamw import MultiTensorAdamW

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)
# numels all multiples of 4 (16-byte loads) or not (one of 561, and one spans 3 blocks)
SHAPES = {"aligned": [(64, 48), (48,), (2, 4100)], "ragged": [(33, 17), (17,), (5, 3, 2)]}
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _params(shapes, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen).to(device) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(3)]
    return start, grads


def _groups(params):
    return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0}]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", sorted(SHAPES))
@pytest.mark.parametrize("scale", [None, 3.0])
def test_matches_torch_adamw(device, layout, scale):
    """Three steps, two weight decays, grads divided by grad_scale when it is set; a parameter
    without a grad is skipped (no state, unchanged), as torch's AdamW skips it."""
    start, grads = _params(SHAPES[layout] + [(8,)], device)
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = MultiTensorAdamW(_groups(ours), **HYPER)
    ref_opt = torch.optim.AdamW(_groups(ref), **HYPER, foreach=False)
    if scale is not None:
        opt.grad_scale = torch.full((), scale, device=device)
    for step_grads in grads:
        for p, q, g in zip(ours[:-1], ref[:-1], step_grads, strict=False):
            p.grad, q.grad = g.clone(), g / (scale or 1.0)
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.data, q.data, rtol=1e-6, atol=1e-7)
    for p, q in zip(ours[:-1], ref[:-1], strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = opt.state[p][key], ref_opt.state[q][key]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert opt.state[p]["step"].item() == 3
    assert not opt.state[ours[-1]] and torch.equal(ours[-1].data, start[-1])
    moved = max((p.data - t).abs().max().item() for p, t in zip(ours, start, strict=True))
    assert moved > 1e-3  # the steps did something


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", sorted(SHAPES))
def test_total_norm(device, layout):
    start, grads = _params(SHAPES[layout], device)
    params = [torch.nn.Parameter(t) for t in start]
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    got = MultiTensorAdamW(_groups(params), **HYPER).total_norm()
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads[0]]))
    assert got.device == want.device and got.item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("max_norm", [1.0, math.inf])
def test_clipped_step_with_multi_tensor_adamw(device, max_norm):
    """optim.clipped_step hands MultiTensorAdamW the clip as grad_scale: the same parameters as
    a hand clip + torch's AdamW, clipping on (grads ~10x the limit) and disabled."""
    start, grads = _params(SHAPES["ragged"], device)
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = MultiTensorAdamW(_groups(ours), **HYPER)
    ref_opt = torch.optim.AdamW(_groups(ref), **HYPER, foreach=False)
    for step_grads in grads:
        for p, q, g in zip(ours, ref, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        norm = optim.clipped_step(opt, ours, max_norm)
        torch.nn.utils.clip_grad_norm_(ref, max_norm)
        ref_opt.step()
        want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in step_grads]))
        assert norm.item() == pytest.approx(want.item(), rel=1e-6)
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.data, q.data, rtol=1e-6, atol=1e-7)


def test_state_moves_between_torch_and_ours():
    """A checkpoint's optimizer state loads either way: two steps of ours then one of torch's
    AdamW, and two of torch's then one of ours, both equal three of torch's."""
    start, grads = _params(SHAPES["ragged"], "cpu")

    def run(first, second):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = first(_groups(params), **HYPER)
        for step_grads in grads:
            if step_grads is grads[-1]:
                state = opt.state_dict()
                opt = second(_groups(params), **HYPER)
                opt.load_state_dict(state)
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        return params, opt

    torch_adamw = torch.optim.AdamW
    want, _ = run(torch_adamw, torch_adamw)
    for first, second in ((MultiTensorAdamW, torch_adamw), (torch_adamw, MultiTensorAdamW)):
        got, opt = run(first, second)
        for p, q in zip(got, want, strict=True):
            torch.testing.assert_close(p.data, q.data, rtol=1e-6, atol=1e-7)
        assert all(opt.state[p]["step"].item() == 3 for p in got)


def test_bad_input():
    p = torch.nn.Parameter(torch.zeros(4))
    q = torch.nn.Parameter(torch.zeros(4))
    p.grad, q.grad = torch.ones(4), torch.ones(4)
    with pytest.raises(ValueError, match="lr, betas and eps"):
        MultiTensorAdamW([{"params": [p]}, {"params": [q], "lr": 0.1}], lr=1e-3).step()
    d = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    d.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(TypeError, match="fp32"):
        MultiTensorAdamW([d]).step()


def test_resumed_torch_adamw_keeps_its_kernel_flags():
    """optim.load_optimizer_state: torch's AdamW loading MultiTensorAdamW's state (no "fused" or
    "foreach" in its groups) keeps the kernel it was built with, and the state itself."""
    start, grads = _params(SHAPES["ragged"], "cpu")
    params = [torch.nn.Parameter(t.clone()) for t in start]
    ours = MultiTensorAdamW(_groups(params), **HYPER)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    ours.step()
    for flag in ("foreach", "fused"):  # CPU AdamW has both kernels (torch >= 2.4)
        theirs = torch.optim.AdamW(_groups(params), **HYPER, **{flag: True})
        optim.load_optimizer_state(theirs, ours.state_dict())
        assert all(group[flag] is True for group in theirs.param_groups)
        assert all(theirs.state[p]["step"].item() == 1 for p in params)
        m = theirs.state[params[0]]["exp_avg"]
        torch.testing.assert_close(m, ours.state[params[0]]["exp_avg"])
        theirs.step()  # the loaded state is usable by that kernel
        assert all(theirs.state[p]["step"].item() == 2 for p in params)
