"""The logits GEMM with the single-read row pass in its epilogue: E = exp(x @ w.T - c), never z.

Dims as in triton_kernels.py: a chunk of n rows x (n, D), w (V, D), targets y (n,), Vr =
vocab_size real columns. The single-read kernel (exp_rows_kernel) reads the chunk's bf16
logits z from a buffer and writes E = exp(z - c) back over them, c one reference per row. Here
the logits GEMM's epilogue writes E directly from its fp32 accumulators, so the buffer is written
once and never read by a row pass. That needs c before the GEMM; it is the target's logit,

    c_n = x_n . w_{y_n}   (fp32, target_logit_kernel; 0 for ignored and out-of-range targets)

which no row's max is below, so the row's largest E is >= 1 and nothing that matters underflows.
A row whose max is far above its target's (a loss above REBASE nats) could overflow exp, so
each (row, tile) of BN columns picks its own base c_n + k REBASE, k >= 0 the fewest steps that
keep the tile's largest exponent <= REBASE, and stores k with the tile's partial sum s:

    epilogue, per tile t:  k_t = max(0, ceil((max_v z - c - REBASE) / REBASE))
                           E = exp(z - c - k_t REBASE)  (0 in padded columns and dead rows)
                           s_t = sum_v E                (fp32, before E is rounded to bf16)
    finish, per row:       K = max_t k_t,  S = sum_t s_t exp((k_t - K) REBASE)
                           loss = K REBASE + log S     (= lse - c, and c is the target logit)
                           f = g / S, and the one-hot: h = g, or where p_y >= 1/2 (every
                           row without h) h = 0 and E_y = exp(-K REBASE) - S  (folded in, fp32)
                           tiles with k_t < K: E *= exp((k_t - K) REBASE)   (rare)

after which the buffer, f and h are what exp_rows_kernel leaves: G = diag(f) E - diag(h)
onehot(y) (triton_kernels.py says why and when the one-hot stays out of E). Dead rows (ignored
targets, and out-of-range ones, whose loss is NaN) get E = 0 and f = h = 0: no gradient.

Unlike exp_rows_kernel, E and S come from the unrounded fp32 logits, so the loss does not carry
the bf16 rounding of z (torch's bf16 path does; the error against an fp32 reference is smaller).

The GEMM is persistent (one program per SM, tiles column-major so that the programs running at
once share the columns of w they read) and loads its operands through TMA descriptors; under the
CPU interpreter it runs the same code with fp32 operands (the interpreter's bf16 tl.dot is wrong
in triton 3.9). exp_logits_reference() is the same math in torch.
"""

import torch
import triton
import triton.language as tl

from fused_loss.triton_kernels import LOG2E, _logits, _row_loss, _row_weight, _tanh, _target
from gpt2_fused.kernels.fast_paths import gpu_runs
from gpt2_fused.kernels.interpreter import to_dtype
from gpt2_fused.kernels.launch import num_sms

REBASE = 64.0  # nats: E <= e^64 and S <= V e^64 stay finite in bf16 / fp32

# tiles and launch of the GEMM, by device ("cpu": the interpreter, small tiles); other tiles and
# stages are timed by bench/bench_exp_gemm.py (bench/RESULTS.md#logits-gemm-epilogue)
LAUNCH = {
    "cuda": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4),
    "cpu": dict(BM=16, BN=16, BK=16, num_warps=1, num_stages=1),
}


