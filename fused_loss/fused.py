"""Launchers, the custom ops that torch.compile treats as opaque, and the public function.

Forward computes the loss and, when gradients are wanted, dx and dw in the same pass: the loss
is the last op of the model, so the backward only scales them by the upstream gradient (3 GEMMs,
not 4). reduction="none" cannot be precomputed that way (each row's upstream gradient is unknown
in forward), so its backward runs the pass again with those per-row weights.
"""

import functools
import os

import torch
import triton

from fused_loss import kernels
from fused_loss.checks import check_inputs
from fused_loss.reference import linear_cross_entropy_reference

# Tile shapes. BV of the logits kernel must be a multiple of the dx kernel's BK and of the dw
# kernel's BVW (they read E tile by tile). "cpu" serves the Triton interpreter in tests: small tiles
# so that small ragged shapes still span several tiles.
CONFIGS = {
    "cuda16": dict(  # bf16 / fp16
        logits=dict(BN=128, BV=256, BD=64, num_warps=8, num_stages=3),
        dx=dict(BN=128, BD=256, BK=64, num_warps=8, num_stages=3),
        dw=dict(BVW=256, BD=128, BK=64, num_warps=8, num_stages=3, SCALE_X=True),
    ),
    "cuda32": dict(  # fp32, exact (IEEE) dots: smaller tiles to fit shared memory
        logits=dict(BN=64, BV=128, BD=32, num_warps=4, num_stages=2),
        dx=dict(BN=64, BD=64, BK=32, num_warps=4, num_stages=2),
        dw=dict(BVW=64, BD=64, BK=32, num_warps=4, num_stages=2, SCALE_X=True),
    ),
    "cpu": dict(
        logits=dict(BN=16, BV=32, BD=16, num_warps=1, num_stages=1),
        dx=dict(BN=16, BD=16, BK=16, num_warps=1, num_stages=1),
        dw=dict(BVW=16, BD=16, BK=16, num_warps=1, num_stages=1, SCALE_X=True),
    ),
}
# Bytes of the (n, V) buffer of E per chunk: 160 MiB is 1664 rows of a 50304 bf16 vocab. Larger
# chunks mean fewer read-modify-writes of dw (8 bytes per weight per chunk) at the price of memory;
# below MIN_ROWS those dominate, so a huge vocabulary gets a bigger buffer instead.
BUFFER_BYTES = 160 * 2**20
MIN_ROWS = 1024
CHUNK_MULTIPLE = 128


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _config(x):
    if x.device.type != "cuda":
        return CONFIGS["cpu"]
    return CONFIGS["cuda32" if x.element_size() == 4 else "cuda16"]


def _launch_opts(c):
    return dict(num_warps=c["num_warps"], num_stages=c["num_stages"])


def _tiles(c):
    return {k: v for k, v in c.items() if k not in ("num_warps", "num_stages")}


