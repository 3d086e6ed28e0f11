"""fused_linear_cross_entropy: the launchers of triton_kernels.py, the custom ops that
torch.compile treats as opaque, and the public function.

Forward computes the loss and, when gradients are wanted, dx and dw in the same pass: the loss
is the last op of the model, so the backward only scales them by the upstream gradient (3 GEMMs,
not 4). reduction="none" cannot be precomputed that way (each row's upstream gradient is unknown
in forward), so its backward runs the pass again with those per-row weights. The chunk GEMMs go
through gpt2_fused/kernels/cublaslt.py (algorithms chosen by timing), except the logits GEMM of the
single-read path on Hopper, which is exp_gemm.py's Triton kernel with the row pass in its
epilogue. The options (bias, softcap, z_loss, label_smoothing, return_lse) live in the two-read
row kernel and in exp_gemm's kernels, label smoothing in the former only; calls with options
that the path at hand cannot take go to the two-read kernel (lce_pass).
"""

import contextlib
import functools
import os
from typing import Optional

import torch
import triton
from torch._guards import detect_fake_mode

from fused_loss import exp_gemm, triton_kernels
from fused_loss.checks import check_inputs
from fused_loss.reference import linear_cross_entropy_reference
from gpt2_fused.kernels import cublaslt
from gpt2_fused.kernels.launch import launch_overrides, num_sms

# The launch of the row kernels (triton_kernels.py), by device ("cpu": the Triton interpreter in
# tests, small blocks so that small ragged shapes span several); bench/RESULTS.md#fused-loss.
#   BV, BD        columns per step of the row kernels; D-block of row_scale_kernel
#   one_hot_rows  sorted rows a block of one_hot_pieces_kernel sums; one_hot_cols: its D-block
#                 (and one_hot_runs_kernel's); one_hot_steps: blocks one_hot_runs_kernel adds
#                 a step along a run that crosses blocks
#   per_sm        programs per SM, persistent over rows. On CUDA their registers are capped
#                 (ptxas .maxnreg, row_kernel_maxnreg) so that all fit on an SM at once, as the
#                 grid assumes; uncapped, ptxas's counts swing with small code changes
#   single_read   exp_rows_kernel (one read of the buffer, the row scales applied around the
#                 GEMMs) or softmax_grad_kernel (two reads): True, False or "auto"
#                 (use_single_read). The single read rounds f * x for the dw GEMM, one rounding
#                 more than torch's path on the softmax part of G (with a 16-bit dw the one-hot
#                 part is added in fp32, so dw's error stays below torch's; an fp32 dw, not
#                 rounded again, keeps it folded into E). "auto" takes it for an fp32 dw (the
#                 fp32 master weight under autocast), and for a bf16 dw unless the fp32
#                 accumulator leaves the chunks at MIN_ROWS (1558M's width): there the
#                 accumulator's read-modify-writes set the time, the single read was no faster
#                 and its (n, D) scratch passed the lean bound
#   exp_gemm      the single read's logits GEMM with the row pass in its epilogue (exp_gemm.py)
#                 where exp_gemm.applies(); False: the cuBLAS GEMM + exp_rows_kernel everywhere
#                 (what bench/bench_exp_gemm.py compares it with)
# Benchmarks try other values inside launch_settings(), which restores these.
# fmt: off
LAUNCH = {
    "cuda": dict(
        BV=4096, BD=256, num_warps=8, per_sm=4, one_hot_rows=8, one_hot_cols=64, one_hot_steps=32,
        single_read="auto", exp_gemm=True,
    ),
    "cpu": dict(
        BV=16, BD=16, num_warps=1, per_sm=1, one_hot_rows=4, one_hot_cols=16, one_hot_steps=2,
        single_read="auto", exp_gemm=True,
    ),
}
# fmt: on
# The chunk GEMMs (bf16/fp16; fp32 GEMMs stay torch's): each shape's algorithm is chosen on its
# first call by timing the cuBLASLt heuristic's first LT_CANDIDATES (LT_WORKSPACE bytes of
# workspace at most) and torch's own call (gpt2_fused/kernels/cublaslt.py)
LT_CANDIDATES = 16
LT_WORKSPACE = 0
REGS_PER_SM = 65536  # 32-bit registers per SM on sm_70 .. sm_90
REBASE = 60.0  # nats above the reference exp() may reach before exp_rows_kernel rebases a row
# Extra memory a call may hold: the (n, V) buffer plus, when the weight is not fp32, the fp32 dw
# accumulator (V, D). 320 MiB at the 124M shape: 147 MiB accumulator + 19 chunks of 1725 rows
# with bf16 weights. Fewer chunks mean fewer read-modify-writes of the fp32 dw (8 bytes per
# weight per chunk); below MIN_ROWS those dominate, so a huge vocabulary gets a bigger buffer
# instead. Where dw needs no accumulator (an fp32 weight, e.g. the trainer's master weight under
# autocast, or no gradient) a chunk on the GPU has at least MIN_CHUNK_ELEMENTS // D rows, more than
# the allowance gives below 1600 wide: a chunk has fixed costs (seven launches, a read-modify-write
# of the fp32 dw) that fewer, larger chunks pay less often. The size was chosen by timing at 768 to
# 1600 wide (bench/RESULTS.md#fused-loss); the trainer has the memory to spare.
EXTRA_BYTES = 320 * 2**20
MIN_ROWS = 1024
MIN_CHUNK_ELEMENTS = 5 * 2**20
CHUNK_MULTIPLE = 128


