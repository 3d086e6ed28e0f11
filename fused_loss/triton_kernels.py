"""Triton kernels of the fused linear + cross-entropy. The GEMMs around them are cuBLAS calls
(on Hopper the single-read path's logits GEMM is exp_gemm.py's, which does exp_rows_kernel's
work in its epilogue).

Dims: N tokens, D hidden, V weight rows (padded vocab), Vr = vocab_size <= V real columns.
Math, for x (N, D), w (V, D), targets y (N,) and per-row gradient weights g (N,):
    z = x @ w.T                  logits; columns v >= Vr are out of the softmax
    lse_n = log sum_{v<Vr} exp(z_nv)         loss_n = lse_n - z_{n, y_n}
    G = diag(g) (softmax(z) - onehot(y))     (N, V), the gradient of sum_n g_n loss_n wrt z
    dx = G @ w   (N, D)          dw = G.T @ x   (V, D)
g_n is 1/count (mean), 1 (sum) or the upstream gradient ("none"); 0 for ignored targets.
The options (fused_linear_cross_entropy's bias, softcap s, z_loss l, label_smoothing e) change
the softmax's input and the loss, softmax_grad_kernel takes them all (_logits, _feature_grad):
    u = s tanh((z + b) / s)               (u = z + b without softcap)
    loss_n = (1 - e)(lse_n - u_{n,y_n}) + e (lse_n - mean_{v<Vr} u_nv) + l lse_n^2,  lse from u
    dloss/du = (1 + 2 l lse) softmax(u) - (1 - e) onehot(y) - e / Vr,   du/dz = 1 - (u / s)^2
    db = sum_n G_n (the column sums of the chunk's G: column_sums_kernel)

The launcher (linear_cross_entropy.py) runs the rows in chunks of n tokens through one (n, V)
buffer, so the (N, V) logits never exist: cuBLAS writes the chunk's z into the buffer (compute
dtype, fp32 accumulation), softmax_grad_kernel turns it into G in place and writes the losses,
then cuBLAS forms dx of the chunk and adds G.T @ x into an fp32 dw. Each logit is computed once
(3 GEMMs: z, dx, dw); the elementwise work is two reads and one write of the buffer (one of each
in the single-read kernel).

softmax_grad_kernel, one program per row at a time (persistent over rows):
  pass 1   per-lane running max m and sum s over the real columns with one exp per element
           (s = s * exp(m - z) + 1 when z is a new max, else s + exp(z - m)); lse from the lanes.
  loss     lse - z_y with z_y the stored (rounded) logit, as torch's bf16 path computes it: when
           p_y ~ 1 the two terms share the rounding of z_y, which cancels (an fp32 target logit
           next to an lse from rounded logits is ~|z_y| 2^-9 off per token once predictions are
           confident).
  pass 2   G = g_n (exp(z - lse) - onehot) over all V columns (0 past Vr), rounded once to the
           buffer's dtype, overwriting z. The row was just read, but with hundreds of ~100 KB
           rows in flight a re-read in the same order as pass 1 would start on the blocks least
           likely to be left in L2. So pass 1 runs backward (from the row's last block to its
           first) and pass 2 forward, from the blocks just read.

Padded columns (vocab_size < V) are out of the softmax: the launcher writes -inf into the
chunk's padded logit columns after the logits GEMM and passes mask_cols = V, the column from
which the kernels read logits as -inf, so that every load is masked at V, a multiple of 16 whose
loads vectorise (loads masked at an odd vocab_size, 50257, do not).
A target outside [0, vocab_size) that is not ignore_index gets a NaN loss (_target): it is never
used as an index.

Single-read kernel (the launcher's use_single_read says when it runs). The second read above is
there because exp() needs the row's lse before G can be written. Writing instead
E_nv = exp(z_nv - c_n), c_n = max of the row's first block (<= the row max), gives
    G = diag(f) E - diag(h) onehot(y),   f_n = g_n / S_n,  S_n = sum_v E_nv,  h_n = g_n
with ONE scale per row, so the row is read and written once (exp_rows_kernel), and the scales
move outside the GEMMs: dx = diag(f) (E @ w) - diag(h) w[y] (row_scale_kernel, from an fp32 GEMM
output), dw += E.T @ (f * x) with f * x rounded once to the compute dtype, and dw[y_n] -= h_n x_n
in fp32 (the launcher). The one-hot term is what dominates G's norm unless p_y is large (1 against
|p| ~ V^-1/2 for a flat softmax); out of the GEMMs it carries no rounding, where folded into E it
would carry two (E_y - S and f * x). When p_y >= 1/2 the one-hot is folded in instead, h_n = 0:
    E_{n,y_n} = E_y - S_n             (from the fp32 exp of z_y, so that p_y ~ 1 does not cancel)
since there G_y = g (p_y - 1) is small and f E_y ~ g would lose it. The rounding of f * x stays
one more than torch's path has, on the softmax part of G only. Out of E, the one-hot costs a sort
of the targets and two launches a call (one_hot_pieces_kernel, one_hot_runs_kernel: 2-3 % of
the call, bench/RESULTS.md#fused-loss), so the launcher takes it (HOT) only where dw is
rounded to 16 bits at the end, where the two folded roundings pass torch's error; an fp32 dw (the
master weight) keeps the fold on every row, h unused, its error then torch's.
A block whose max passes c + REBASE (60 nats; e^60 * V still fits fp32) raises c to that max and
rescales the row's already written E (rare: only rows whose first block is far below their max).

Under the CPU interpreter (INTERPRETED) the stores' fp32 -> bf16 casts go through
gpt2_fused.kernels.interpreter.to_dtype, which rounds as the GPU does.
"""

