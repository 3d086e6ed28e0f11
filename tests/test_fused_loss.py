"""fused_linear_cross_entropy against an independent float64 reference.

On CPU the real Triton kernels run under the interpreter (TRITON_INTERPRET=1, set in conftest.py)
on small shapes; the `gpu` tests run them compiled at real sizes. Tolerance rule: the kernel's
error against float64 must be no worse than PyTorch's own error at the same input dtype (logits in
that dtype, then fp32 cross-entropy) times a small factor, plus a small absolute slack.
"""

import weakref

import pytest
import torch

import fused_loss.linear_cross_entropy as fl
from fused_loss import exp_gemm, fused_linear_cross_entropy, linear_cross_entropy_reference

CUDA = torch.cuda.is_available()
needs_kernels = pytest.mark.skipif(
    not CUDA and not fl.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


@pytest.fixture(autouse=True, params=[False, True], ids=["two_reads", "single_read"])
def row_kernel(request, monkeypatch):
    """Every test runs with both row kernels (softmax_grad_kernel, exp_rows_kernel)."""
    for cfg in fl.LAUNCH.values():
        monkeypatch.setitem(cfg, "single_read", request.param)
    return request.param


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _make(N, D, V, vocab, dtype, device, ignore_frac=0.0, logit_std=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * (logit_std / D**0.5)
    t = torch.randint(0, vocab, (N,), generator=g)
    t[torch.rand(N, generator=g) < ignore_frac] = -100
    return x.to(device, dtype), w.to(device, dtype), t.to(device)


def _run(fn, x, w, t, upstream, **kw):
    """Loss and grads of upstream * loss (a tensor upstream for reduction='none')."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = fn(x, w, t, **kw)
    (loss * upstream.to(loss.dtype)).sum().backward()
    return loss.detach(), x.grad, w.grad


def _check(x, w, t, vocab, reduction, upstream, factor=1.25, slack=1e-3):
    kw = dict(reduction=reduction, vocab_size=vocab)
    ours = _run(fused_linear_cross_entropy, x, w, t, upstream, **kw)
    ref64 = _run(linear_cross_entropy_reference, x.double(), w.double(), t, upstream.double(), **kw)
    torch_same_dtype = _run(linear_cross_entropy_reference, x, w, t, upstream, **kw)
    assert ours[1].dtype == x.dtype and ours[2].dtype == w.dtype
    for name, o, r, p in zip(("loss", "dx", "dw"), ours, ref64, torch_same_dtype, strict=True):
        assert torch.isfinite(o).all(), name
        if r.abs().max() == 0:  # e.g. everything ignored: must be exactly zero too
            assert o.abs().max() == 0, name
            continue
        err, err_torch = _rel(o, r), _rel(p, r)
        assert err <= factor * err_torch + slack, f"{name}: {err:.2e} vs torch {err_torch:.2e}"
    if vocab < w.shape[0]:
        assert (ours[2][vocab:] == 0).all(), "padded rows must get exactly zero gradient"
    return ours


SHAPES = [
    (64, 32, 128, 128),  # aligned to the interpreter's tiles
    (37, 24, 70, 65),  # ragged N, D, V, and padded columns
    (21, 16, 40, 10),  # vocab smaller than one block: every block masked
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_reference(shape, dtype, reduction):
    N, D, V, vocab = shape
    x, w, t = _make(N, D, V, vocab, dtype, "cpu", ignore_frac=0.2)
    upstream = torch.rand(N) if reduction == "none" else torch.tensor(0.37)
    _check(x, w, t, vocab, reduction, upstream)


PEER = getattr(torch.nn.functional, "linear_cross_entropy", None)  # torch >= 2.13


@needs_kernels
@pytest.mark.skipif(PEER is None, reason="torch.nn.functional.linear_cross_entropy: torch >= 2.13")
@pytest.mark.parametrize("chunked", [False, True], ids=["reference", "batch_chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_linear_cross_entropy(reduction, dtype, chunked):
    """A peer from outside this repo: torch's own F.linear_cross_entropy (its logits-then-
    cross_entropy path, and its batch-chunked one) on the real vocab_size rows of W. In fp32 the
    two agree to rounding; in bf16 ours is no further from float64 than torch's chunked loss."""
    N, D, V, vocab = 37, 24, 70, 65  # ragged, with padded classifier rows
    x, w, t = _make(N, D, V, vocab, dtype, "cpu", ignore_frac=0.2, seed=3)
    upstream = torch.rand(N) if reduction == "none" else torch.tensor(0.37)
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=8) if chunked else None

    def peer(x, w, t, reduction, vocab_size):
        return PEER(x, w[:vocab_size], t, reduction=reduction, ignore_index=-100, options=options)

    kw = dict(reduction=reduction, vocab_size=vocab)
    ours = _run(fused_linear_cross_entropy, x, w, t, upstream, **kw)
    theirs = _run(peer, x, w, t, upstream, **kw)
    ref64 = _run(peer, x.double(), w.double(), t, upstream.double(), **kw)
    assert (ours[2][vocab:] == 0).all() and (theirs[2][vocab:] == 0).all()
    for name, o, p, r in zip(("loss", "dx", "dw"), ours, theirs, ref64, strict=True):
        if dtype == torch.float32:
            assert _rel(o, p) <= 1e-5, (name, _rel(o, p))
        else:
            assert _rel(o, r) <= 1.25 * _rel(p, r) + 1e-3, (name, _rel(o, r), _rel(p, r))


