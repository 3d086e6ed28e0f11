"""fused_linear_cross_entropy's options (bias, softcap, z_loss, label_smoothing, return_lse)
against an oracle written out here in float64 (log-sum-exp by hand, no F.cross_entropy), on each
kernel path: the two-read row kernel, the GEMM-epilogue path (exp_gemm.py) and fp32 inputs.

The tolerance rule is test_fused_loss.py's: no further from the oracle than torch's own path at
the same input dtype (linear_cross_entropy_reference: logits in that dtype, then fp32), times a
small factor, plus a small slack. The padded columns are poisoned (huge weights and bias): if
they entered the softmax the loss would be far off.
"""

import pytest
import torch

import fused_loss.linear_cross_entropy as fl
from fused_loss import fused_linear_cross_entropy, linear_cross_entropy_reference

CUDA = torch.cuda.is_available()
needs_kernels = pytest.mark.skipif(
    not CUDA and not fl.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)
OPTIONS = {
    "bias": dict(bias=True),
    "softcap": dict(softcap=3.0),
    "z_loss": dict(z_loss=0.05),
    "smoothing": dict(label_smoothing=0.1),
    "all": dict(bias=True, softcap=3.0, z_loss=0.05, label_smoothing=0.1),
    "all_but_smoothing": dict(bias=True, softcap=3.0, z_loss=0.05),
}