def chunk_rows(N, Vb, elt_size, multiple=CHUNK_MULTIPLE, min_rows=None):
    """Rows per chunk: what fits in BUFFER_BYTES (at least min_rows), a multiple of `multiple`."""
    min_rows = MIN_ROWS if min_rows is None else min_rows
    n = max(BUFFER_BYTES // (Vb * elt_size), min_rows) // multiple * multiple
    return max(multiple, min(n, triton.cdiv(N, multiple) * multiple))


def _dx_splits(tiles, device):
    """Split the V reduction of dx so that the grid fills the GPU in whole waves."""
    if device.type != "cuda":
        return 2
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    best, best_eff = 1, 0.0
    for s in range(1, 17):
        progs = tiles * s
        eff = progs / (triton.cdiv(progs, sms) * sms)
        if eff > best_eff + 0.02:
            best, best_eff = s, eff
    return best


def lce_pass(x, w, y, g, *, ignore_index, vocab_size, want_grad, g_per_row, dw_dtype=None):
    """One chunked pass. x (N, D), w (V, D) in x's dtype, y (N,) int64, g: (1,) or (N,) fp32.

    Returns per-row losses (N,) fp32 and, if want_grad, dx (N, D) in x.dtype and dw (V, D) in
    dw_dtype, the gradients of sum_n g_n loss_n.
    """
    N, D = x.shape
    V = w.shape[0]
    dev = x.device
    cfg = _config(x)
    lc, xc_cfg, wc = cfg["logits"], cfg["dx"], cfg["dw"]
    BV = lc["BV"]
    T = triton.cdiv(V, BV)
    Vb = T * BV
    upcast = dev.type != "cuda"
    ieee = x.dtype == torch.float32 and not upcast
    cpu_rows = {} if dev.type == "cuda" else dict(min_rows=16)
    n = chunk_rows(N, Vb, x.element_size(), multiple=max(lc["BN"], 16), **cpu_rows)
    n_chunks = triton.cdiv(N, n)
    n = min(n, N)

    losses = torch.empty(N, device=dev, dtype=torch.float32)
    m = torch.empty((n, T), device=dev, dtype=torch.float32)
    s = torch.empty((n, T), device=dev, dtype=torch.float32)
    if want_grad:
        dw_dtype = dw_dtype or w.dtype
        buf = torch.empty((n, Vb), device=dev, dtype=x.dtype)
        dx = torch.empty_like(x)
        dx_acc = (
            None
            if x.dtype == torch.float32
            else torch.empty((n, D), device=dev, dtype=torch.float32)
        )
        dw = torch.empty((V, D), device=dev, dtype=dw_dtype)
        has_lo = dw_dtype != torch.float32 and n_chunks > 1
        lo = torch.empty((V, D), device=dev, dtype=dw_dtype) if has_lo else dw
        Vk = (
            triton.cdiv(vocab_size, xc_cfg["BK"]) * xc_cfg["BK"]
        )  # columns past the vocab are all 0
    else:
        buf = m  # never written (STORE_E=False)
        dx, dw = x.new_empty(0), x.new_empty(0)

    for i in range(n_chunks):
        c0 = i * n
        rows = min(n, N - c0)
        xs, ys = x[c0 : c0 + rows], y[c0 : c0 + rows]
        grid = (triton.cdiv(rows, lc["BN"]) * T,)
        kernels._logits_kernel[grid](
            xs,
            w,
            buf,
            m,
            s,
            rows,
            D,
            V,
            vocab_size,
            xs.stride(0),
            w.stride(0),
            buf.stride(0),
            T,
            **_tiles(lc),
            STORE_E=want_grad,
            UPCAST=upcast,
            IEEE=ieee,
            **_launch_opts(lc),
        )
        gs = g[c0 : c0 + rows] if g_per_row else g
        br = 32 if dev.type == "cuda" else 16
        kernels._lse_kernel[(triton.cdiv(rows, br),)](
            m,
            s,
            xs,
            w,
            ys,
            gs,
            buf,
            losses[c0 : c0 + rows],
            rows,
            D,
            T,
            xs.stride(0),
            w.stride(0),
            buf.stride(0),
            ignore_index,
            vocab_size,
            G_PER_ROW=g_per_row,
            WRITE_F=want_grad,
            BR=br,
            BT=64,
            BDZ=128,
            BV=BV,
            UPCAST=upcast,
        )
        if not want_grad:
            continue
        acc = dx[c0 : c0 + rows] if dx_acc is None else dx_acc[:rows]
        acc.zero_()
        tiles = triton.cdiv(rows, xc_cfg["BN"]) * triton.cdiv(D, xc_cfg["BD"])
        splits = _dx_splits(tiles, dev)
        k_per_split = triton.cdiv(triton.cdiv(Vk, xc_cfg["BK"]), splits) * xc_cfg["BK"]
        grid = (triton.cdiv(rows, xc_cfg["BN"]), triton.cdiv(D, xc_cfg["BD"]), splits)
        kernels._dx_kernel[grid](
            buf,
            m,
            w,
            acc,
            rows,
            D,
            vocab_size,
            Vk,
            T,
            buf.stride(0),
            w.stride(0),
            acc.stride(0),
            k_per_split,
            **_tiles(xc_cfg),
            BV=BV,
            UPCAST=upcast,
            IEEE=ieee,
            **_launch_opts(xc_cfg),
        )
        if dx_acc is not None:
            dx[c0 : c0 + rows].copy_(acc)
        grid = (triton.cdiv(V, wc["BVW"]) * triton.cdiv(D, wc["BD"]),)
        kernels._dw_kernel[grid](
            buf,
            m,
            xs,
            dw,
            lo,
            rows,
            D,
            V,
            T,
            buf.stride(0),
            xs.stride(0),
            dw.stride(0),
            **_tiles(wc),
            BV=BV,
            FIRST=i == 0,
            LAST=i == n_chunks - 1,
            HAS_LO=has_lo,
            UPCAST=upcast,
            IEEE=ieee,
            **_launch_opts(wc),
        )
    return losses, dx, dw


def _prepare(x, w):
    """The kernels want contiguous rows and w in x's dtype (a temporary copy when they differ)."""
    x = x.contiguous()
    w = w.contiguous() if w.dtype == x.dtype else w.to(x.dtype)
    return x, w


@torch.library.custom_op("fused_loss::lce_forward", mutates_args=())
def _lce_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    reduction: str,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w_dtype = w.dtype
    x, wc = _prepare(x, w)
    valid = y != ignore_index
    if reduction == "mean":
        g = 1.0 / valid.sum().clamp(min=1).to(torch.float32).reshape(1)  # on device, no sync
    else:
        g = torch.ones(1, device=x.device, dtype=torch.float32)
    grads = want_grad and reduction != "none"
    losses, dx, dw = lce_pass(
        x,
        wc,
        y,
        g,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
        want_grad=grads,
        g_per_row=False,
        dw_dtype=w_dtype,
    )
    loss = losses if reduction == "none" else losses.sum() * g[0]
    return loss, dx, dw


@_lce_forward.register_fake
def _(x, w, y, ignore_index, vocab_size, reduction, want_grad):
    N, D = x.shape
    loss = x.new_empty((N,) if reduction == "none" else (), dtype=torch.float32)
    if want_grad and reduction != "none":
        return loss, x.new_empty((N, D)), w.new_empty(w.shape)
    return loss, x.new_empty(0), x.new_empty(0)


@torch.library.custom_op("fused_loss::lce_backward_rows", mutates_args=())
def _lce_backward_rows(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    grad_rows: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    w_dtype = w.dtype
    x, wc = _prepare(x, w)
    g = grad_rows.to(torch.float32).contiguous()
    _, dx, dw = lce_pass(
        x,
        wc,
        y,
        g,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
        want_grad=True,
        g_per_row=True,
        dw_dtype=w_dtype,
    )
    return dx, dw


@_lce_backward_rows.register_fake
def _(x, w, y, grad_rows, ignore_index, vocab_size):
    return x.new_empty(x.shape), w.new_empty(w.shape)


@torch.library.custom_op("fused_loss::scale_grads", mutates_args=())
def _scale_grads(
    dx: torch.Tensor, dw: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx * g, dw * g) for a scalar g, each product formed in fp32 and rounded once."""
    g = g.to(torch.float32).reshape(1)
    outs = []
    for t in (dx, dw):
        out = torch.empty_like(t)
        block = 4096
        kernels._scale_kernel[(triton.cdiv(t.numel(), block),)](
            t, g, out, t.numel(), BLOCK=block, UPCAST=t.device.type != "cuda"
        )
        outs.append(out)
    return outs[0], outs[1]


@_scale_grads.register_fake
def _(dx, dw, g):
    return torch.empty_like(dx), torch.empty_like(dw)


def _setup_context(ctx, inputs, output):
    x, w, y, ignore_index, vocab_size, reduction, want_grad = inputs
    _, dx, dw = output
    ctx.reduction, ctx.ignore_index, ctx.vocab_size = reduction, ignore_index, vocab_size
    if reduction == "none":
        ctx.save_for_backward(x, w, y)
    else:
        ctx.save_for_backward(dx, dw)


def _backward(ctx, grad_loss, _grad_dx, _grad_dw):
    if ctx.reduction == "none":
        x, w, y = ctx.saved_tensors
        dx, dw = _lce_backward_rows(
            x, w, y, grad_loss.reshape(-1), ctx.ignore_index, ctx.vocab_size
        )
    else:
        dx, dw = ctx.saved_tensors
        if dx.numel() == 0:
            raise RuntimeError(
                "fused_linear_cross_entropy: forward ran without gradients; "
                "call it with grad enabled and inputs that require grad"
            )
        dx, dw = _scale_grads(dx, dw, grad_loss)
    return dx, dw, None, None, None, None, None


torch.library.register_autograd("fused_loss::lce_forward", _backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    x, weight, targets, *, ignore_index=-100, reduction="mean", vocab_size=None
):
    """Cross-entropy of softmax(x @ weight[:vocab_size].T) at `targets`, without the logits.

    x: (..., D); weight: (V, D), may be an fp32 master weight while x is bf16; targets: (...) int.
    Columns >= vocab_size are padding: out of the softmax, zero gradient, never sampled.
    reduction: "mean" over non-ignored targets (0 if none), "sum", or "none" (shape of targets).
    Under autocast the matmuls run in the autocast dtype, as F.linear would. Gradients come back in
    each input's own dtype. CUDA tensors run the Triton kernels; CPU tensors run them under the
    Triton interpreter when TRITON_INTERPRET=1, else the torch reference (as does float64).
    """
    vocab_size = check_inputs(x, weight, targets, ignore_index, reduction, vocab_size)
    if (x.device.type != "cuda" and not interpreting()) or torch.float64 in (x.dtype, weight.dtype):
        return linear_cross_entropy_reference(
            x,
            weight,
            targets,
            ignore_index=ignore_index,
            reduction=reduction,
            vocab_size=vocab_size,
        )
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    want_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    loss, _, _ = _lce_forward(
        x.reshape(-1, x.shape[-1]),
        weight,
        targets.reshape(-1).to(torch.int64),
        ignore_index,
        vocab_size,
        reduction,
        want_grad,
    )
    return loss.view(targets.shape) if reduction == "none" else loss