import triton
import triton.language as tl

from gpt2_fused.kernels.interpreter import to_dtype

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: compiled kernels may read no other global


@triton.jit
def _load_logits(z_row, cols, V, mask_cols):
    """z at `cols` in fp32, -inf from mask_cols on. The load is masked at V, not mask_cols: the
    padded V (50304) is a multiple of 16, so the load vectorises, which 50257 would prevent."""
    z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    return tl.where(cols < mask_cols, z, float("-inf"))


@triton.jit
def _target(y_ptr, r, vocab_size, ignore_index):
    """Row r's target y; valid: it counts (not ignore_index); ok: also within [0, vocab_size).
    Targets are not range-checked on the GPU (that would sync the host), so a valid target that
    is not ok gets a NaN loss and no one-hot, and no memory outside its row is read or written."""
    y = tl.load(y_ptr + r)
    valid = y != ignore_index
    return y, valid, valid & (y >= 0) & (y < vocab_size)


@triton.jit
def _row_loss(valid, ok, lse, z_y):
    """lse - z_y for a counted row, 0 for an ignored one, NaN for an out-of-range target."""
    return tl.where(valid, tl.where(ok, lse - z_y, float("nan")), 0.0)


@triton.jit
def _row_weight(g_ptr, r, valid, G_PER_ROW: tl.constexpr):
    """g_r: the one weight, or row r's, or 0 for an ignored row."""
    if G_PER_ROW:
        g = tl.load(g_ptr + r)
    else:
        g = tl.load(g_ptr)
    return tl.where(valid, g, 0.0)


@triton.jit
def _tanh(a):
    """tanh from one exp2 of -2|a| (no overflow at any |a|; absolute error ~1e-7)."""
    q = tl.exp2(tl.abs(a) * (-2.0 * LOG2E))
    t = (1.0 - q) / (1.0 + q)
    return tl.where(a < 0, -t, t)


