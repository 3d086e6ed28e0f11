"""Triton kernels for linear + cross-entropy that never materialise the (N, V) logits in full.

Dims: N tokens, D hidden, V weight rows (padded vocab), Vr = vocab_size <= V real columns.
Math, for x (N, D), w (V, D), targets y (N,) and per-row gradient weights g (N,):
    z = x @ w.T                  logits; columns v >= Vr masked to -inf (never in the softmax)
    lse_n = log sum_v exp(z_nv)  loss_n = lse_n - z_{n, y_n}
    G = diag(g) (softmax(z) - onehot(y))     (N, V), the gradient of sum_n g_n loss_n wrt z
    dx = G @ w   (N, D)          dw = G.T @ x   (V, D)
g_n is 1/count (mean), 1 (sum) or the upstream gradient ("none"); 0 for ignored targets.

Rows are processed in chunks of n tokens, so only an (n, V) buffer is ever alive:
  _logits_kernel  a (BN, BV) tile of z from a K = D loop, fp32 accumulator. Stores the tile max
                  m_t (n, T), sum_t = sum exp(z - m_t) (n, T) and, when gradients are wanted,
                  E = exp(z - m_t) in the compute dtype into the buffer (n, T * BV). E is in
                  (0, 1], so bf16 storage costs a relative 2^-9 whatever the logit's magnitude.
  _lse_kernel     per row: lse from the (m_t, sum_t) partials; the target logit x_n . w_{y_n}
                  (fp32); the loss; f_nt = g_n exp(m_t - lse_n) written over m_t; and the one-hot
                  folded into E: the target's tile of E is rescaled to softmax values minus 1 at
                  the target (its f is then g_n). Afterwards G_nv = E_nv f_{n,t(v)} everywhere.
  _dx_kernel      dx rows of the chunk: G @ w with G = E * f formed in registers tile by tile
                  (never stored), the V reduction split across programs, fp32 atomics into an
                  (n, D) fp32 scratch.
  _dw_kernel      dw += E.T @ (f * x_chunk), fp32 accumulator in registers. Across chunks the
                  sum lives in the gradient itself: fp32 for fp32 weights, else a (hi, lo) pair
                  in the weight's dtype (hi = round(sum), lo = round(sum - hi)): ~16 significant
                  bits for bf16 at half the memory of an fp32 accumulator; hi ends correctly
                  rounded.
So each logit is computed once (3 GEMM-equivalents: z, dx, dw) and read from the buffer twice.
All dot products accumulate in fp32. Under the CPU interpreter (UPCAST) tiles are cast to fp32
before tl.dot, because the interpreter's bf16 dot is wrong, and fp32 -> bf16 casts are rounded to
nearest by hand, because the interpreter truncates (both seen with triton 3.9; the GPU path is
untouched).
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _cast(v, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """v.to(dtype), rounding to nearest-even for bf16 under the interpreter (which truncates)."""
    if UPCAST and dtype == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _logits_kernel(
    x_ptr,
    w_ptr,
    e_ptr,
    m_ptr,
    s_ptr,
    n_rows,
    D,
    V,
    vocab_size,
    stride_x,
    stride_w,
    stride_e,
    T,
    BN: tl.constexpr,
    BV: tl.constexpr,
    BD: tl.constexpr,
    STORE_E: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Row blocks vary fastest so that programs running together share one (BV, D) slice of w.
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_rows, BN)
    pid_v = pid // num_n
    pid_n = pid % num_n
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_v * BV + tl.arange(0, BV)
    row_ok = rows < n_rows
    ks = tl.arange(0, BD)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    acc = tl.zeros((BN, BV), dtype=tl.float32)
    for k in range(0, D, BD):
        k_ok = (k + ks) < D
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=(cols[:, None] < V) & k_ok[None, :], other=0.0)
        acc = _dot(a, tl.trans(b), acc, UPCAST, IEEE)
        x_ptrs += BD
        w_ptrs += BD

    z = tl.where((cols < vocab_size)[None, :], acc, float("-inf"))
    m = tl.max(z, axis=1)
    m = tl.where(
        m == float("-inf"), 0.0, m
    )  # a tile of padding only: keep exp() finite (it gives 0)
    e = tl.exp2((z - m[:, None]) * 1.4426950408889634)
    s = tl.sum(e, axis=1)
    tl.store(m_ptr + rows * T + pid_v, m, mask=row_ok)
    tl.store(s_ptr + rows * T + pid_v, s, mask=row_ok)
    if STORE_E:
        e_ptrs = e_ptr + rows[:, None].to(tl.int64) * stride_e + cols[None, :]
        tl.store(e_ptrs, _cast(e, e_ptr.dtype.element_ty, UPCAST), mask=row_ok[:, None])


@triton.jit
def _lse_kernel(
    m_ptr,
    s_ptr,
    x_ptr,
    w_ptr,
    y_ptr,
    g_ptr,
    e_ptr,
    loss_ptr,
    n_rows,
    D,
    T,
    stride_x,
    stride_w,
    stride_e,
    ignore_index,
    vocab_size,
    G_PER_ROW: tl.constexpr,
    WRITE_F: tl.constexpr,
    BR: tl.constexpr,
    BT: tl.constexpr,
    BDZ: tl.constexpr,
    BV: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    # Running max and rescaled sum over the T tile partials of each row.
    mx = tl.full((BR,), -1e30, tl.float32)  # finite: rows past the end must not make inf - inf
    sm = tl.zeros((BR,), tl.float32)
    for t0 in range(0, T, BT):
        ts = t0 + tl.arange(0, BT)
        ok = row_ok[:, None] & (ts < T)[None, :]
        m = tl.load(m_ptr + rows[:, None] * T + ts[None, :], mask=ok, other=float("-inf"))
        s = tl.load(s_ptr + rows[:, None] * T + ts[None, :], mask=ok, other=0.0)
        new_mx = tl.maximum(mx, tl.max(m, axis=1))
        sm = sm * tl.exp(mx - new_mx) + tl.sum(s * tl.exp(m - new_mx[:, None]), axis=1)
        mx = new_mx
    lse = mx + tl.log(tl.where(sm > 0.0, sm, 1.0))  # sm >= 1 on real rows
    lse = tl.where(row_ok, lse, 0.0)  # rows past the end: keep later exp() finite

    # Target logit x_n . w_{y_n}, fp32 accumulation of the same products the matmul forms.
    y = tl.load(y_ptr + rows, mask=row_ok, other=ignore_index)
    valid = (y != ignore_index) & row_ok
    in_range = (y >= 0) & (y < vocab_size)
    has_y = valid & in_range
    y_safe = tl.where(has_y, y, 0).to(tl.int64)
    zy = tl.zeros((BR,), tl.float32)
    for d0 in range(0, D, BDZ):
        ds = d0 + tl.arange(0, BDZ)
        ok = has_y[:, None] & (ds < D)[None, :]
        xv = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + ds[None, :], mask=ok, other=0.0
        )
        wv = tl.load(w_ptr + y_safe[:, None] * stride_w + ds[None, :], mask=ok, other=0.0)
        zy += tl.sum(xv.to(tl.float32) * wv.to(tl.float32), axis=1)
    loss = tl.where(valid, lse - zy, 0.0)
    loss = tl.where(
        valid & ~in_range, float("nan"), loss
    )  # bad target id: poison, never read out of range
    tl.store(loss_ptr + rows, loss, mask=row_ok)

    if WRITE_F:
        if G_PER_ROW:
            g = tl.load(g_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        else:
            g = tl.load(g_ptr + rows * 0)  # one scalar (1/count or 1) broadcast to the rows
        g = tl.where(valid, g, 0.0)
        # f_nt = g_n * exp(m_t - lse_n), in place of m_t. The target's tile is the exception: E
        # there is rescaled to softmax values with 1 subtracted at the target (below), so its
        # f is g_n. Then G = E * f everywhere, a pure row scaling in the GEMM kernels.
        ty = y_safe // BV
        scale_y = tl.zeros((BR,), tl.float32)  # exp(m_t - lse) of the target's tile
        for t0 in range(0, T, BT):
            ts = t0 + tl.arange(0, BT)
            ok = row_ok[:, None] & (ts < T)[None, :]
            m = tl.load(m_ptr + rows[:, None] * T + ts[None, :], mask=ok, other=0.0)
            r = tl.exp(m - lse[:, None])
            is_y = (ts[None, :] == ty[:, None]) & has_y[:, None]
            scale_y += tl.sum(tl.where(is_y, r, 0.0), axis=1)
            f = g[:, None] * tl.where(is_y, 1.0, r)
            tl.store(m_ptr + rows[:, None] * T + ts[None, :], f, mask=ok)
        cols = ty[:, None] * BV + tl.arange(0, BV)[None, :]
        e_ptrs = e_ptr + rows[:, None].to(tl.int64) * stride_e + cols
        p = tl.load(e_ptrs, mask=has_y[:, None], other=0.0).to(tl.float32) * scale_y[:, None]
        p = p - tl.where(cols == y_safe[:, None], 1.0, 0.0)
        tl.store(e_ptrs, _cast(p, e_ptr.dtype.element_ty, UPCAST), mask=has_y[:, None])


@triton.jit
def _dx_kernel(
    e_ptr,
    f_ptr,
    w_ptr,
    dx_ptr,
    n_rows,
    D,
    vocab_size,
    Vk,
    T,
    stride_e,
    stride_w,
    stride_dx,
    k_per_split,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Grid (row blocks, D blocks, splits of the V reduction); partial sums meet in fp32 atomics.
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_n * BN + tl.arange(0, BN)
    dcols = pid_d * BD + tl.arange(0, BD)
    row_ok = rows < n_rows
    d_ok = dcols < D
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, Vk)
    acc = tl.zeros((BN, BD), dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        ks = k + tl.arange(0, BK)
        e = tl.load(
            e_ptr + rows[:, None].to(tl.int64) * stride_e + ks[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        f = tl.load(f_ptr + rows * T + k // BV, mask=row_ok, other=0.0)
        g = _cast(e.to(tl.float32) * f[:, None], w_ptr.dtype.element_ty, UPCAST)  # G tile
        # Rows >= vocab_size (padding) are never read: poisoned padding cannot leak into dx.
        w = tl.load(
            w_ptr + ks[:, None].to(tl.int64) * stride_w + dcols[None, :],
            mask=(ks < vocab_size)[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = _dot(g, w, acc, UPCAST, IEEE)
    tl.atomic_add(
        dx_ptr + rows[:, None] * stride_dx + dcols[None, :],
        acc,
        mask=row_ok[:, None] & d_ok[None, :],
        sem="relaxed",
    )


@triton.jit
def _dw_kernel(
    e_ptr,
    f_ptr,
    x_ptr,
    hi_ptr,
    lo_ptr,
    n_rows,
    D,
    V,
    T,
    stride_e,
    stride_x,
    stride_w,
    BVW: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    HAS_LO: tl.constexpr,
    SCALE_X: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    # D blocks vary fastest: programs running together read the same (n, BVW) column block of E.
    pid = tl.program_id(0)
    num_d = tl.cdiv(D, BD)
    pid_v = pid // num_d
    pid_d = pid % num_d
    cols = pid_v * BVW + tl.arange(0, BVW)  # vocab rows of dw
    dcols = pid_d * BD + tl.arange(0, BD)
    d_ok = dcols < D
    t = (pid_v * BVW) // BV  # the logits tile holding these columns (BVW divides BV)
    acc = tl.zeros((BVW, BD), dtype=tl.float32)
    for k in range(0, n_rows, BK):
        rows = k + tl.arange(0, BK)
        row_ok = rows < n_rows
        e = tl.load(
            e_ptr + rows[:, None].to(tl.int64) * stride_e + cols[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )  # (BK, BVW)
        f = tl.load(f_ptr + rows * T + t, mask=row_ok, other=0.0)
        xt = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + dcols[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (BK, BD)
        if SCALE_X:  # G.T @ x = E.T @ (f * x): E goes to the tensor cores as stored
            xt = _cast(xt.to(tl.float32) * f[:, None], x_ptr.dtype.element_ty, UPCAST)
        else:
            e = _cast(e.to(tl.float32) * f[:, None], x_ptr.dtype.element_ty, UPCAST)
        acc = _dot(tl.trans(e), xt, acc, UPCAST, IEEE)

    ok = (cols < V)[:, None] & d_ok[None, :]
    offs = cols[:, None].to(tl.int64) * stride_w + dcols[None, :]
    if not FIRST:
        acc += tl.load(hi_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_LO:
            acc += tl.load(lo_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    hi = _cast(acc, hi_ptr.dtype.element_ty, UPCAST)
    tl.store(hi_ptr + offs, hi, mask=ok)
    if HAS_LO and not LAST:
        tl.store(
            lo_ptr + offs, _cast(acc - hi.to(tl.float32), lo_ptr.dtype.element_ty, UPCAST), mask=ok
        )


@triton.jit
def _scale_kernel(src_ptr, g_ptr, dst_ptr, numel, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    """dst = src * g, g a 1-element fp32 tensor; the product is formed in fp32, rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    g = tl.load(g_ptr)
    v = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32) * g
    tl.store(dst_ptr + offs, _cast(v, dst_ptr.dtype.element_ty, UPCAST), mask=ok)