def applies(x, w):
    """The GEMM's TMA descriptors need 16-byte aligned rows and bases; its launch (225 KB of
    shared memory a block) is tuned and tested on Hopper only (fast_paths.FAST_PATHS): other
    GPUs take the cuBLAS GEMM and exp_rows_kernel."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return False
    if x.shape[1] % 8 or w.shape[0] % 8 or x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    return x.device.type != "cuda" or gpu_runs("loss epilogue", x.device)


@triton.jit
def target_logit_kernel(
    x_ptr,  # (n, D)
    w_ptr,  # (V, D)
    y_ptr,  # (n,) int64
    c_ptr,  # (n,) fp32 out: u_{n, y_n}, 0 where the target is ignored or out of range
    b_ptr,  # (V,) bias, when HAS_BIAS
    softcap,
    D,
    vocab_size,
    ignore_index,
    BD: tl.constexpr,  # >= D
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    r = tl.program_id(0)
    y, valid, ok = _target(y_ptr, r, vocab_size, ignore_index)
    d = tl.arange(0, BD)
    x = tl.load(x_ptr + tl.cast(r, tl.int64) * D + d, mask=d < D, other=0.0).to(tl.float32)
    y0 = tl.where(ok, y, 0)
    w = tl.load(w_ptr + tl.cast(y0, tl.int64) * D + d, mask=d < D, other=0.0).to(tl.float32)
    u = _logits(tl.sum(x * w, axis=0), y0, vocab_size, b_ptr, softcap, HAS_BIAS, SOFTCAP)
    tl.store(c_ptr + r, tl.where(ok, u, 0.0))


@triton.jit
def _tile_logits(acc, cols, b_ptr, softcap, V, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """The logits u of fp32 accumulators acc (BM, C) of columns cols (C,): bias, then cap."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        acc = softcap * _tanh(acc / softcap)
    return acc


@triton.jit
def _half_max(u, cols, vocab_size):
    """Row max of the logits u (BM, C) over the real columns."""
    real = (cols < vocab_size)[None, :]  # the padded columns' select runs on every tile: in a
    # branch of its own (the padded tile only) ptxas waits for each wgmma before the next
    return tl.max(tl.where(real, u, float("-inf")), axis=1)


@triton.jit
def _half_exp(
    u, cols, c, k, live, softcap, vocab_size, REBASE: tl.constexpr, SOFTCAP: tl.constexpr,
    ALL_ROWS: tl.constexpr,
):  # fmt: skip
    """E (BM, C) of the logits u at the base c + k REBASE (0 in padded columns and dead rows),
    times du/dz with SOFTCAP, and its row sums (before that factor; with ALL_ROWS dead rows'
    too)."""
    real = (cols < vocab_size)[None, :]
    if ALL_ROWS:
        t = tl.where(real, u - c[:, None], float("-inf"))
        e = tl.exp2((t - (k * REBASE)[:, None]) * LOG2E)
        s = tl.sum(e, axis=1)
        e = tl.where(live[:, None], e, 0.0)
    else:
        # E = exp2(u log2(e) - (c + k REBASE) log2(e)): one FMA and one exp an element (the
        # offset's rounding, ~2e-6 in the exponent for |c| < 64, is far below E's bf16 one); a
        # dead row's -inf offset gives its zeros
        offset = tl.where(live, -(c + k * REBASE) * LOG2E, float("-inf"))
        e = tl.exp2(tl.where(real, u, float("-inf")) * LOG2E + offset[:, None])
        s = tl.sum(e, axis=1)
    if SOFTCAP:  # G carries du/dz = 1 - (u / softcap)^2
        a = u / softcap
        e = e * (1.0 - a * a)
    return e, s