@needs_kernels
@pytest.mark.parametrize("ignore_frac", [0.0, 0.2, 1.0])
def test_ignored_targets(ignore_frac):
    x, w, t = _make(48, 32, 96, 90, torch.float32, "cpu", ignore_frac=ignore_frac)
    loss, dx, dw = _check(x, w, t, 90, "mean", torch.tensor(1.0))
    if ignore_frac == 1.0:  # mean over nothing is 0, not NaN, with zero grads
        assert loss.item() == 0.0 and dx.abs().max() == 0 and dw.abs().max() == 0


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaky_logits(dtype):
    # Large-magnitude rows: a near one-hot softmax, where a careless exp overflows.
    x, w, t = _make(40, 32, 80, 80, dtype, "cpu", logit_std=40.0, seed=1)
    x[::3] *= 4
    _check(x, w, t, 80, "mean", torch.tensor(1.0))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_late_row_max_rebases(dtype):
    # The last columns carry logits ~300 nats above the first block's: the single-read kernel must
    # rebase those rows (REBASE = 60) and rescale what it already wrote; both kernels must agree
    # with the reference.
    x, w, t = _make(24, 32, 80, 80, dtype, "cpu", seed=9)
    w[72:] *= 150.0
    x[::2] *= 3
    _check(x, w, t, 80, "mean", torch.tensor(1.0))
    _check(x, w, t, 80, "none", torch.rand(24))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_confident_correct_predictions(dtype):
    # Targets at the argmax with p ~ 0.99: the target's gradient g (p - 1) is small next to p,
    # so forming it from a rounded p loses it (cancellation); it must be as exact as torch's.
    x, w, t = _make(48, 32, 80, 80, torch.float64, "cpu", logit_std=1.0, seed=11)
    wt = w[t]
    x = x + 12.0 * wt / (wt * wt).sum(-1, keepdim=True)  # the target logit +12: p ~ 0.98
    assert torch.softmax(x @ w.T, -1).gather(1, t[:, None]).mean() > 0.97
    x, w = x.to(dtype), w.to(dtype)
    t[::5] = -100
    _check(x, w, t, 80, "mean", torch.tensor(1.0))
    _check(x, w, t, 80, "none", torch.rand(48))