@pytest.fixture(params=["two_reads", "epilogue", "fp32"])
def path(request, monkeypatch):
    """The kernel path: bf16 through softmax_grad_kernel, bf16 through exp_gemm's epilogue
    (label smoothing still takes the two-read kernel there), fp32 (two reads)."""
    for cfg in fl.LAUNCH.values():
        monkeypatch.setitem(cfg, "single_read", request.param == "epilogue")
    return request.param


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _make(N, D, V, vocab, dtype, bias, seed=0, logit_std=2.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * (logit_std / D**0.5)
    w[vocab:] = 30.0  # poison: these columns must never enter the softmax
    b = None
    if bias:
        b = torch.randn(V, generator=g)
        b[vocab:] = 1e3
    t = torch.randint(0, vocab, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.2] = -100
    b = None if b is None else b.to(device)
    return x.to(device, dtype), w.to(device, dtype), b, t.to(device)


def oracle(x, w, t, *, bias=None, vocab_size, reduction="mean", softcap=None, z_loss=0.0,
           label_smoothing=0.0, ignore_index=-100):  # fmt: skip
    """The math in float64, term by term: (loss, lse)."""
    u = x.double() @ w.double()[:vocab_size].T
    if bias is not None:
        u = u + bias.double()[:vocab_size]
    if softcap is not None:
        u = softcap * torch.tanh(u / softcap)
    m = u.max(dim=1, keepdim=True).values
    lse = m[:, 0] + (u - m).exp().sum(dim=1).log()
    valid = t != ignore_index
    u_y = u.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    e = label_smoothing
    loss = (1 - e) * (lse - u_y) + e * (lse - u.mean(dim=1)) + z_loss * lse**2
    loss = torch.where(valid, loss, 0.0)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum().clamp(min=1)
    return loss, lse


def _run(fn, x, w, b, t, upstream, **kw):
    """(loss, dx, dw, db) of upstream * loss."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    loss = fn(x, w, t, bias=b, **kw)
    loss = loss[0] if isinstance(loss, tuple) else loss
    (loss * upstream.to(loss.dtype)).sum().backward()
    return loss.detach(), x.grad, w.grad, None if b is None else b.grad


def _check(x, w, b, t, vocab, upstream, factor=1.25, slack=1e-3, **kw):
    kw = dict(vocab_size=vocab, **kw)
    ours = _run(fused_linear_cross_entropy, x, w, b, t, upstream, **kw)
    ref = _run(oracle, x.double(), w.double(), None if b is None else b.double(), t,
               upstream.double(), **kw)  # fmt: skip
    same = _run(linear_cross_entropy_reference, x, w, b, t, upstream, **kw)
    names = ("loss", "dx", "dw", "db")
    for name, o, r, p in zip(names, ours, ref, same, strict=True):
        if r is None:
            assert o is None
            continue
        assert torch.isfinite(o).all(), name
        err, err_torch = _rel(o, r), _rel(p, r)
        assert err <= factor * err_torch + slack, f"{name}: {err:.2e} vs torch {err_torch:.2e}"
    assert (ours[2][vocab:] == 0).all(), "padded weight rows must get exactly zero gradient"
    if b is not None:
        assert ours[3].dtype == b.dtype and (ours[3][vocab:] == 0).all()
    return ours


@needs_kernels
@pytest.mark.parametrize("shape", [(37, 24, 72, 65), (21, 16, 48, 10)])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_and_all_against_the_oracle(option, shape, path):
    N, D, V, vocab = shape
    opts = dict(OPTIONS[option])
    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    x, w, b, t = _make(N, D, V, vocab, dtype, opts.pop("bias", False), seed=1)
    slack = 1e-5 if dtype == torch.float32 else 1e-3
    _check(x, w, b, t, vocab, torch.tensor(0.37), slack=slack, **opts)


@needs_kernels
@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("option", ["all", "all_but_smoothing"])
def test_options_with_other_reductions(option, reduction, path):
    opts = dict(OPTIONS[option])
    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    x, w, b, t = _make(37, 24, 72, 65, dtype, opts.pop("bias"), seed=2)
    upstream = torch.rand(37) if reduction == "none" else torch.tensor(0.37)
    slack = 1e-5 if dtype == torch.float32 else 1e-3
    _check(x, w, b, t, 65, upstream, reduction=reduction, slack=slack, **opts)


@needs_kernels
@pytest.mark.parametrize("option", ["none", "all", "all_but_smoothing"])
def test_returned_lse(option, path):
    """lse of every row (ignored ones too), fp32, no gradient; the loss is the same as without."""
    opts = dict(OPTIONS.get(option, {}))
    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    x, w, b, t = _make(37, 24, 72, 65, dtype, opts.pop("bias", False), seed=3)
    xg = x.clone().requires_grad_()
    loss, lse = fused_linear_cross_entropy(xg, w, t, bias=b, vocab_size=65, return_lse=True, **opts)
    assert lse.shape == t.shape and lse.dtype == torch.float32 and not lse.requires_grad
    _, lse_ref = oracle(x, w, t, bias=b, vocab_size=65, **opts)
    _, lse_same = linear_cross_entropy_reference(
        x, w, t, bias=b, vocab_size=65, return_lse=True, **opts
    )
    assert _rel(lse, lse_ref) <= 1.25 * _rel(lse_same, lse_ref) + 1e-5
    plain = fused_linear_cross_entropy(x, w, t, bias=b, vocab_size=65, **opts)
    torch.testing.assert_close(loss.detach(), plain, rtol=1e-6, atol=1e-6)


@needs_kernels
def test_rows_far_above_their_target_rebase_with_z_loss(path):
    """Losses above the epilogue's 64-nat step (its per-tile bases and their rescaling), with
    z-loss and a bias on top."""
    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    # logits ~500, where a bf16 step is 2-4 nats: the two-read kernel rounds z and adds b in
    # fp32, torch's path rounds z + b, so with a bias which rounding is luckier would decide
    # dx's error (9e-3 against 5e-3 seen); without one both round the same z (equal errors)
    bias = path != "two_reads"
    x, w, b, t = _make(40, 32, 80, 80, dtype, bias, seed=4, logit_std=40.0)
    x[::3] *= 4
    _check(x, w, b, t, 80, torch.tensor(1.0), z_loss=1e-3)


@needs_kernels
def test_autocast_fp32_master_weight_and_bias():
    """The trainer's case: bf16 autocast, fp32 weight and bias (the epilogue path by default);
    the gradients come back fp32."""
    x, w, b, t = _make(32, 32, 64, 60, torch.float32, True, seed=5)
    opts = dict(softcap=3.0, z_loss=0.05)
    xs, ws, bs = (v.clone().requires_grad_() for v in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(xs, ws, t, bias=bs, vocab_size=60, **opts)
    loss.backward()
    assert ws.grad.dtype == torch.float32 and bs.grad.dtype == torch.float32
    ref = _run(oracle, x, w, b, t, torch.tensor(1.0), vocab_size=60, **opts)
    for o, r in zip((loss, xs.grad, ws.grad, bs.grad), ref, strict=True):
        assert _rel(o, r) < 2e-2
    assert (bs.grad[60:] == 0).all() and (ws.grad[60:] == 0).all()


@needs_kernels
def test_torch_compile_traces_the_options():
    x, w, b, t = _make(32, 16, 48, 40, torch.float32, True, seed=6)

    def f(x, w, t, bias):
        loss, lse = fused_linear_cross_entropy(
            x, w, t, bias=bias, vocab_size=40, softcap=5.0, z_loss=1e-2, label_smoothing=0.1,
            return_lse=True,
        )  # fmt: skip
        return loss * 3.0 + 0 * lse.sum()

    eager = _run(f, x, w, b, t, torch.tensor(1.0))
    compiled = _run(
        torch.compile(f, backend="aot_eager", fullgraph=True), x, w, b, t, torch.tensor(1.0)
    )
    for a, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, c)


def test_bad_options_raise_clear_errors():
    x, w, _, t = _make(8, 16, 32, 32, torch.float32, False)
    f = fused_linear_cross_entropy
    with pytest.raises(ValueError, match="bias must be"):
        f(x, w, t, bias=torch.zeros(31))
    with pytest.raises(TypeError, match="bias must be"):
        f(x, w, t, bias=torch.zeros(32, dtype=torch.int64))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            f(x, w, t, softcap=bad)
    with pytest.raises(ValueError, match="z_loss"):
        f(x, w, t, z_loss=-1e-4)
    with pytest.raises(ValueError, match="label_smoothing"):
        f(x, w, t, label_smoothing=1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("option", ["all", "all_but_smoothing", "softcap", "z_loss"])
@pytest.mark.parametrize("master", [False, True], ids=["bf16_w", "fp32_master"])
def test_gpu_options_at_real_sizes(option, master):
    """124M's classifier shape: bf16 weights (two reads), or an fp32 master weight and bias under
    autocast (the epilogue path, but with label smoothing)."""
    opts = dict(OPTIONS[option])
    N, D, V, vocab = 4096, 768, 50304, 50257
    x, w, b, t = _make(N, D, V, vocab, torch.bfloat16, opts.pop("bias", False), seed=7,
                       device="cuda")  # fmt: skip
    x[::7] *= 6
    opts["softcap"] = 30.0 if "softcap" in opts else None
    if not master:
        _check(x, w, b, t, vocab, torch.tensor(0.5, device="cuda"), factor=1.2, slack=2e-4,
               **opts)  # fmt: skip
        return
    w32, b32 = w.float(), None if b is None else b.float()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = _run(fused_linear_cross_entropy, x, w32, b32, t, torch.tensor(0.5), vocab_size=vocab,
                    **opts)  # fmt: skip
        same = _run(linear_cross_entropy_reference, x, w32, b32, t, torch.tensor(0.5),
                    vocab_size=vocab, **opts)  # fmt: skip
    ref = _run(oracle, x, w32, b32, t, torch.tensor(0.5), vocab_size=vocab, **opts)
    for name, o, r, p in zip(("loss", "dx", "dw", "db"), ours, ref, same, strict=True):
        if r is None:
            continue
        err, err_torch = _rel(o, r), _rel(p, r)
        assert err <= 1.2 * err_torch + 2e-4, f"{name}: {err:.2e} vs torch {err_torch:.2e}"
    assert (ours[2][vocab:] == 0).all()