@triton.jit
def exp_logits_kernel(
    x_desc,  # (n, D) block [BM, BK]
    w_desc,  # (V, D) block [BN, BK]
    e_desc,  # (n, V) out, block [BM, BN // 2]: E (0 in padded columns and dead rows)
    c_ptr,  # (n,) fp32 reference per row
    y_ptr,  # (n,) int64
    s_ptr,  # (n, T) fp32 out: partial sums per tile
    k_ptr,  # (n, T) int32 out: base steps per tile
    b_ptr,  # (V,) bias, when HAS_BIAS
    softcap,
    n_rows,
    V,
    D,
    vocab_size,
    ignore_index,
    REBASE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALL_ROWS: tl.constexpr,  # the sums of dead rows too (for their lse)
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PROGRAMS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    num_m = tl.cdiv(n_rows, BM)
    tiles = num_m * tl.cdiv(V, BN)
    T = tl.cdiv(V, BN)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m = tile % num_m  # column-major: the programs at work share w's tiles
        pid_n = tile // num_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, D, BK):
            a = x_desc.load([pid_m * BM, k0])
            b = w_desc.load([pid_n * BN, k0])
            if INTERPRETED:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        rows = pid_m * BM + tl.arange(0, BM)
        in_rows = rows < n_rows
        y = tl.load(y_ptr + rows, mask=in_rows, other=ignore_index)
        live = (y != ignore_index) & (y >= 0) & (y < vocab_size)
        c = tl.load(c_ptr + rows, mask=in_rows, other=0.0)
        # The epilogue runs between the MMAs, not beside them, so it is kept short: in two halves
        # of BN / 2 columns, the first half's TMA store of E goes on while the second's exps run,
        # and E's staging buffer is half as big, which leaves room for a 4th stage of operands
        # (bench/RESULTS.md#logits-gemm-epilogue). The split is a renaming of registers.
        z0, z1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        cols0 = pid_n * BN + tl.arange(0, BN // 2)
        cols1 = cols0 + BN // 2
        z0 = _tile_logits(z0, cols0, b_ptr, softcap, V, HAS_BIAS, SOFTCAP)
        z1 = _tile_logits(z1, cols1, b_ptr, softcap, V, HAS_BIAS, SOFTCAP)
        top = tl.maximum(_half_max(z0, cols0, vocab_size), _half_max(z1, cols1, vocab_size))
        k = tl.ceil((top - c - REBASE) / REBASE)  # top - c: max(u - c) exactly (monotone rounding)
        if ALL_ROWS:  # sums of dead rows too (their lse), whose base may go below c = 0
            k = tl.maximum(k, tl.where(live, 0.0, -1e6))
        else:  # a live row's max is at least c, so its base k >= 0
            k = tl.maximum(k, 0.0)
        tl.store(k_ptr + rows * T + pid_n, k.to(tl.int32), mask=in_rows)
        e0, s0 = _half_exp(z0, cols0, c, k, live, softcap, vocab_size, REBASE, SOFTCAP, ALL_ROWS)
        e_desc.store([pid_m * BM, pid_n * BN], to_dtype(e0, e_desc.dtype, INTERPRETED))
        e1, s1 = _half_exp(z1, cols1, c, k, live, softcap, vocab_size, REBASE, SOFTCAP, ALL_ROWS)
        e_desc.store([pid_m * BM, pid_n * BN + BN // 2], to_dtype(e1, e_desc.dtype, INTERPRETED))
        tl.store(s_ptr + rows * T + pid_n, s0 + s1, mask=in_rows)


@triton.jit
def exp_finish_kernel(
    e_ptr,  # (n, V) E of the chunk; rare tiles rebased, the one-hot folded in where p_y >= 1/2
    y_ptr,  # (n,) int64
    g_ptr,  # (1,) or (n,) fp32
    s_ptr,  # (n, T) fp32
    k_ptr,  # (n, T) int32
    loss_ptr,  # (n,) fp32 out
    f_ptr,  # (n,) fp32 out: g / S (0 for dead rows)
    h_ptr,  # (n,) fp32 out when HOT: the one-hot's weight when not folded in (else 0)
    c_ptr,  # (n,) fp32: the target logits of start()
    lse_ptr,  # (n,) fp32 out, when WRITE_LSE
    softcap,
    z_loss,
    V,
    T,
    stride_e,
    vocab_size,
    ignore_index,
    REBASE: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,  # >= T
    G_PER_ROW: tl.constexpr,
    WRITE_G: tl.constexpr,
    HOT: tl.constexpr,  # the one-hot out of E where p_y < 1/2; else folded in on every row
    SOFTCAP: tl.constexpr,
    Z_LOSS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    r = tl.program_id(0)
    r64 = tl.cast(r, tl.int64)
    y, valid, ok = _target(y_ptr, r, vocab_size, ignore_index)
    ts = tl.arange(0, BT)
    k = tl.load(k_ptr + r64 * T + ts, mask=ts < T, other=0)
    s = tl.load(s_ptr + r64 * T + ts, mask=ts < T, other=0.0)
    K = tl.max(k, axis=0)
    S = tl.sum(s * tl.exp2((k - K).to(tl.float32) * (REBASE * LOG2E)), axis=0)
    lse_c = K * REBASE + tl.log(tl.where(S > 0, S, 1.0))  # lse - c; S = 0: a dead row's
    lse = tl.load(c_ptr + r) + lse_c
    ce = lse_c + z_loss * lse * lse if Z_LOSS else lse_c
    tl.store(loss_ptr + r, _row_loss(valid, ok, ce, 0.0))
    if WRITE_LSE:
        tl.store(lse_ptr + r, lse)
    if WRITE_G:
        live = valid & ok
        coef = 1.0 + 2.0 * z_loss * lse if Z_LOSS else 1.0  # d(z-loss)/du = 2 z_loss lse p
        g = tl.where(live, _row_weight(g_ptr, r, valid, G_PER_ROW), 0.0)
        tl.store(f_ptr + r, tl.where(live, g * coef / S, 0.0))  # a dead row's S may be 0
        e_y = tl.exp2(-K.to(tl.float32) * (REBASE * LOG2E))  # E_y = exp(c - base) in fp32,
        fold = live  # not the rounded one
        if HOT:
            fold = live & (2.0 * e_y >= S)  # p_y >= 1/2
            h = g
            if SOFTCAP:  # G_y = f E_y - g (1 - (c / softcap)^2): E carries the cap's derivative
                a = tl.load(c_ptr + r) / softcap
                h = g * (1.0 - a * a)
            tl.store(h_ptr + r, tl.where(fold, 0.0, h))
        e_row = e_ptr + r64 * stride_e
        out_ty = e_ptr.dtype.element_ty
        lanes = tl.arange(0, BN)
        if live & (K > 0):  # rare: tiles below the row's base are rescaled to it
            for t in range(0, T):
                kt = tl.load(k_ptr + r64 * T + t)
                if kt < K:
                    scale = tl.exp2((kt - K).to(tl.float32) * (REBASE * LOG2E))
                    cols = t * BN + lanes
                    old = tl.load(e_row + cols, mask=cols < V, other=0.0).to(tl.float32)
                    tl.store(
                        e_row + cols, to_dtype(old * scale, out_ty, INTERPRETED), mask=cols < V
                    )
            # the one-hot below goes to an element another thread may have just stored: without
            # the barrier the two stores land in either order (seen on the H200)
            tl.debug_barrier()
        if fold:  # G_y = f (E_y - S / coef) = g (coef p_y - 1)
            hot = e_y - S / coef if Z_LOSS else e_y - S
            if SOFTCAP:
                a = tl.load(c_ptr + r) / softcap
                hot = hot * (1.0 - a * a)
            tl.store(e_row + y, to_dtype(hot, out_ty, INTERPRETED))


def scratch(n, V, device):
    """The per-chunk state between start() and finish(): c (n,), s and k (n, T)."""
    T = triton.cdiv(V, LAUNCH["cuda" if device.type == "cuda" else "cpu"]["BN"])
    return (
        torch.empty(n, device=device, dtype=torch.float32),
        torch.empty((n, T), device=device, dtype=torch.float32),
        torch.empty((n, T), device=device, dtype=torch.int32),
    )


def start(
    x, w, y, e, state, *, vocab_size, ignore_index, bias=None, softcap=None, all_rows=False
):  # fmt: skip
    """Queue the target logits and the GEMM of one chunk: e (n, V) = E, state = scratch(>= n).

    x (n, D), w (V, D) in one 16-bit dtype (applies()), y (n,) int64, e (n, V) with rows of
    stride V (a view of the launcher's buffer); bias (V,) contiguous or None; softcap a float or
    None (then E carries the tanh's derivative, G as finish() says still); all_rows: the sums of
    dead rows too, so that finish() can give every row's lse.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor  # triton >= 3.3

    n, D = x.shape
    V = w.shape[0]
    cuda = x.device.type == "cuda"
    cfg = LAUNCH["cuda" if cuda else "cpu"]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    c, s, k = state
    options = dict(
        b_ptr=c if bias is None else bias, softcap=softcap or 0.0, HAS_BIAS=bias is not None,
        SOFTCAP=softcap is not None,
    )  # fmt: skip
    target_logit_kernel[(n,)](
        x, w, y, c, D=D, vocab_size=vocab_size, ignore_index=ignore_index,
        BD=triton.next_power_of_2(D), **options,
    )  # fmt: skip
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [BM, BK])
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [BN, BK])
    e_desc = TensorDescriptor(e, list(e.shape), list(e.stride()), [BM, BN // 2])
    tiles = triton.cdiv(n, BM) * s.shape[1]
    programs = min(tiles, num_sms(x.device.index)) if cuda else tiles  # one per SM
    exp_logits_kernel[(programs,)](
        x_desc, w_desc, e_desc, c, y, s, k, n_rows=n, V=V, D=D, vocab_size=vocab_size,
        ignore_index=ignore_index, REBASE=REBASE, **options, ALL_ROWS=all_rows, BM=BM, BN=BN, BK=BK,
        PROGRAMS=programs, INTERPRETED=not cuda, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip


def finish(
    e, y, g, state, losses, f, h, *, vocab_size, ignore_index, g_per_row, want_grad,
    softcap=None, z_loss=0.0, lse=None,
):  # fmt: skip
    """After start(): losses (n,) (with z_loss * lse^2) and, when want_grad, f (n,), h (n,)
    and e such that G = diag(f) e - diag(h) onehot(y); h None: the one-hot folded into e on
    every row, G = diag(f) e; lse (n,) fp32 out unless None."""
    n, V = e.shape
    c, s, k = state
    T = s.shape[1]
    cuda = e.device.type == "cuda"
    exp_finish_kernel[(n,)](
        e, y, g, s, k, losses, f, f if h is None else h, c, losses if lse is None else lse,
        softcap or 0.0, z_loss,
        V, T, e.stride(0), vocab_size, ignore_index,
        REBASE=REBASE, BN=LAUNCH["cuda" if cuda else "cpu"]["BN"], BT=triton.next_power_of_2(T),
        G_PER_ROW=g_per_row, WRITE_G=want_grad, HOT=h is not None, SOFTCAP=softcap is not None,
        Z_LOSS=z_loss != 0,
        WRITE_LSE=lse is not None, INTERPRETED=not cuda,
    )  # fmt: skip


def exp_logits_reference(x, w, y, g, *, vocab_size, ignore_index, hot=True):
    """The same in torch (fp32): (E, f, h, losses), G = diag(f) E - diag(h) onehot(y), the
    one-hot folded into E where p_y >= 1/2 (hot) or on every row (h = 0); REBASE never taken.

    Valid only where no row's max logit passes its target's by REBASE nats."""
    z = x.float() @ w.float().T
    live = (y != ignore_index) & (y >= 0) & (y < vocab_size)
    y0 = torch.where(live, y, 0)
    c = torch.where(live, z.gather(1, y0[:, None])[:, 0], 0.0)
    e = torch.exp(z - c[:, None])
    e[:, vocab_size:] = 0
    e[~live] = 0
    S = e.sum(1)
    valid = y != ignore_index
    loss = torch.where(valid, torch.where(live, S.log(), float("nan")), 0.0)
    gw = g if g.numel() > 1 else g.expand(len(y))
    f = torch.where(live, gw / S, 0.0)
    fold = live & (2.0 >= S) if hot else live  # E_y = exp(c - c) = 1: p_y = 1 / S
    rows = torch.nonzero(fold)[:, 0]
    e[rows, y[rows]] = 1.0 - S[rows]
    h = torch.where(live & ~fold, gw, 0.0)
    return e, f, h, loss