@contextlib.contextmanager
def launch_settings(*, extra_bytes=None, **cuda):
    """LAUNCH["cuda"] with `cuda`'s entries (an unknown key is a KeyError) and, unless None,
    EXTRA_BYTES = extra_bytes, for the block; both restored after. For benchmarks of other
    launches and memory budgets (bench/): the custom ops' schemas take no launch settings, so
    these stay module state, changed only here. Process-wide: not for concurrent use."""
    global EXTRA_BYTES
    saved = EXTRA_BYTES
    try:
        with launch_overrides(LAUNCH["cuda"], **cuda):
            EXTRA_BYTES = saved if extra_bytes is None else extra_bytes
            yield
    finally:
        EXTRA_BYTES = saved


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def chunk_rows(N, V, elt_size, acc_bytes=0, multiple=CHUNK_MULTIPLE, min_rows=None):
    """Rows per chunk: the buffer that fits in EXTRA_BYTES - acc_bytes (at least min_rows)."""
    min_rows = MIN_ROWS if min_rows is None else min_rows
    n = max((EXTRA_BYTES - acc_bytes) // (V * elt_size), min_rows) // multiple * multiple
    return max(multiple, min(n, triton.cdiv(N, multiple) * multiple))


def rows_per_chunk(N, V, D, elt_size, acc_bytes, cuda):
    """The rows of each of a call's equal chunks (no short, inefficient last one): chunk_rows's,
    on the GPU at least MIN_CHUNK_ELEMENTS // D when there is no accumulator (acc_bytes 0); on
    the CPU (the interpreter in tests) small chunks, so that small shapes span several."""
    if not cuda:
        least = dict(multiple=16, min_rows=16)
    elif acc_bytes:
        least = {}
    else:
        least = dict(min_rows=max(MIN_ROWS, MIN_CHUNK_ELEMENTS // D))
    n = min(chunk_rows(N, V, elt_size, acc_bytes, **least), N)
    return triton.cdiv(N, triton.cdiv(N, n))


def accumulator_parts(V, cast_bytes, buffer_bytes, max_parts=8, align=1):
    """Row ranges of the fp32 dw accumulator, allocated apart and cast to dw's dtype one by one.

    cast_bytes: dw in its own dtype (0 when dw is the fp32 accumulator itself: no cast).
    The cast after the last chunk needs the fp32 accumulator and the cast at once (V * D * 6
    bytes at bf16). When the cast is bigger than the (n, V) buffer of the chunk loop (1558M:
    153.5 MiB against 98), that moment is the call's peak. In k parts, each no bigger than the
    buffer once cast, cast and freed in turn and the casts then joined, it never exceeds the
    loop's peak (the fp32 parts + one cast part; then the casts + their join, V * D * 4 bytes).
    Part boundaries are multiples of `align` rows (CUDA: 64, so that every part's slice of the
    buffer starts 128-byte aligned for cuBLAS).
    """
    k = min(max_parts, V, -(-cast_bytes // buffer_bytes)) if cast_bytes > buffer_bytes else 1
    edges = sorted({0, V} | {min(V, -(-(V * i // k) // align) * align) for i in range(1, k)})
    return list(zip(edges[:-1], edges[1:], strict=True))


def gemm(out, a, b, accumulate=False, tune_accumulate=False):
    """out = a @ b, or += when accumulate; a, b in the compute dtype, out in it or fp32 (fp32
    accumulation either way). tune_accumulate: a first, overwriting call of a GEMM whose later
    calls accumulate, so that cuBLASLt times its candidates as accumulating calls.

    CUDA bf16/fp16: the fastest of cuBLASLt's candidates and torch's own call, timed on the first
    call of each shape (LT_CANDIDATES, LT_WORKSPACE); else torch (cuBLAS's first pick).
    """
    beta = 1 if accumulate else 0
    if a.device.type == "cuda" and a.dtype != torch.float32 and cublaslt.available():
        cublaslt.matmul(
            a,
            b,
            out,
            beta=beta,
            tune_beta=1 if tune_accumulate else None,
            candidates=LT_CANDIDATES,
            max_workspace=LT_WORKSPACE,
            reference=functools.partial(_torch_gemm, out),
        )
    else:
        _torch_gemm(out, beta, a, b)


def _torch_gemm(out, beta, a, b):
    """out = a @ b + beta * out through torch; on CPU (interpreter tests) through fp32 copies when
    out is fp32 and a, b are not."""
    if out.dtype == a.dtype:
        torch.addmm(out, a, b, beta=beta, out=out) if beta else torch.mm(a, b, out=out)
    elif a.device.type == "cuda":
        torch.addmm(out, a, b, out_dtype=torch.float32, beta=beta, out=out)
    else:
        torch.addmm(out, a.float(), b.float(), beta=beta, out=out)


def _accumulate_dw(accs, parts, g_t, xs, first):
    """accs[k] = (or +=) g_t[a:b] @ xs for each row range (a, b) of dw: fp32 accumulation.

    A function so that no loop variable outlives the chunk loop: one left referencing the last
    part would keep it alive through the casts (one more part's memory at the peak).
    """
    for (a, b), acc in zip(parts, accs, strict=True):
        gemm(acc, g_t[a:b], xs, accumulate=not first, tune_accumulate=first)


def _subtract_one_hot(accs, parts, db, y, h, x, cfg):
    """dw[y_n] -= h_n x_n over all rows (and db[y_n] -= h_n when db is not None), in fp32: the
    one-hot term of G = diag(f) E - diag(h) onehot(y), outside the dw GEMM so that it is not
    rounded (triton_kernels.py). The rows sorted by target (stable), runs of equal targets are
    summed in that order (one_hot_pieces_kernel, one_hot_runs_kernel): no atomics, the same
    sums every call, and real text's frequent targets are spread over many programs. Rows with
    h_n = 0 (the one-hot folded into E, ignored, dead) add nothing."""
    N, D = x.shape
    # int32 keys: half the radix passes of int64's (an out-of-range target that wraps has h = 0)
    ys, order = torch.sort(y.to(torch.int32), stable=True)
    R = cfg["one_hot_rows"]
    blocks = triton.cdiv(N, R)
    jobs = [(acc, a, b, x) for (a, b), acc in zip(parts, accs, strict=True)]
    if db is not None:  # db as a one-column dw of a column of ones
        jobs.append((db[:, None], 0, db.numel(), x.new_ones((N, 1))))
    for acc, a, b, rows in jobs:
        width = rows.shape[1]
        BD = max(16, min(cfg["one_hot_cols"], triton.next_power_of_2(width)))
        part = torch.empty((blocks, 2, width), device=x.device, dtype=torch.float32)
        grid = (blocks, triton.cdiv(width, BD))
        kw = dict(R=R, BD=BD)
        triton_kernels.one_hot_pieces_kernel[grid](
            acc, part, rows, ys, order, h, N, width, a, b, **kw
        )  # fmt: skip
        triton_kernels.one_hot_runs_kernel[grid](
            acc, part, ys, N, width, a, b, blocks, S=cfg["one_hot_steps"], **kw
        )  # fmt: skip


def row_kernel_maxnreg(num_warps, per_sm):
    """Registers per thread that let per_sm programs of num_warps warps share one SM."""
    return min(255, REGS_PER_SM // (32 * num_warps * per_sm)) // 8 * 8


def use_single_read(option, compute_dtype, dw_dtype, roomy=True):
    """The single-read kernel or not, for LAUNCH's single_read option (True, False, "auto");
    roomy: the allowance leaves the chunks above MIN_ROWS once dw's accumulator is held."""
    if option == "auto":
        option = dw_dtype == torch.float32 or roomy
    return option and compute_dtype != torch.float16  # E reaches e^60: not for fp16


def row_kernel_options(cfg, cuda):
    """The row kernels' compile options from a LAUNCH entry: num_warps and, on CUDA, the register
    cap (maxnreg) that keeps per_sm programs on an SM at once."""
    options = dict(num_warps=cfg["num_warps"])
    if cuda:
        options["maxnreg"] = row_kernel_maxnreg(cfg["num_warps"], cfg["per_sm"])
    return options


def lce_pass(
    x, w, y, g, *, ignore_index, vocab_size, want_grad, g_per_row,
    bias=None, softcap=None, z_loss=0.0, label_smoothing=0.0, want_lse=False, w_cast=None,
):  # fmt: skip
    """One chunked pass. x (N, D), w (V, D) (any float dtype), y (N,) int64, g: (1,) or (N,) fp32,
    or a function returning it (called once the first GEMM is queued); bias (V,) or None, and
    the other options of fused_linear_cross_entropy.

    Returns per-row losses (N,) fp32, lse (N,) fp32 (empty unless want_lse) and, if want_grad,
    dx (N, D) in x's dtype, dw (V, D) in w's dtype and db (V,) in bias's (empty without bias), the
    gradients of sum_n g_n loss_n. The GEMMs run in x's dtype: w is cast to it (a temporary copy
    when they differ, e.g. an fp32 master weight under autocast), or w_cast is that cast, kept
    by the optimizer (gpt2_fused/training/weight_casts.py).
    """
    dw_dtype = w.dtype
    x = x.contiguous()
    if w_cast is not None:
        w = w_cast.contiguous()
    else:
        w = w.contiguous() if w.dtype == x.dtype else w.to(x.dtype)
    N, D = x.shape
    V = w.shape[0]
    dev = x.device
    cuda = dev.type == "cuda"
    cfg = LAUNCH["cuda" if cuda else "cpu"]
    has_bias = bias is not None
    no_db = x.new_empty(0)
    if N == 0:  # no tokens: no loss terms, zero gradients
        loss, lse = x.new_zeros(0, dtype=torch.float32), x.new_zeros(0, dtype=torch.float32)
        if want_grad:
            db = torch.zeros_like(bias) if has_bias else no_db
            return loss, lse, x.new_zeros((0, D)), w.new_zeros((V, D), dtype=dw_dtype), db
        return loss, lse, x.new_empty(0), x.new_empty(0), no_db  # distinct: outputs never alias
    acc_bytes = V * D * 4 if want_grad and dw_dtype != torch.float32 else 0
    n = rows_per_chunk(N, V, D, x.element_size(), acc_bytes, cuda)
    programs = num_sms(dev.index) * cfg["per_sm"] if cuda else n
    roomy = EXTRA_BYTES - acc_bytes >= MIN_ROWS * V * x.element_size()
    single = use_single_read(cfg["single_read"], x.dtype, dw_dtype, roomy)
    # the options live in softmax_grad_kernel and in exp_gemm's kernels (label smoothing only
    # in the former: its constant term times the softcap's derivative is no row scale of E)
    exp_epilogue = single and cfg["exp_gemm"] and exp_gemm.applies(x, w) and not label_smoothing
    options = has_bias or softcap is not None or z_loss or label_smoothing or want_lse
    single = single and (exp_epilogue or not options)
    bias = bias.contiguous() if has_bias else None

    logits_kw = dict(vocab_size=vocab_size, ignore_index=ignore_index)
    gemm_kw = dict(bias=bias, softcap=softcap, all_rows=want_lse, **logits_kw)
    buf = torch.empty((n, V), device=dev, dtype=x.dtype)  # z, then G (or E) of one chunk
    # the first chunk's logits GEMM is queued before the rest is set up (and g formed, when it is
    # a function): the GPU starts on it while the host does the rest
    args = state = None
    if exp_epilogue:
        state = exp_gemm.scratch(n, V, dev)
        exp_gemm.start(x[:n], w, y[:n], buf, state, **gemm_kw)
    else:
        gemm(buf, x[:n], w.t())
    g = g() if callable(g) else g
    losses = torch.empty(N, device=dev, dtype=torch.float32)
    lse = torch.empty(N if want_lse else 0, device=dev, dtype=torch.float32)
    dx, dw, accs = x.new_empty(0), x.new_empty(0), []
    cast_bytes = V * D * dw_dtype.itemsize if acc_bytes else 0
    parts = accumulator_parts(V, cast_bytes, n * V * x.element_size(), align=64 if cuda else 1)
    if want_grad:
        dx = torch.empty_like(x)
        accs = [torch.empty((b - a, D), device=dev, dtype=torch.float32) for a, b in parts]
        db_acc = torch.empty(V, device=dev, dtype=torch.float32) if has_bias else None
    # a chunk's G = diag(f) E - diag(h) onehot(y), the one-hot out of E only where dw is rounded
    # to 16 bits at the end, else folded into E on every row (triton_kernels.py says why)
    hot = single and want_grad and dw_dtype != torch.float32
    h_all = torch.empty(N, device=dev, dtype=torch.float32) if hot else None  # every row's h
    if single:
        f = torch.empty(n, device=dev, dtype=torch.float32)  # row scales of a chunk
        if want_grad:
            p = torch.empty((n, D), device=dev, dtype=torch.float32)  # E @ w of a chunk
            xs_scaled = torch.empty((n, D), device=dev, dtype=x.dtype)  # f * x of a chunk
    # the padded logit columns get -inf after the logits GEMM, and the row kernels read every
    # column up to V (mask_cols = V): loads masked at a multiple of 16 vectorise
    fill = vocab_size < V
    row_options = row_kernel_options(cfg, cuda)
    launch = dict(
        G_PER_ROW=g_per_row, WRITE_G=want_grad, BV=cfg["BV"], INTERPRETED=not cuda, **row_options
    )
    scale = dict(BD=cfg["BD"], INTERPRETED=not cuda)
    features = dict(
        b_ptr=losses if bias is None else bias, softcap=softcap or 0.0, z_loss=z_loss,
        smoothing=label_smoothing, HAS_BIAS=has_bias, SOFTCAP=softcap is not None,
        Z_LOSS=z_loss != 0, SMOOTH=label_smoothing != 0, WRITE_LSE=want_lse,
    )  # fmt: skip
    sums = dict(BR=32, BC=128) if cuda else dict(BR=16, BC=16)  # column_sums_kernel

    for i, c0 in enumerate(range(0, N, n)):
        rows = min(n, N - c0)
        xs, z, dxs = x[c0 : c0 + rows], buf[:rows], dx[c0 : c0 + rows]
        ys, gs = y[c0 : c0 + rows], g[c0 : c0 + rows] if g_per_row else g
        lses = lse[c0 : c0 + rows] if want_lse else None
        # the single read's h: the one-hot's row weights where it stays out of E (hot); else f
        # stands in as the kernels' h pointer, which they then never read (HOT False)
        h = h_all[c0 : c0 + rows] if hot else None
        hs = (f if h is None else h) if single else None
        if exp_epilogue:  # E from the GEMM's epilogue; f = g / S, h
            if i:
                exp_gemm.start(xs, w, ys, z, state, **gemm_kw)
            exp_gemm.finish(
                z, ys, gs, state, losses[c0 : c0 + rows], f, h, g_per_row=g_per_row,
                want_grad=want_grad, softcap=softcap, z_loss=z_loss, lse=lses, **logits_kw,
            )  # fmt: skip
        else:
            if i:  # the first one was queued above
                gemm(z, xs, w.t())
            if fill:
                z[:, vocab_size:].fill_(float("-inf"))
            args = (z, ys, gs, losses[c0 : c0 + rows]) + ((f, hs) if single else ())
            args += (rows, V, vocab_size, V, z.stride(0), ignore_index)
            grid = (min(rows, programs),)
            if single:  # z -> E in place, f = g / S, h
                triton_kernels.exp_rows_kernel[grid](*args, REBASE=REBASE, HOT=hot, **launch)
            else:  # z -> G in place
                lse_out = losses if lses is None else lses
                triton_kernels.softmax_grad_kernel[grid](
                    *args, **launch, **(features | dict(lse_ptr=lse_out))
                )
        if not want_grad:
            continue
        if has_bias:  # db (+)= G.T @ 1
            triton_kernels.column_sums_kernel[(triton.cdiv(V, sums["BC"]),)](
                z, f if single else z, db_acc, rows, V, z.stride(0),
                HAS_F=single, ACCUMULATE=i > 0, **sums,
            )  # fmt: skip
        if single:  # dx = f * (E @ w) - h * w[y], dw += E.T @ (f * x) - onehot(y).T @ (h * x)
            gemm(p[:rows], z, w)
            triton_kernels.row_scale_kernel[(rows,)](p, f, dxs, w, ys, hs, D, HOT=hot, **scale)
            triton_kernels.row_scale_kernel[(rows,)](
                xs, f, xs_scaled, xs, ys, hs, D, HOT=False, **scale
            )  # fmt: skip
            _accumulate_dw(accs, parts, z.t(), xs_scaled[:rows], first=i == 0)
        else:  # dx = G @ w, dw += G.T @ x
            gemm(dxs, z, w)
            _accumulate_dw(accs, parts, z.t(), xs, first=i == 0)
    del buf, z, args, state  # free the buffer before the cast allocates dw in its dtype
    db = no_db
    if hot:
        _subtract_one_hot(accs, parts, db_acc, y, h_all, x, cfg)
    if want_grad:
        casts = []
        while accs:  # cast each part, then free its fp32 accumulator
            casts.append(accs.pop(0).to(dw_dtype))
        dw = casts[0] if len(casts) == 1 else torch.cat(casts)
        if has_bias:
            db = db_acc.to(bias.dtype)
    return losses, lse, dx, dw, db


@torch.library.custom_op("fused_loss::lce_forward", mutates_args=())
def _lce_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045 (custom_op parses the annotation)
    ignore_index: int,
    vocab_size: int,
    reduction: str,
    want_grad: bool,
    softcap: float,
    z_loss: float,
    label_smoothing: float,
    want_lse: bool,
    w_cast: Optional[torch.Tensor],  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, dx, dw, db); softcap 0 is off; the gradients are those of the loss when
    want_grad and the reduction is "mean" or "sum", else empty; w_cast: None or w in x's dtype,
    used in place of a cast of w."""

    @functools.cache  # formed once, after lce_pass has queued its first GEMM
    def weight():  # "mean": 1 / (number of non-ignored targets), on device: no sync
        if reduction == "mean":
            return (y != ignore_index).sum(dtype=torch.float32).clamp_(min=1).reciprocal_()[None]
        return torch.ones(1, device=x.device, dtype=torch.float32)

    grads = want_grad and reduction != "none"
    losses, lse, dx, dw, db = lce_pass(
        x, w, y, weight, ignore_index=ignore_index, vocab_size=vocab_size, want_grad=grads,
        g_per_row=False, bias=bias, softcap=softcap or None, z_loss=z_loss,
        label_smoothing=label_smoothing, want_lse=want_lse, w_cast=w_cast,
    )  # fmt: skip
    loss = losses if reduction == "none" else losses.sum() * weight()[0]
    return loss, lse, dx, dw, db


@_lce_forward.register_fake
def _(x, w, y, bias, ignore_index, vocab_size, reduction, want_grad, softcap, z_loss,
      label_smoothing, want_lse, w_cast):  # fmt: skip
    N, D = x.shape
    loss = x.new_empty((N,) if reduction == "none" else (), dtype=torch.float32)
    lse = x.new_empty(N if want_lse else 0, dtype=torch.float32)
    if want_grad and reduction != "none":
        db = x.new_empty(0) if bias is None else bias.new_empty(bias.shape)
        return loss, lse, x.new_empty((N, D)), w.new_empty(w.shape), db
    return loss, lse, x.new_empty(0), x.new_empty(0), x.new_empty(0)


@torch.library.custom_op("fused_loss::lce_backward_rows", mutates_args=())
def _lce_backward_rows(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    grad_rows: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    softcap: float,
    z_loss: float,
    label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = grad_rows.to(torch.float32).contiguous()
    _, _, dx, dw, db = lce_pass(
        x, w, y, g, ignore_index=ignore_index, vocab_size=vocab_size, want_grad=True,
        g_per_row=True, bias=bias, softcap=softcap or None, z_loss=z_loss,
        label_smoothing=label_smoothing,
    )  # fmt: skip
    return dx, dw, db


@_lce_backward_rows.register_fake
def _(x, w, y, bias, grad_rows, ignore_index, vocab_size, softcap, z_loss, label_smoothing):
    db = x.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return x.new_empty(x.shape), w.new_empty(w.shape), db


@torch.library.custom_op("fused_loss::scale_grads_", mutates_args=("dx", "dw", "db"))
def _scale_grads_(dx: torch.Tensor, dw: torch.Tensor, db: torch.Tensor, g: torch.Tensor) -> None:
    """dx *= g, dw *= g, db *= g in place for a scalar g, each product formed in fp32 and rounded
    once (db may be empty).

    In place, so the backward holds one copy of the gradients, not two. The op bumps their
    version counters: a second backward through the same graph (retain_graph) gets autograd's
    "modified by an inplace operation" error instead of gradients scaled twice.
    """
    g = g.to(torch.float32).reshape(1)
    for t in (dx, dw, db):
        if t.numel() == 0:
            continue
        block = 4096
        triton_kernels.scale_kernel[(triton.cdiv(t.numel(), block),)](
            t, g, t, t.numel(), BLOCK=block, INTERPRETED=t.device.type != "cuda"
        )


@_scale_grads_.register_fake
def _(dx, dw, db, g):
    return None


def _setup_context(ctx, inputs, output):
    x, w, y, bias, ignore_index, vocab_size, reduction, want_grad = inputs[:8]
    ctx.options = inputs[8:11]  # softcap, z_loss, label_smoothing
    _, lse, dx, dw, db = output
    ctx.reduction, ctx.ignore_index, ctx.vocab_size = reduction, ignore_index, vocab_size
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(lse)  # returned for logging; no gradient flows back through it
    # dx, dw and db are outputs only so that backward can take them; nothing downstream uses
    # them, and materialised zero gradients for them would be buffers the size of x and w
    ctx.set_materialize_grads(False)
    if reduction == "none":
        ctx.save_for_backward(x, w, y, bias)
    else:
        ctx.save_for_backward(dx, dw, db)


def _backward(ctx, grad_loss, _grad_lse, _grad_dx, _grad_dw, _grad_db):
    nothing = (None,) * 13
    if grad_loss is None:  # gradients are not materialised: none reached the loss
        return nothing
    if ctx.reduction == "none":
        x, w, y, bias = ctx.saved_tensors
        dx, dw, db = _lce_backward_rows(
            x, w, y, bias, grad_loss.reshape(-1), ctx.ignore_index, ctx.vocab_size, *ctx.options
        )
    else:
        dx, dw, db = ctx.saved_tensors
        if dw.numel() == 0:  # (V, D) with V, D > 0 whenever gradients were formed
            raise RuntimeError(
                "fused_linear_cross_entropy: forward ran without gradients; "
                "call it with grad enabled and inputs that require grad"
            )
        if detect_fake_mode((dx, dw)) is not None:  # traced by torch.compile
            dx, dw, db = (_times(t, grad_loss) for t in (dx, dw, db))
        else:
            _scale_grads_(dx, dw, db, grad_loss)  # the saved tensors become the gradients
    return (dx, dw, None, db if ctx.has_bias else None) + nothing[4:]


def _times(t, g):
    """t * g for a scalar g as the compiled backward's plain product (fp32, rounded once to t's
    dtype; an empty t as it is). Inductor fuses it into the kernels that read the gradient next
    (the tied weight's two gradients summed, the last LayerNorm's backward); an in-place scale
    of a saved tensor would make it copy the tensor first (the 50,304 x 768 fp32 dw: 154 MB
    read and written twice a micro-batch at 124M)."""
    return t if t.numel() == 0 else (t.float() * g.float()).to(t.dtype)


torch.library.register_autograd("fused_loss::lce_forward", _backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    x,
    weight,
    targets,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    vocab_size=None,
    softcap=None,
    z_loss=0.0,
    label_smoothing=0.0,
    return_lse=False,
    weight_cast=None,
):
    """Cross-entropy of softmax(u) at `targets`, u = x @ weight[:vocab_size].T + bias, capped,
    without the (tokens, V) logits: the options and the math are linear_cross_entropy_reference's.

    x: (..., D); weight: (V, D), may be an fp32 master weight while x is bf16; targets: (...) int;
    bias: (V,) or None. Columns >= vocab_size are padding: out of the softmax, zero gradient,
    never sampled. reduction: "mean" over non-ignored targets (0 if none), "sum", or "none"
    (shape of targets). softcap: u = softcap * tanh(u / softcap) (None: off). z_loss: adds
    z_loss * lse^2 per counted token. label_smoothing: as F.cross_entropy's, over the vocab_size
    real columns. return_lse: also return lse (shape of targets, fp32, no gradient).
    weight_cast: None, or weight already cast to the GEMMs' dtype (the optimizer keeps it,
    gpt2_fused/training/weight_casts.py), read in place of a fresh cast; the gradient still goes to
    weight. Under autocast the matmuls run in the autocast dtype, as F.linear would. Gradients
    come back in each input's own dtype. CUDA tensors run the Triton kernels; CPU tensors run
    them under the Triton interpreter when TRITON_INTERPRET=1, else the torch reference (as does
    float64).
    """
    vocab_size = check_inputs(
        x, weight, targets, ignore_index, reduction, vocab_size, bias, softcap, z_loss,
        label_smoothing,
    )  # fmt: skip
    kw = dict(
        bias=bias, ignore_index=ignore_index, reduction=reduction, vocab_size=vocab_size,
        softcap=softcap, z_loss=z_loss, label_smoothing=label_smoothing, return_lse=return_lse,
    )  # fmt: skip
    dtypes = (x.dtype, weight.dtype) + (() if bias is None else (bias.dtype,))
    if (x.device.type != "cuda" and not interpreting()) or torch.float64 in dtypes:
        return linear_cross_entropy_reference(x, weight, targets, **kw)
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if weight_cast is not None and (
        not isinstance(weight_cast, torch.Tensor)
        or weight_cast.shape != weight.shape
        or weight_cast.dtype != x.dtype
        or weight_cast.device != weight.device
    ):
        got = (
            f"{tuple(weight_cast.shape)} {weight_cast.dtype} on {weight_cast.device}"
            if isinstance(weight_cast, torch.Tensor)
            else type(weight_cast).__name__
        )
        raise ValueError(
            f"weight_cast must be weight's shape {tuple(weight.shape)} in the GEMMs' dtype "
            f"{x.dtype} on {weight.device}, got {got}"
        )
    inputs = (x, weight) + (() if bias is None else (bias,))
    want_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    loss, lse, _, _, _ = _lce_forward(
        x.reshape(-1, x.shape[-1]),
        weight,
        targets.reshape(-1).to(torch.int64),
        bias,
        ignore_index,
        vocab_size,
        reduction,
        want_grad,
        float(softcap or 0.0),
        float(z_loss),
        float(label_smoothing),
        bool(return_lse),
        weight_cast,
    )
    loss = loss.view(targets.shape) if reduction == "none" else loss
    return (loss, lse.view(targets.shape)) if return_lse else loss
