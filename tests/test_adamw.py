"""gpt2_fused/kernels/adamw.py: MultiTensorAdamW against adamw_reference (and torch.optim.AdamW,
which the reference must match), on CPU through the Triton interpreter and on CUDA."""

import math

import pytest
import torch
from sm90 import compile_for_sm90, needs_nvidia_backend

from gpt2_fused.kernels.adamw import MultiTensorAdamW, adamw_reference, total_norm_reference
from gpt2_fused.training import optim

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
def test_matches_the_reference_and_torch_adamw(device, layout, scale):
    """Three steps, two weight decays, grads divided by grad_scale when it is set, against
    adamw_reference; the reference itself against torch.optim.AdamW (given the divided grads). A
    parameter without a grad is skipped (no state, unchanged), as torch's AdamW skips it."""
    start, grads = _params(SHAPES[layout] + [(8,)], device)
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    torch_params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = MultiTensorAdamW(_groups(ours), **HYPER)
    torch_opt = torch.optim.AdamW(_groups(torch_params), **HYPER, foreach=False)
    ref = [t.clone() for t in start[:-1]]  # the reference's state: p, m, v of the grad-holders
    ms, vs = [torch.zeros_like(t) for t in ref], [torch.zeros_like(t) for t in ref]
    wds = [0.1] + [0.0] * (len(ref) - 1)  # _groups': decay on the first tensor only
    if scale is not None:
        opt.grad_scale = torch.full((), scale, device=device)
    for t, step_grads in enumerate(grads, start=1):
        for p, q, g in zip(ours[:-1], torch_params[:-1], step_grads, strict=False):
            p.grad, q.grad = g.clone(), g / (scale or 1.0)
        opt.step()
        torch_opt.step()
        adamw_reference(ref, step_grads[: len(ref)], ms, vs, t, lr=HYPER["lr"],
                        betas=HYPER["betas"], eps=HYPER["eps"], weight_decays=wds,
                        grad_scale=scale)  # fmt: skip
    for p, r, q in zip(ours, ref, torch_params, strict=False):
        torch.testing.assert_close(p.data, r, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r, q.data, rtol=1e-6, atol=1e-7)
    for p, m, v, q in zip(ours[:-1], ms, vs, torch_params[:-1], strict=True):
        for key, want in (("exp_avg", m), ("exp_avg_sq", v)):
            torch.testing.assert_close(opt.state[p][key], want, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(want, torch_opt.state[q][key], rtol=1e-6, atol=1e-7)
        assert opt.state[p]["step"].item() == 3
    assert not opt.state[ours[-1]] and torch.equal(ours[-1].data, start[-1])
    moved = max((p.data - t).abs().max().item() for p, t in zip(ours, start, strict=True))
    assert moved > 1e-3  # the steps did something


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casts_are_the_updated_weights_rounded(device, layout, dtype):
    """set_weight_casts: after every step each cast holds its parameter's new value as torch rounds
    it (.to(dtype), nearest-even), and the update itself is the reference's; a parameter with
    no cast, and a cast whose parameter has no grad, are left alone."""
    start, grads = _params(SHAPES[layout] + [(8,)], device)
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [t.clone() for t in start[:-1]]
    ms, vs = [torch.zeros_like(t) for t in ref], [torch.zeros_like(t) for t in ref]
    opt = MultiTensorAdamW(_groups(ours), **HYPER)
    # no cast for the second tensor; the last one never gets a grad
    casted = [p for i, p in enumerate(ours) if i != 1]
    casts = {p: torch.full(p.shape, 7.0, dtype=dtype, device=device) for p in casted}
    opt.set_weight_casts(casts)
    for t, step_grads in enumerate(grads, start=1):
        for p, g in zip(ours[:-1], step_grads, strict=False):
            p.grad = g.clone()
        opt.step()
        adamw_reference(ref, step_grads[: len(ref)], ms, vs, t, lr=HYPER["lr"],
                        betas=HYPER["betas"], eps=HYPER["eps"],
                        weight_decays=[0.1] + [0.0] * (len(ref) - 1))  # fmt: skip
        for p, r in zip(ours, ref, strict=False):
            torch.testing.assert_close(p.data, r, rtol=1e-6, atol=1e-7)
        for p in casted[:-1]:
            assert torch.equal(casts[p], p.data.to(dtype))
        assert torch.all(casts[ours[-1]] == 7.0)  # no grad, no update
    assert (casts[ours[0]].float() - start[0]).abs().max() > 1e-3  # the casts moved


def test_set_weight_casts_refuses_mismatches():
    p = torch.nn.Parameter(torch.zeros(4, 8))
    opt = MultiTensorAdamW([p])
    with pytest.raises(TypeError, match="all bf16 or all fp16"):
        opt.set_weight_casts({p: torch.zeros(4, 8)})
    with pytest.raises(ValueError, match="contiguous, shaped and placed"):
        opt.set_weight_casts({p: torch.zeros(8, 4, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="contiguous, shaped and placed"):
        opt.set_weight_casts({p: torch.zeros(8, 4, dtype=torch.bfloat16).t()})


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", sorted(SHAPES))
def test_total_norm(device, layout):
    start, grads = _params(SHAPES[layout], device)
    params = [torch.nn.Parameter(t) for t in start]
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    got = MultiTensorAdamW(_groups(params), **HYPER).total_norm()
    want = total_norm_reference(grads[0])
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
        want = total_norm_reference(step_grads)
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


# The kernels read every tensor through a table of raw addresses, which hides their alignment
# from the compiler: ALIGNED=True restores it (tl.multiple_of). Without it the loads are 4 bytes
# wide; with it they must be 16 (p, g, m, v: 4 per thread each at BLOCK=4096), and the bf16
# casts' stores 8 (four fp32 elements' worth).
COMPILE = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpt2_fused.kernels import adamw

def build(fn, sig, aligned, **more):
    consts = dict(BLOCK=adamw.BLOCK, ALIGNED=aligned, **more)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n][0] == "*"}
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}),
                    constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=adamw.NUM_WARPS)).asm["ptx"]
    wide = [(op, n) for op in ("ld", "st") for n in (4, 2)]  # 16- and 8-byte accesses
    return [len(re.findall(rf"{op}\.global(?:\.\w+)*\.v{n}\.b32", ptx)) for op, n in wide]