def test_chunks_on_the_gpu_stay_in_the_memory_allowance():
    # A bf16 weight's buffer and fp32 dw accumulator share EXTRA_BYTES (the lean
    # allowance); without an accumulator (the fp32 master weight) a chunk has at least
    # MIN_CHUNK_ELEMENTS // D rows, the chunking measured fastest at the 124M and 1558M shapes.
    V = 50304
    for N, D in ((32768, 768), (65536, 768), (16384, 1600), (8192, 1024)):
        acc = V * D * 4
        n = fl.rows_per_chunk(N, V, D, 2, acc, cuda=True)
        assert n * V * 2 + acc <= fl.EXTRA_BYTES or n == fl.MIN_ROWS
        m = fl.rows_per_chunk(N, V, D, 2, 0, cuda=True)
        k, least = -(-N // m), fl.MIN_CHUNK_ELEMENTS // D // fl.CHUNK_MULTIPLE * fl.CHUNK_MULTIPLE
        assert m >= n and k <= -(-N // least)  # no more chunks than least rows make
        assert m * k - N < k  # equal chunks
    assert fl.rows_per_chunk(32768, V, 768, 2, V * 768 * 4, cuda=True) == 1725  # 19 chunks
    assert fl.rows_per_chunk(32768, V, 768, 2, 0, cuda=True) == 6554  # 5
    assert fl.rows_per_chunk(16384, V, 1600, 2, 0, cuda=True) == 3277  # 5, as 320 MiB gives
    assert fl.rows_per_chunk(16384, V, 1600, 2, V * 1600 * 4, cuda=True) == 1024  # MIN_ROWS


@needs_kernels
def test_many_chunks(monkeypatch):
    # A tiny memory budget forces several row chunks: dw accumulates across them in fp32 (a
    # temporary for bf16 weights, which takes its share of the budget), dx is written per chunk.
    V, D = 96, 32
    acc = V * D * 4
    monkeypatch.setattr(fl, "EXTRA_BYTES", acc + 32 * V * 2)
    assert fl.chunk_rows(150, V, 2, acc, multiple=16, min_rows=16) == 32
    assert fl.chunk_rows(150, V, 4, 0, multiple=16, min_rows=16) == 48
    for dtype in (torch.float32, torch.bfloat16):
        x, w, t = _make(150, 32, V, 90, dtype, "cpu", ignore_frac=0.1, seed=2)
        _check(x, w, t, 90, "mean", torch.tensor(2.0))
        _check(x, w, t, 90, "none", torch.rand(150))


def test_register_cap_fits_the_programs_per_sm():
    assert fl.row_kernel_maxnreg(8, 4) == 64  # 65536 registers / (4 programs x 256 threads)
    assert fl.row_kernel_maxnreg(16, 2) == 64
    assert fl.row_kernel_maxnreg(8, 3) == 80  # 85, rounded down to ptxas's granularity of 8
    assert fl.row_kernel_maxnreg(4, 1) == 248  # below the 255 a thread can address
    cfg = dict(fl.LAUNCH["cuda"], num_warps=8, per_sm=4)
    assert fl.row_kernel_options(cfg, cuda=True) == dict(num_warps=8, maxnreg=64)
    assert fl.row_kernel_options(cfg, cuda=False) == dict(num_warps=8)  # the interpreter


def test_single_read_auto_leaves_out_fp16_and_crowded_accumulators():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert fl.use_single_read("auto", bf16, fp32)  # fp32 master weight under autocast
    assert fl.use_single_read("auto", bf16, fp32, roomy=False)  # no accumulator to crowd it
    assert fl.use_single_read("auto", bf16, bf16)  # the 124M shape
    assert not fl.use_single_read("auto", bf16, bf16, roomy=False)  # the 1558M shape
    assert fl.use_single_read("auto", fp32, fp32)
    assert not fl.use_single_read(True, fp16, fp16)  # E up to e^60 overflows fp16
    assert not fl.use_single_read(False, bf16, fp32)


@needs_kernels
def test_padded_rows_are_inert():
    # Poisoning the padded rows of w must change nothing, bit for bit, and their grad stays 0
    # (the launcher writes -inf into their logit columns)
    x, w, t = _make(40, 32, 80, 70, torch.bfloat16, "cpu", ignore_frac=0.2, seed=3)
    clean = _run(fused_linear_cross_entropy, x, w, t, torch.tensor(1.0), vocab_size=70)
    w_bad = w.clone()
    w_bad[70:] = 3e4
    poisoned = _run(fused_linear_cross_entropy, x, w_bad, t, torch.tensor(1.0), vocab_size=70)
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.equal(a, b)
    assert (poisoned[2][70:] == 0).all()
    _check(x, w, t, 70, "mean", torch.tensor(1.0))


def _out_of_range_case(N, D, V, vocab, device):
    x, w, t = _make(N, D, V, vocab, torch.bfloat16, device, ignore_frac=0.2, seed=5)
    bad_rows = [1, 7, 12, N - 1]
    y = t.clone()
    y[bad_rows] = torch.tensor([vocab, V + 100, -3, 10**6], device=device)
    g = torch.ones(1, device=device)
    kw = dict(ignore_index=-100, vocab_size=vocab, want_grad=True, g_per_row=False)
    losses, _, dx, dw, _ = fl.lce_pass(
        x, w, y, g, **kw
    )  # below the public checks, which would raise
    good = torch.ones(N, dtype=torch.bool, device=device)
    good[bad_rows] = False
    assert losses[bad_rows].isnan().all()
    assert torch.isfinite(losses[good]).all() and torch.isfinite(dx).all()
    assert (dw[vocab:] == 0).all(), "no gradient may reach a padded row, whatever the target"
    # the good rows' losses are those of the same rows alone (close, not equal: on the GPU a
    # GEMM with another row count may pick another kernel)
    alone, *_ = fl.lce_pass(x[good], w, y[good], g, **kw)
    torch.testing.assert_close(losses[good], alone, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_out_of_range_targets_give_nan_loss_and_touch_nothing_else():
    """On the GPU targets are not range-checked (a host sync), so the kernels must cope: a bad
    target's row gets a NaN loss and no one-hot, and no other row, column or buffer changes."""
    _out_of_range_case(24, 16, 48, 40, "cpu")


@needs_kernels
def test_autocast_fp32_master_weight():
    # bf16 activations under autocast with an fp32 weight: matmuls in bf16, dw comes back fp32.
    x, w, t = _make(32, 32, 64, 60, torch.float32, "cpu", seed=4)
    xs = x.clone().requires_grad_()
    ws = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(xs, ws, t, vocab_size=60)
    loss.backward()
    assert loss.dtype == torch.float32 and xs.grad.dtype == torch.float32
    assert ws.grad.dtype == torch.float32
    ref = _run(
        linear_cross_entropy_reference, x.double(), w.double(), t, torch.tensor(1.0), vocab_size=60
    )
    assert (
        _rel(loss, ref[0]) < 1e-2 and _rel(xs.grad, ref[1]) < 2e-2 and _rel(ws.grad, ref[2]) < 2e-2
    )


@needs_kernels
def test_weight_cast_is_read_in_place_of_the_fresh_cast():
    """weight_cast (the optimizer's kept bf16 copy) gives what the cast made per call gives, bit
    for bit, with the gradient on the fp32 weight; the GEMMs read it (a different cast gives a
    different loss); a cast of the wrong shape or dtype is refused."""
    x, w, t = _make(32, 32, 64, 60, torch.float32, "cpu", seed=4)

    def run(cast):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fused_linear_cross_entropy(xs, ws, t, vocab_size=60, weight_cast=cast)
        loss.backward()
        return loss, xs.grad, ws.grad

    fresh, kept = run(None), run(w.to(torch.bfloat16))
    assert kept[2].dtype == torch.float32
    for a, b in zip(fresh, kept, strict=True):
        assert torch.equal(a, b)
    other = run((w * 1.5).to(torch.bfloat16))
    assert abs(other[0].item() - fresh[0].item()) > 1e-3
    for bad in (w.to(torch.float16), w[:-1].to(torch.bfloat16), "w"):
        with pytest.raises(ValueError, match="weight_cast must be"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fused_linear_cross_entropy(x, w, t, vocab_size=60, weight_cast=bad)


@needs_kernels
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_tokens(reduction):
    # An empty batch: loss 0 (mean over nothing is 0, as with all targets ignored), or an empty
    # vector for "none"; gradients are zero, not NaN.
    x, w, t = _make(0, 16, 40, 40, torch.float32, "cpu")
    loss, dx, dw = _run(fused_linear_cross_entropy, x, w, t, torch.tensor(1.0), reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert loss.sum().item() == 0.0 and dx.shape == (0, 16) and (dw == 0).all()


@needs_kernels
def test_float16():
    x, w, t = _make(40, 32, 80, 75, torch.float16, "cpu", ignore_frac=0.1, seed=10)
    _check(x, w, t, 75, "mean", torch.tensor(1.0))


@needs_kernels
def test_no_grad_forward_and_leading_dims():
    x, w, t = _make(24, 16, 40, 40, torch.float32, "cpu", seed=5)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x.view(4, 6, 16), w, t.view(4, 6), reduction="none")
    ref = linear_cross_entropy_reference(x.double(), w.double(), t, reduction="none")
    assert loss.shape == (4, 6)
    assert _rel(loss.view(-1), ref) < 1e-5


def test_accumulator_parts():
    """Parts exactly when dw's cast would outgrow the chunk buffer: 1558M 2, 124M 1, 256k 3."""
    V = 50304
    assert fl.accumulator_parts(V, V * 1600 * 2, 1024 * V * 2) == [(0, 25152), (25152, V)]
    assert fl.accumulator_parts(V, V * 768 * 2, 1725 * V * 2) == [(0, V)]
    assert fl.accumulator_parts(V, 0, 1024 * V * 2) == [(0, V)]  # fp32 dw: no cast
    V = 256000  # 1125 MiB cast against a 500 MiB buffer: 3 parts of <= 375 MiB
    assert fl.accumulator_parts(V, V * 2304 * 2, 1024 * V * 2) == [
        (0, 85333),
        (85333, 170666),
        (170666, V),
    ]
    assert len(fl.accumulator_parts(100, 10**9, 1)) == 8  # capped
    # on CUDA the boundaries are multiples of 64 rows (aligned slices for cuBLAS)
    assert fl.accumulator_parts(V, V * 2304 * 2, 1024 * V * 2, align=64) == [
        (0, 85376),
        (85376, 170688),
        (170688, V),
    ]
    assert fl.accumulator_parts(100, 10**9, 1, align=64) == [(0, 64), (64, 100)]


@needs_kernels
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_dw_accumulated_in_parts(monkeypatch, reduction):
    """A small chunk budget (4 chunks of 13 rows) makes bf16 dw's cast 3.1x the buffer: the fp32
    accumulator is then split in four row ranges, and the results must not change."""
    seen = []

    def parts(*args, **kw):
        seen.append(fl_parts(*args, **kw))
        return seen[-1]

    # the point of the parts is memory: each fp32 part must be freed once cast, before the casts
    # are joined (a part kept alive to the join costs +153.5 MiB at 1558M)
    refs, joins = [], []

    def accumulate(accs, parts, g_t, xs, first):
        if first:
            refs.extend(weakref.ref(a) for a in accs)
        return fl_accumulate(accs, parts, g_t, xs, first)

    def cat(tensors, *args, **kw):
        joins.append([r() is None for r in refs])
        return torch_cat(tensors, *args, **kw)

    fl_parts, fl_accumulate, torch_cat = fl.accumulator_parts, fl._accumulate_dw, torch.cat
    monkeypatch.setattr(fl, "EXTRA_BYTES", 0)  # chunks of the minimum, 16 rows on CPU
    monkeypatch.setattr(fl, "accumulator_parts", parts)
    monkeypatch.setattr(fl, "_accumulate_dw", accumulate)
    monkeypatch.setattr(torch, "cat", cat)
    x, w, t = _make(50, 40, 70, 65, torch.bfloat16, "cpu", ignore_frac=0.2, seed=11)
    upstream = torch.rand(50) + 0.5 if reduction == "none" else torch.tensor(0.7)
    _check(x, w, t, 65, reduction, upstream)
    assert [(0, 17), (17, 35), (35, 52), (52, 70)] in seen
    assert len(refs) >= 4 and joins and all(all(j) for j in joins)  # all parts freed at joins


@needs_kernels
def test_second_backward_through_the_graph_raises():
    """The backward scales the saved gradients in place: a second backward through the same graph
    (retain_graph) must be refused by autograd's version check, not return g^2-scaled grads."""
    x, w, t = _make(16, 16, 32, 32, torch.float32, "cpu", seed=7)
    x.requires_grad_()
    w.requires_grad_()
    loss = fused_linear_cross_entropy(x, w, t) * 3.0
    loss.backward(retain_graph=True)
    ref = _run(linear_cross_entropy_reference, x, w, t, torch.tensor(3.0))
    torch.testing.assert_close(x.grad, ref[1], rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@needs_kernels
def test_torch_compile_traces_the_custom_op():
    x, w, t = _make(32, 16, 48, 40, torch.float32, "cpu", seed=6)

    def f(x, w, t):
        return fused_linear_cross_entropy(x, w, t, vocab_size=40) * 3.0

    eager = _run(f, x, w, t, torch.tensor(1.0))
    compiled = _run(
        torch.compile(f, backend="aot_eager", fullgraph=True), x, w, t, torch.tensor(1.0)
    )
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)


@needs_kernels
def test_compiled_backward_scales_without_the_in_place_op():
    """Traced by torch.compile, the backward forms dx * g and dw * g as plain products, which
    Inductor fuses into the kernels that read them; the in-place op would make it copy the saved
    tensors first. The gradients match float64 torch's as in eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    x, w, t = _make(32, 16, 48, 40, torch.float32, "cpu", seed=8)
    upstream = torch.tensor(0.7)  # g != 1, so a missing or doubled scale shows

    def f(x, w, t):
        return fused_linear_cross_entropy(x, w, t, vocab_size=40)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    compiled = _run(torch.compile(f, backend=backend, fullgraph=True), x, w, t, upstream)
    ref64 = _run(linear_cross_entropy_reference, x.double(), w.double(), t, upstream.double(),
                 vocab_size=40)  # fmt: skip
    for o, r in zip(compiled, ref64, strict=True):
        torch.testing.assert_close(o.double(), r.double(), rtol=1e-4, atol=1e-6)
    forward, backward = graphs
    assert "lce_forward" in forward and "scale_grads_" not in backward
    assert backward.count("aten.mul") >= 2  # dx * g, dw * g


def test_bad_inputs_raise_clear_errors():
    x, w, t = _make(8, 16, 32, 32, torch.float32, "cpu")
    f = fused_linear_cross_entropy
    with pytest.raises(ValueError, match="last dim"):
        f(x[:, :8], w, t)
    with pytest.raises(ValueError, match="targets shape"):
        f(x, w, t[:4])
    with pytest.raises(TypeError, match="targets must be int64"):
        f(x, w, t.float())
    with pytest.raises(TypeError, match="floating point"):
        f(x.int(), w, t)
    with pytest.raises(ValueError, match="outside"):
        f(x, w, torch.full_like(t, 32))
    with pytest.raises(ValueError, match="outside"):
        f(x, w, t, vocab_size=4)
    with pytest.raises(ValueError, match="V > 0 and D > 0"):
        f(x[:, :0], w[:, :0], t)
    with pytest.raises(ValueError, match="reduction"):
        f(x, w, t, reduction="avg")
    t_ok = t.clone()
    t_ok[0] = -100  # ignore_index is allowed
    f(x, w, t_ok)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "shape", [(4096, 768, 50304, 50257), (1000, 1600, 50304, 50257), (777, 200, 4099, 4001)]
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("gemm", ["cublaslt", "torch"])
def test_gpu_real_sizes(shape, reduction, gemm, monkeypatch):
    # gemm "torch": the chunk GEMMs where libcublasLt does not load (torch's own calls)
    if gemm == "torch":
        monkeypatch.setattr(fl.cublaslt, "available", lambda: False)
    N, D, V, vocab = shape
    x, w, t = _make(N, D, V, vocab, torch.bfloat16, "cuda", ignore_frac=0.05, seed=7)
    x[::7] *= 6  # some peaky rows
    upstream = (
        torch.rand(N, device="cuda") if reduction == "none" else torch.tensor(0.5, device="cuda")
    )
    _check(x, w, t, vocab, reduction, upstream, factor=1.2, slack=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_out_of_range_targets():
    _out_of_range_case(4096, 768, 50304, 50257, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_confident_correct_predictions():
    # As test_confident_correct_predictions, at the real vocabulary: p_y ~ 0.98 on most rows.
    x, w, t = _make(2048, 768, 50304, 50257, torch.float32, "cuda", logit_std=1.0, seed=12)
    wt = w[t]
    x = x + 14.0 * wt / (wt * wt).sum(-1, keepdim=True)
    x, w = x.bfloat16(), w.bfloat16()
    t[::9] = -100
    _check(x, w, t, 50257, "mean", torch.tensor(1.0, device="cuda"), factor=1.2, slack=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_many_chunks_fp32_master(monkeypatch):
    monkeypatch.setattr(fl, "EXTRA_BYTES", 8 * 2**20)  # MIN_ROWS-row chunks: 3 of them
    monkeypatch.setattr(fl, "MIN_CHUNK_ELEMENTS", 0)  # (an fp32 dw's larger chunks: 1 of 3000)
    assert fl.rows_per_chunk(3000, 50304, 768, 2, 0, cuda=True) == 1000
    x, w, t = _make(3000, 768, 50304, 50257, torch.float32, "cuda", ignore_frac=0.05, seed=8)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(xs, ws, t, vocab_size=50257)
    loss.backward()
    ref = _run(
        linear_cross_entropy_reference,
        x.double(),
        w.double(),
        t,
        torch.tensor(1.0, device="cuda"),
        vocab_size=50257,
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tb = _run(
            linear_cross_entropy_reference,
            x,
            w,
            t,
            torch.tensor(1.0, device="cuda"),
            vocab_size=50257,
        )
    assert ws.grad.dtype == torch.float32 and (ws.grad[50257:] == 0).all()
    for o, r, p in zip((loss, xs.grad, ws.grad), ref, tb, strict=True):
        assert _rel(o, r) <= 1.2 * _rel(p, r) + 2e-4


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_single_read_dw_against_torch(row_kernel):
    # test_single_read_dw_against_torch at the 124M width and the real vocabulary: bf16 weights
    # (the one-hot out of E: dw 1.7e-3 against torch bf16's 2.2e-3, bench/RESULTS.md#fused-loss),
    # and the fp32 master weight under autocast (the one-hot folded into E)
    if not row_kernel:
        pytest.skip("the single read's errors; the two-read kernel's are torch's (G in bf16)")
    x, w, t = _make(4096, 768, 50304, 50257, torch.bfloat16, "cuda", ignore_frac=0.05, seed=9)
    one = torch.tensor(1.0, device="cuda")
    kw = dict(vocab_size=50257)
    _, dx64, dw64 = _run(linear_cross_entropy_reference, x.double(), w.double(), t, one, **kw)
    _, dx_t, dw_t = _run(linear_cross_entropy_reference, x, w, t, one, **kw)  # torch, bf16
    _, dx, dw = _run(fused_linear_cross_entropy, x, w, t, one, **kw)
    assert dw.dtype == torch.bfloat16 and _rel(dw, dw64) < 0.9 * _rel(dw_t, dw64)
    assert _rel(dx, dx64) < 0.9 * _rel(dx_t, dx64)
    xs, ws = x.clone().requires_grad_(), w.float().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused_linear_cross_entropy(xs, ws, t, **kw).backward()
    assert ws.grad.dtype == torch.float32 and _rel(ws.grad, dw64) < 1.2 * _rel(dw_t, dw64)
    assert _rel(xs.grad, dx64) < 1.2 * _rel(dx_t, dx64)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_repeats_bit_for_bit_with_rebased_rows():
    # Peaky rows whose max passes their target's logit by > exp_gemm.REBASE: the finish kernel
    # rescales their tiles, then folds in the one-hot. Run after run the results must be the
    # same bits (a missing barrier between those stores lost the one-hot in a few rows per run)
    x, w, t = _make(4096, 768, 50304, 50257, torch.bfloat16, "cuda", ignore_frac=0.05, seed=7)
    x[::7] *= 6
    g = torch.full((1,), 1e-3, device="cuda")
    kw = dict(ignore_index=-100, vocab_size=50257, want_grad=True, g_per_row=False)
    first = fl.lce_pass(x, w, t, g, **kw)
    for _ in range(6):
        for a, b in zip(first, fl.lce_pass(x, w, t, g, **kw), strict=True):
            assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("shape", [(37, 24, 80, 70), (64, 32, 128, 128), (21, 16, 48, 10)])
def test_exp_gemm_matches_its_torch_reference(shape, row_kernel):
    # The logits GEMM with E in its epilogue (fused_loss/exp_gemm.py), one chunk: G = f E - h
    # onehot and the losses against the same math in fp32 torch; ragged rows and tiles, padded
    # columns, ignored and out-of-range targets (dead rows: E = 0, f = h = 0, loss 0 or NaN), rows
    # whose p_y >= 1/2 (the one-hot folded into E), rows below the buffer's end untouched
    if not row_kernel:
        pytest.skip("calls exp_gemm directly: the row-kernel setting does not reach it")
    n, D, V, vocab = shape
    x, w, t = _make(n, D, V, vocab, torch.bfloat16, "cpu", ignore_frac=0.2, seed=13)
    t[3] = vocab + 1
    sure = [i for i in range(4, n) if t[i] >= 0][:3]  # rows made confident: p_y > 1/2
    wt = w[t[sure]].float()
    x[sure] = (wt * (12.0 / (wt * wt).sum(1, keepdim=True))).to(x.dtype)  # z_y = 12
    g = torch.rand(n)
    buf = torch.full((n + 5, V), 7.0, dtype=torch.bfloat16)
    losses, f, h = torch.empty(n), torch.empty(n), torch.empty(n)
    state = exp_gemm.scratch(n, V, x.device)
    kw = dict(vocab_size=vocab, ignore_index=-100)
    exp_gemm.start(x, w, t, buf[:n], state, **kw)
    exp_gemm.finish(buf[:n], t, g, state, losses, f, h, g_per_row=True, want_grad=True, **kw)
    e, f_ref, h_ref, loss_ref = exp_gemm.exp_logits_reference(x, w, t, g, **kw)
    assert torch.equal(h == 0, h_ref == 0) and (h[sure] == 0).all()  # folded where p_y >= 1/2
    assert (h_ref != 0).sum() > n // 2  # and not elsewhere
    G, G_ref = _one_hot_out(buf[:n].float(), f, h, t), _one_hot_out(e, f_ref, h_ref, t)
    assert _rel(G, G_ref) < 4e-3  # E rounded once to bf16
    assert torch.equal(losses.isnan(), loss_ref.isnan()) and losses[3].isnan()
    torch.testing.assert_close(losses.nan_to_num(), loss_ref.nan_to_num(), rtol=1e-5, atol=1e-5)
    assert (f[t == -100] == 0).all() and (h[t == -100] == 0).all() and h[3] == 0
    assert (buf[:n][t == -100] == 0).all() and (buf[n:] == 7).all()
    # without h (an fp32 dw): the one-hot folded into E on every live row, G = diag(f) E
    exp_gemm.start(x, w, t, buf[:n], state, **kw)
    exp_gemm.finish(buf[:n], t, g, state, losses, f, None, g_per_row=True, want_grad=True, **kw)
    e, f_ref, _, _ = exp_gemm.exp_logits_reference(x, w, t, g, hot=False, **kw)
    assert _rel(buf[:n].float() * f[:, None], e * f_ref[:, None]) < 4e-3


@needs_kernels
@pytest.mark.parametrize("logits", ["exp_gemm", "cublas"])
def test_single_read_dw_against_torch(logits, monkeypatch, row_kernel):
    # The one-hot term is most of G (1 against |p| ~ V^-1/2 for a flat softmax). With a bf16 dw
    # it is added in fp32 outside the GEMMs (dw 1.7e-3 / 2.3e-3 here with exp_gemm / the cuBLAS
    # logits GEMM, dx 1.7e-3 / 2.3e-3), below the bounds; folded into E it would be rounded twice
    # more and pass them. An fp32 dw (the master weight) keeps the fold: its dw is rounded once.
    # torch bf16 here: 3.4e-3, 3.4e-3
    if not row_kernel:
        pytest.skip("single read only")
    if logits == "cublas":  # the path where exp_gemm does not apply (before Hopper)
        monkeypatch.setattr(exp_gemm, "applies", lambda x, w: False)
    x, w, t = _make(256, 64, 512, 500, torch.bfloat16, "cpu", ignore_frac=0.1, seed=21)
    one, kw = torch.tensor(1.0), dict(vocab_size=500)
    _, dx64, dw64 = _run(linear_cross_entropy_reference, x.double(), w.double(), t, one, **kw)
    _, dx_t, dw_t = _run(linear_cross_entropy_reference, x, w, t, one, **kw)
    _, dx, dw = _run(fused_linear_cross_entropy, x, w, t, one, **kw)
    dw_max, dx_max = (2.2e-3, 2.0e-3) if logits == "exp_gemm" else (2.7e-3, 2.55e-3)
    assert dw.dtype == torch.bfloat16 and _rel(dw, dw64) < dw_max
    assert _rel(dx, dx64) < dx_max
    _, dx, dw = _run(fused_linear_cross_entropy, x, w.float(), t, one, **kw)
    assert dw.dtype == torch.float32 and _rel(dw, dw64) < 1.2 * _rel(dw_t, dw64)
    assert _rel(dx, dx64) < 1.2 * _rel(dx_t, dx64)


@needs_kernels
def test_one_hot_term_sums_runs_of_equal_targets(row_kernel):
    # _subtract_one_hot against index_put_'s accumulation: runs of one target longer than a block
    # (4 sorted rows on CPU) and spanning several, runs that end on a block's edge, ignored rows,
    # rows with h = 0, targets in each of three parts of dw and the bias gradient
    if not row_kernel:
        pytest.skip("one launch of the kernels: the row-kernel setting does not reach it")
    g = torch.Generator().manual_seed(5)
    N, D, V = 61, 20, 30
    y = torch.randint(0, V, (N,), generator=g)
    y[torch.randperm(N, generator=g)[:23]] = 7  # a run of 20+ rows: 6+ blocks
    y[torch.randperm(N, generator=g)[:5]] = 29
    y[:3] = -100
    h = torch.rand(N, generator=g)
    h[y == -100] = 0
    h[::11] = 0
    x = torch.randn(N, D, generator=g).to(torch.bfloat16)
    parts = [(0, 7), (7, 8), (8, V)]
    accs = [torch.randn(b - a, D, generator=g) for a, b in parts]
    db = torch.randn(V, generator=g)
    want = torch.cat(accs).clone()
    keep = y >= 0
    want.index_put_((y[keep],), -(h[keep, None] * x[keep].float()), accumulate=True)
    db_want = db.clone().index_put_((y[keep],), -h[keep], accumulate=True)
    fl._subtract_one_hot(accs, parts, db, y, h, x, fl.LAUNCH["cpu"])
    torch.testing.assert_close(torch.cat(accs), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(db, db_want, rtol=0, atol=1e-5)


def _one_hot_out(e, f, h, t):
    """G = diag(f) e - diag(h) onehot(t) (the single read's G, triton_kernels.py)."""
    G = e * f[:, None]
    rows = torch.nonzero(h != 0)[:, 0]
    G[rows, t[rows]] -= h[rows]
    return G


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_read_with_the_cublas_logits_gemm(dtype, monkeypatch, row_kernel):
    # The chunk GEMM then exp_rows_kernel: the path where exp_gemm does not apply (before
    # Hopper, unaligned shapes), bf16 included
    if not row_kernel:
        pytest.skip("single read only")
    monkeypatch.setattr(exp_gemm, "applies", lambda x, w: False)
    x, w, t = _make(64, 32, 128, 120, dtype, "cpu", ignore_frac=0.2, seed=14)
    x[::5] *= 8
    _check(x, w, t, 120, "mean", torch.tensor(0.6))
    _check(x, w, t, 120, "none", torch.rand(64))