@triton.jit
def _logits(z, cols, V, b_ptr, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """The logits u the softmax sees, from the GEMM's z (fp32) at `cols`: z + b, capped to
    softcap * tanh(. / softcap). -inf (a masked column) stays -inf."""
    if HAS_BIAS:
        z = z + tl.load(b_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
    if SOFTCAP:
        z = tl.where(z == float("-inf"), z, softcap * _tanh(z / softcap))
    return z


@triton.jit
def _feature_grad(
    p, u, hot, g, lse, vocab_size, softcap, z_loss, smoothing,
    SOFTCAP: tl.constexpr, Z_LOSS: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
    """d(g loss)/dz with the options: for the real columns (u > -inf, p = exp(u - lse))
        d/du = (1 + 2 z_loss lse) p - (1 - e) onehot - e / vocab_size,
    times the softcap's du/dz = 1 - (u / softcap)^2; 0 elsewhere."""
    real = u != float("-inf")
    d = p * (1.0 + 2.0 * z_loss * lse) if Z_LOSS else p
    if SMOOTH:
        d = d - tl.where(hot, 1.0 - smoothing, 0.0) - tl.where(real, smoothing / vocab_size, 0.0)
    else:
        d = d - tl.where(hot, 1.0, 0.0)
    if SOFTCAP:
        c = u / softcap
        d = tl.where(real, d * (1.0 - c * c), 0.0)
    return g * d


@triton.jit
def softmax_grad_kernel(
    z_ptr,  # (n, V) logits of the chunk, compute dtype; overwritten by G when WRITE_G
    y_ptr,  # (n,) int64 targets
    g_ptr,  # (1,) or (n,) fp32 gradient weight(s)
    loss_ptr,  # (n,) fp32 out: per-row loss, 0 for ignored rows
    n_rows,
    V,
    vocab_size,  # targets must lie in [0, vocab_size)
    mask_cols,  # columns from here on are read as -inf (V: the launcher wrote -inf into them)
    stride_z,
    ignore_index,
    b_ptr,  # (V,) bias, when HAS_BIAS
    lse_ptr,  # (n,) fp32 out: lse per row, when WRITE_LSE
    softcap,  # when SOFTCAP
    z_loss,  # when Z_LOSS
    smoothing,  # label smoothing, when SMOOTH
    G_PER_ROW: tl.constexpr,
    WRITE_G: tl.constexpr,
    BV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    Z_LOSS: tl.constexpr,
    SMOOTH: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    lanes = tl.arange(0, BV)
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        r64 = tl.cast(r, tl.int64)  # row offsets of a big chunk can pass 2**31 elements
        z_row = z_ptr + r64 * stride_z
        y, valid, ok = _target(y_ptr, r, vocab_size, ignore_index)

        # pass 1: per-lane running (max, sum), one exp per element, no reductions in the loop
        m = tl.full((BV,), float("-inf"), tl.float32)
        s = tl.zeros((BV,), tl.float32)
        su = tl.zeros((BV,), tl.float32)  # sum of the real logits, for label smoothing
        n_real = tl.cdiv(mask_cols, BV)
        for i in range(0, n_real):
            cols = (n_real - 1 - i) * BV + lanes  # backward: pass 2 starts on the last read
            z = _load_logits(z_row, cols, V, mask_cols)
            z = _logits(z, cols, V, b_ptr, softcap, HAS_BIAS, SOFTCAP)
            if SMOOTH:
                su += tl.where(z == float("-inf"), 0.0, z)
            new_max = z > m
            e = tl.exp2(-tl.abs(z - m) * LOG2E)  # exp(m - z) on a new max, else exp(z - m)
            e = tl.where(z == float("-inf"), 0.0, e)  # masked lane (m may be -inf too: no nan)
            s = tl.where(new_max, s * e + 1.0, s + e)
            m = tl.maximum(m, z)
        m_row = tl.max(m, axis=0)
        s_row = tl.sum(s * tl.exp2((m - m_row) * LOG2E), axis=0)
        lse = m_row + tl.log(s_row)

        # the target's logit as stored (rounded like the rest): lse - z_y then cancels the
        # rounding that dominates both terms when p_y ~ 1, as torch's bf16 path does
        y0 = tl.where(ok, y, 0)
        z_y = _logits(tl.load(z_row + y0).to(tl.float32), y0, V, b_ptr, softcap, HAS_BIAS, SOFTCAP)
        ce = lse - z_y
        if SMOOTH:  # (1 - e)(lse - z_y) + e (lse - mean z)
            ce += smoothing * (z_y - tl.sum(su, axis=0) / vocab_size)
        if Z_LOSS:
            ce += z_loss * lse * lse
        tl.store(loss_ptr + r, _row_loss(valid, ok, ce, 0.0))
        if WRITE_LSE:
            tl.store(lse_ptr + r, lse)

        if WRITE_G:
            g = _row_weight(g_ptr, r, valid, G_PER_ROW)
            lse2 = lse * LOG2E
            y_hot = tl.where(ok, y, -1)  # no one-hot for an out-of-range target
            n_blocks = tl.cdiv(V, BV)
            for i in range(0, n_blocks):
                cols = i * BV + lanes
                z = _load_logits(z_row, cols, V, mask_cols)
                z = _logits(z, cols, V, b_ptr, softcap, HAS_BIAS, SOFTCAP)
                p = tl.exp2(z * LOG2E - lse2)  # 0 past vocab_size
                if Z_LOSS or SMOOTH or SOFTCAP:
                    grad = _feature_grad(
                        p, z, cols == y_hot, g, lse, vocab_size, softcap, z_loss, smoothing,
                        SOFTCAP, Z_LOSS, SMOOTH,
                    )  # fmt: skip
                else:
                    grad = g * (p - tl.where(cols == y_hot, 1.0, 0.0))
                tl.store(
                    z_row + cols, to_dtype(grad, z_ptr.dtype.element_ty, INTERPRETED), mask=cols < V
                )


@triton.jit
def exp_rows_kernel(
    z_ptr,  # (n, V) logits of the chunk; overwritten by E (the one-hot folded in: HOT)
    y_ptr,  # (n,) int64
    g_ptr,  # (1,) or (n,) fp32
    loss_ptr,  # (n,) fp32 out
    f_ptr,  # (n,) fp32 out: the row scale g / S (0 for ignored rows)
    h_ptr,  # (n,) fp32 out when HOT: the one-hot's weight when not folded in (else 0)
    n_rows,
    V,
    vocab_size,
    mask_cols,
    stride_z,
    ignore_index,
    G_PER_ROW: tl.constexpr,
    WRITE_G: tl.constexpr,
    HOT: tl.constexpr,  # the one-hot out of E where p_y < 1/2; else folded in on every row
    REBASE: tl.constexpr,
    BV: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    lanes = tl.arange(0, BV)
    out_ty = z_ptr.dtype.element_ty
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        r64 = tl.cast(r, tl.int64)
        z_row = z_ptr + r64 * stride_z
        y, valid, ok = _target(y_ptr, r, vocab_size, ignore_index)
        c = tl.max(_load_logits(z_row, lanes, V, mask_cols), axis=0)  # reference, <= row max
        z_y = tl.load(z_row + tl.where(ok, y, 0)).to(tl.float32)  # before E overwrites it
        s = tl.zeros((BV,), tl.float32)
        end = V if WRITE_G else mask_cols
        for v0 in range(0, end, BV):
            cols = v0 + lanes
            z = _load_logits(z_row, cols, V, mask_cols)
            z_max = tl.max(z, axis=0)
            if z_max > c + REBASE:  # rare: rebase on the new max, rescale what is behind
                scale = tl.exp2((c - z_max) * LOG2E)
                s = s * scale
                c = z_max
                if WRITE_G:
                    for u0 in range(0, v0, BV):
                        old = tl.load(z_row + u0 + lanes).to(tl.float32)
                        tl.store(z_row + u0 + lanes, to_dtype(old * scale, out_ty, INTERPRETED))
            e = tl.exp2((z - c) * LOG2E)  # 0 past vocab_size
            s += e
            if WRITE_G:
                tl.store(z_row + cols, to_dtype(e, out_ty, INTERPRETED), mask=cols < V)
        S = tl.sum(s, axis=0)
        lse = c + tl.log(S)
        tl.store(loss_ptr + r, _row_loss(valid, ok, lse, z_y))
        if WRITE_G:
            g = _row_weight(g_ptr, r, valid, G_PER_ROW)
            tl.store(f_ptr + r, g / S)
            e_y = tl.exp2((z_y - c) * LOG2E)  # not the stored, rounded E_y: when p_y ~ 1,
            fold = ok  # E_y - S cancels; G_y = f (E_y - S) = g (p_y - 1)
            if HOT:
                fold = ok & (2.0 * e_y >= S)
                tl.store(h_ptr + r, tl.where(fold | ~ok, 0.0, g))
            if fold:
                tl.store(z_row + y, to_dtype(e_y - S, out_ty, INTERPRETED))


@triton.jit
def row_scale_kernel(
    src_ptr,  # (n, D) fp32 or compute dtype: E @ w (fp32) or x of the chunk
    f_ptr,  # (n,) fp32 row scales
    out_ptr,  # (n, D) out: f * src (- h * w[y] when HOT) in fp32, rounded once to out's dtype
    w_ptr,  # (V, D) contiguous, when HOT
    y_ptr,  # (n,) int64 targets, when HOT (row 0 of w is read where h = 0)
    h_ptr,  # (n,) fp32 one-hot weights, when HOT
    D,
    HOT: tl.constexpr,
    BD: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    r = tl.cast(tl.program_id(0), tl.int64)
    ks = tl.arange(0, BD)
    f = tl.load(f_ptr + r)
    if HOT:
        h = tl.load(h_ptr + r)
        w_row = w_ptr + tl.where(h != 0.0, tl.load(y_ptr + r), 0) * D
    for k in range(0, D, BD):
        ok = (k + ks) < D
        v = f * tl.load(src_ptr + r * D + k + ks, mask=ok, other=0.0).to(tl.float32)
        if HOT:
            v -= h * tl.load(w_row + k + ks, mask=ok, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + r * D + k + ks, to_dtype(v, out_ptr.dtype.element_ty, INTERPRETED), mask=ok
        )


@triton.jit
def _run_sum(a, a_starts, b, b_starts):
    """associative_scan's combine for sums within runs: a run's first element resets the sum."""
    return tl.where(b_starts, b, a + b), a_starts | b_starts


@triton.jit
def one_hot_pieces_kernel(
    acc_ptr,  # (b - a, D) fp32: rows [a, b) of dw, less sum_{n: y_n = v} h_n x_n at row v - a
    part_ptr,  # (blocks, 2, D) fp32 out: a block's sums of the runs that cross its ends
    x_ptr,  # (N, D)
    ys_ptr,  # (N,) int32 targets, sorted
    order_ptr,  # (N,) int64: the row of each sorted target
    h_ptr,  # (N,) fp32 one-hot weights of the rows
    N,
    D,
    a,
    b,
    R: tl.constexpr,  # sorted positions a block (a power of 2)
    BD: tl.constexpr,
):
    """The one-hot term of dw (G = diag(f) E - diag(h) onehot(y)), in two launches. Here a block
    of R sorted positions gathers their rows h_n x_n and sums each run of equal targets with a
    segmented scan (a fixed tree order); a run inside the block is subtracted from its dw row at
    once, the pieces of a run that crosses the block's first or last position go to
    part[block, 0] (it began before) or [block, 1] (it goes on), for one_hot_runs_kernel to add
    up. No atomics, a fixed order: the same sums every call, and a frequent target (a run of
    thousands) is summed by many blocks, not one program."""
    blk = tl.program_id(0)
    ks = tl.program_id(1) * BD + tl.arange(0, BD)
    kmask = ks < D
    i0 = blk * R
    i = i0 + tl.arange(0, R)
    live = i < N
    v = tl.load(ys_ptr + i, mask=live, other=0)
    prev = tl.load(ys_ptr + i - 1, mask=live & (i > 0), other=0)
    nxt = tl.load(ys_ptr + i + 1, mask=i + 1 < N, other=0)
    before = tl.load(ys_ptr + i0 - 1, mask=i0 > 0, other=0)
    starts = (i == i0) | (v != prev)  # the scan restarts at each run, and at the block's start
    ends = (i + 1 >= N) | (nxt != v)
    last = i == tl.minimum(i0 + R, N) - 1
    rows = tl.load(order_ptr + i, mask=live, other=0)
    hx = tl.load(x_ptr + rows[:, None] * D + ks[None, :], mask=live[:, None] & kmask[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    hx = hx * tl.load(h_ptr + rows, mask=live, other=0.0)[:, None]
    sums, _ = tl.associative_scan((hx, tl.broadcast_to(starts[:, None], (R, BD))), 0, _run_sum)
    emit = live & (ends | last)  # each run's last position in the block holds its sum
    began_before = (i >= R) & (v == before)  # not in block 0; sorted: only its first run
    goes_on = last & ~ends
    cols = kmask[None, :]
    to_part = part_ptr + (blk * 2) * D + ks[None, :] + tl.zeros((R, 1), tl.int32)
    tl.store(to_part, sums, mask=(emit & began_before)[:, None] & cols)
    tl.store(to_part + D, sums, mask=(emit & goes_on & ~began_before)[:, None] & cols)
    own = emit & ~goes_on & ~began_before & (v >= a) & (v < b)
    dst = acc_ptr + (v - a)[:, None] * D + ks[None, :]
    mask = own[:, None] & cols
    tl.store(dst, tl.load(dst, mask=mask, other=0.0) - sums, mask=mask)


@triton.jit
def one_hot_runs_kernel(
    acc_ptr,  # (b - a, D) fp32, as in one_hot_pieces_kernel
    part_ptr,  # (blocks, 2, D) fp32 from one_hot_pieces_kernel
    ys_ptr,  # (N,) int32 targets, sorted
    N,
    D,
    a,
    b,
    blocks,
    R: tl.constexpr,
    BD: tl.constexpr,
    S: tl.constexpr,  # following blocks examined a step (a power of 2)
):
    """The runs that cross a block's end, each added up by the block it began in: its piece
    there, then the first pieces of the following blocks it covers, S blocks a step (block r is
    covered when its first sorted target is the run's: the targets are sorted), each step's S
    summed as a tree, in a fixed order. Runs of targets outside [a, b) (ignored rows) are
    skipped: only dw's rows take them."""
    q = tl.program_id(0)
    ks = tl.program_id(1) * BD + tl.arange(0, BD)
    kmask = ks < D
    last = tl.minimum((q + 1) * R, N) - 1
    v = tl.load(ys_ptr + last)
    goes_on = (last + 1 < N) & (tl.load(ys_ptr + last + 1, mask=last + 1 < N, other=0) == v)
    first = q * R
    before = tl.load(ys_ptr + first - 1, mask=first > 0, other=0)
    whole = (first > 0) & (tl.load(ys_ptr + first) == v) & (before == v)  # began before q
    if goes_on & (~whole) & (v >= a) & (v < b):
        total = tl.load(part_ptr + (q * 2 + 1) * D + ks, mask=kmask, other=0.0)
        steps = tl.arange(0, S)
        r = q + 1
        more = r < blocks
        while more:
            rs = r + steps
            inside = rs < blocks
            covered = inside & (tl.load(ys_ptr + rs * R, mask=inside, other=0) == v)
            pieces = part_ptr + (rs * 2)[:, None] * D + ks[None, :]
            total += tl.sum(tl.load(pieces, mask=covered[:, None] & kmask[None, :], other=0.0), 0)
            more = tl.sum(covered.to(tl.int32), 0) == S  # all S covered: it may go on
            r += S
        dst = acc_ptr + (v - a) * D + ks
        tl.store(dst, tl.load(dst, mask=kmask, other=0.0) - total, mask=kmask)


@triton.jit
def scale_kernel(src_ptr, g_ptr, dst_ptr, numel, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """dst = src * g, g a 1-element fp32 tensor; the product is formed in fp32, rounded once.
    dst may be src (each element is read and written by the same program)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    g = tl.load(g_ptr)
    v = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32) * g
    tl.store(dst_ptr + offs, to_dtype(v, dst_ptr.dtype.element_ty, INTERPRETED), mask=ok)


@triton.jit
def column_sums_kernel(
    z_ptr,  # (n, V) G of the chunk, or E when HAS_F (G = diag(f) E)
    f_ptr,  # (n,) fp32 row scales, when HAS_F
    out_ptr,  # (V,) fp32: the bias gradient, set (first chunk) or added to (ACCUMULATE)
    n_rows,
    V,
    stride_z,
    HAS_F: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """db_v (+)= sum_n G_nv in fp32, one program per BC columns (its own: no atomics)."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    acc = tl.zeros((BC,), tl.float32)
    for r0 in range(0, n_rows, BR):
        rows = r0 + tl.arange(0, BR)
        mask = (rows < n_rows)[:, None] & (cols < V)[None, :]
        ptrs = z_ptr + rows[:, None].to(tl.int64) * stride_z + cols[None, :]
        tile = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_F:
            tile = tile * tl.load(f_ptr + rows, mask=rows < n_rows, other=0.0)[:, None]
        acc += tl.sum(tile, axis=0)
    if ACCUMULATE:
        acc += tl.load(out_ptr + cols, mask=cols < V, other=0.0)
    tl.store(out_ptr + cols, acc, mask=cols < V)