tables = dict(ptrs="*i64", numels="*i64")
blocks = dict(block_tensor="*i32", block_start="*i64")
step = dict(tables, wds="*fp32", **blocks, scale_ptr="*fp32", found_inf_ptr="*fp32", T="i32",
            **{k: "fp32" for k in ("lr", "beta1", "beta2", "eps", "step_size", "bc2_sqrt")})
norm = dict(tables, **blocks, partial="*fp32", T="i32")
casts = dict(INTERPRETED=False)
print(json.dumps({f"{name} {aligned}": build(fn, sig, aligned, **more)
                  for name, fn, sig, more in (
                      ("adamw", adamw.adamw_kernel, step, dict(casts, CASTS=0, SKIPPABLE=False)),
                      ("adamw bf16 casts", adamw.adamw_kernel, step,
                       dict(casts, CASTS=1, SKIPPABLE=False)),
                      ("adamw fp16 casts skippable", adamw.adamw_kernel, step,
                       dict(casts, CASTS=2, SKIPPABLE=True)),
                      ("sumsq", adamw.sumsq_kernel, norm, {}))
                  for aligned in (True, False)}))
"""


@needs_nvidia_backend
def test_adamw_kernels_compile_with_16_byte_accesses():
    got = compile_for_sm90(COMPILE)
    assert got == {
        # [16-byte loads, 8-byte loads, 16-byte stores, 8-byte stores]
        "adamw True": [16, 0, 12, 0],  # p, g, m, v loaded; p, m, v stored
        "adamw False": [0, 0, 0, 0],
        "adamw bf16 casts True": [16, 0, 12, 4],  # + 16 bf16 a thread, in fp32's 4-element runs
        "adamw bf16 casts False": [0, 0, 0, 0],
        "adamw fp16 casts skippable True": [16, 0, 12, 4],  # found_inf masks, not narrows
        "adamw fp16 casts skippable False": [0, 0, 0, 0],
        "sumsq True": [4, 0, 0, 0],
        "sumsq False": [0, 0, 0, 0],
    }
