"""LayerNorm that also writes the FP8 copy of its output for the next GEMM, with its amax: the
cast made where the data already is, instead of a separate amax pass and cast pass.

    y   = (x - mean) * rstd * weight + bias          x (M, D) one row a program, stats in fp32
    y8  = saturate_e4m3(y * scale)                    scale (tensorwise): one fp32 scalar, given
                                                      or delayed (fp8_scale.py: from the amax
                                                      of the previous call, in the kernel)
    amax = max |y|                                    over the whole tensor, for the next scale
or, rowwise:
    s_m = E4M3_MAX / max_d |y[m, d]|                  per row, known inside the program
    y8[m] = saturate_e4m3(y[m] * s_m),  inv[m] = 1 / s_m

Why given (delayed) tensorwise scales: the scale of a whole tensor from its own amax needs the
amax before the first element can be cast, i.e. a second pass over y (torchao's dynamic
scaling; bench/RESULTS.md#fp8-variants: its amax and cast kernels cost ~1.9 ms a 1558M block).
Taking the scale from the previous call's amax makes it one pass: y is read once from registers
for y8 and amax. Rowwise needs no history: a row's amax is known in the program that casts it.
Which one keeps quality within 0.02 nats of bf16 is for bench/quality_pair.sh to say.

ln_fp8 is the launcher; ln_fp8_reference the same in torch (fp32 statistics, torch's own
float8 cast, which rounds to nearest-even and saturates here by the clamp).

The backward, ln_backward, is LayerNorm's own from mean and rstd, with the residual's gradient
added in the same pass (the half blocks' dx = dout + LN'(dy)); one program a group of rows:

    xhat = (x - mean) rstd,  g = dy w
    dx   = rstd (g - mean_d(g) - xhat mean_d(g xhat)) + residual
    dw   = sum_rows(dy xhat),  db = sum_rows(dy)      each program's share, summed after
ln_backward_reference is the same in torch.
"""

import torch
import triton
import triton.language as tl

from gpt2_fused.kernels.fp8_scale import scale_and_amax
from gpt2_fused.kernels.interpreter import to_dtype

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


@triton.jit
def ln_fp8_kernel(
    x_ptr,  # (M, D) in: rows of stride stride_x
    w_ptr,  # (D,) LayerNorm weight
    b_ptr,  # (D,) LayerNorm bias (ignored unless HAS_BIAS)
    y_ptr,  # (M, D) out, x's dtype (written only when STORE_Y)
    y8_ptr,  # (M, D) out, float8_e4m3fn
    scale_ptr,  # tensorwise: (1,) fp32 in, the scale; rowwise: (M,) fp32 out, 1 / each row's scale
    amax_ptr,  # tensorwise: (1,) fp32 in/out, max |y| so far (atomic max); rowwise: unused
    slots_ptr,  # DELAYED: (3,) fp32, the amax slots (fp8_scale.py); else unused
    k3,  # DELAYED: the call's index mod 3
    inv_ptr,  # DELAYED: (1,) fp32 out, 1 / scale
    mean_ptr,  # (M,) fp32 out
    rstd_ptr,  # (M,) fp32 out
    M,
    D,
    stride_x,
    eps,
    BLOCK_D: tl.constexpr,  # >= D, a power of two
    ROWS: tl.constexpr,  # rows a program
    HAS_BIAS: tl.constexpr,
    STORE_Y: tl.constexpr,
    ROWWISE: tl.constexpr,
    DELAYED: tl.constexpr,  # tensorwise, the scale from the slots
    INTERPRETED: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if not ROWWISE:
        scale, amax_ptr = scale_and_amax(scale_ptr, amax_ptr, slots_ptr, k3, inv_ptr,
                                         tl.program_id(0) == 0, 448.0, DELAYED)  # fmt: skip
    seen = 0.0  # this program's max |y|
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < M:
            r64 = row.to(tl.int64)
            x = tl.load(x_ptr + r64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=0) / D
            xc = tl.where(col_ok, x - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
            y = xc * rstd * w
            if HAS_BIAS:
                y += b
            y = tl.where(col_ok, y, 0.0)
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)
            if STORE_Y:
                tl.store(y_ptr + r64 * D + cols, to_dtype(y, y_ptr.dtype.element_ty, INTERPRETED),
                         mask=col_ok)  # fmt: skip
            row_max = tl.max(tl.abs(y), axis=0)
            if ROWWISE:
                s = 448.0 / tl.maximum(row_max, 1e-12)  # E4M3_MAX over the row's amax
                tl.store(scale_ptr + row, 1.0 / s)
            else:
                s = scale
                seen = tl.maximum(seen, row_max)
            y8 = tl.minimum(tl.maximum(y * s, -448.0), 448.0)  # saturate, as torchao does
            tl.store(y8_ptr + r64 * D + cols, to_dtype(y8, tl.float8e4nv, INTERPRETED), mask=col_ok)
    if not ROWWISE:
        tl.atomic_max(amax_ptr, seen)  # amax >= 0: fp32 max by its bits is order-free


def ln_fp8(x, weight, bias, eps, *, scale=None, amax=None, delayed=None, store_y=True, rows=4):
    """LayerNorm of x (..., D) with the FP8 copy of its output: (y or None, y8, scale_out, mean,
    rstd). Tensorwise (scale given, a (1,) fp32 tensor): y8 = e4m3(y * scale), and amax ((1,)
    fp32, updated in place as max(amax, max |y|)) must be given too; scale_out is scale.
    Delayed (a fp8_scale.Delayed): tensorwise with the scale from its slots, which take this
    call's amax; scale_out is its inv, 1 / scale. Rowwise (none of these): one scale a row,
    scale_out (M,) fp32 holds 1 / each row's scale (what torch._scaled_mm's scale_a takes). y
    (x's dtype and shape) only when store_y."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, dev = x2.shape[0], x.device
    rowwise = scale is None and delayed is None
    if delayed is not None and scale is not None:
        raise ValueError("ln_fp8: a scale or a delayed one, not both")
    if scale is not None and (amax is None or scale.numel() != 1 or amax.numel() != 1):
        raise ValueError("ln_fp8: a tensorwise scale needs amax, both (1,) fp32 tensors")
    y = torch.empty((M, D), device=dev, dtype=x.dtype) if store_y else x2.new_empty(0)
    y8 = torch.empty((M, D), device=dev, dtype=torch.float8_e4m3fn)
    mean = torch.empty(M, device=dev, dtype=torch.float32)
    rstd = torch.empty(M, device=dev, dtype=torch.float32)
    if rowwise:
        scale_out = torch.empty(M, device=dev, dtype=torch.float32)
        scale_arg, amax = scale_out, mean  # amax: unused
    else:
        scale_out = scale if delayed is None else delayed.inv
        scale_arg = mean if delayed is not None else scale  # mean: unused
    d = delayed or (mean, 0, mean)  # unused unless delayed
    ln_fp8_kernel[(triton.cdiv(M, rows),)](
        x2, weight, weight if bias is None else bias, y, y8, scale_arg,
        mean if amax is None else amax, d[0], d[1], d[2], mean, rstd, M, D, x2.stride(0), eps,
        BLOCK_D=triton.next_power_of_2(D), ROWS=rows, HAS_BIAS=bias is not None,
        STORE_Y=store_y, ROWWISE=rowwise, DELAYED=delayed is not None,
        INTERPRETED=dev.type != "cuda", num_warps=4 if D <= 1024 else 8,
    )  # fmt: skip
    shape = x.shape
    return (y.view(shape) if store_y else None), y8.view(shape), scale_out, mean, rstd


@triton.jit
def ln_backward_kernel(
    dy_ptr,  # (M, D) in: the gradient of the LayerNorm's output
    x_ptr,  # (M, D) in: its input
    res_ptr,  # (M, D) in: a gradient added to dx (when HAS_RES)
    w_ptr,  # (D,) LayerNorm weight
    mean_ptr,  # (M,) fp32
    rstd_ptr,  # (M,) fp32
    dx_ptr,  # (M, D) out, x's dtype
    dw_ptr,  # (programs, D) fp32 out: each program's share of dw
    db_ptr,  # (programs, D) fp32 out: each program's share of db
    M,
    D,
    BLOCK_D: tl.constexpr,  # >= D, a power of two
    ROWS: tl.constexpr,  # rows a program
    HAS_RES: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < M:
            offs = row.to(tl.int64) * D + cols
            x = tl.load(x_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xhat = tl.where(col_ok, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
            g = dy * w
            dx = rstd * (g - tl.sum(g, axis=0) / D - xhat * (tl.sum(g * xhat, axis=0) / D))
            if HAS_RES:
                dx += tl.load(res_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(dx_ptr + offs, to_dtype(dx, dx_ptr.dtype.element_ty, INTERPRETED), mask=col_ok)
            dw += dy * xhat
            db += dy
    tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * D + cols, dw, mask=col_ok)
    tl.store(db_ptr + tl.program_id(0).to(tl.int64) * D + cols, db, mask=col_ok)


def ln_backward(dy, x, mean, rstd, weight, *, residual=None, out_dtype=None, rows=16):
    """(dx, dw, db) of LayerNorm y = (x - mean) rstd w + b for dy, all (M, D) (module
    docstring): dx in out_dtype (x's by default) with `residual` added when given; dw and db in
    the weight's dtype, each row group's share summed in a fixed order."""
    M, D = x.shape
    if dy.shape != x.shape or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"ln_backward: dy {tuple(dy.shape)} and residual must be x's shape "
                         f"{tuple(x.shape)}")  # fmt: skip
    dy, x = dy.contiguous(), x.contiguous()
    residual = None if residual is None else residual.contiguous()
    dx = torch.empty((M, D), device=x.device, dtype=out_dtype or x.dtype)
    programs = triton.cdiv(M, rows)
    dw = torch.empty((programs, D), device=x.device, dtype=torch.float32)
    db = torch.empty_like(dw)
    ln_backward_kernel[(programs,)](
        dy, x, dy if residual is None else residual, weight, mean, rstd, dx, dw, db, M, D,
        BLOCK_D=triton.next_power_of_2(D), ROWS=rows, HAS_RES=residual is not None,
        INTERPRETED=x.device.type != "cuda", num_warps=4 if D <= 1024 else 8,
    )  # fmt: skip
    return dx, dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype)


def ln_backward_reference(dy, x, mean, rstd, weight, *, residual=None, out_dtype=None):
    """ln_backward in torch, fp32 math."""
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    g = dy.float() * weight.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if residual is not None:
        dx = dx + residual.float()
    dw, db = (dy.float() * xhat).sum(0), dy.float().sum(0)
    return dx.to(out_dtype or x.dtype), dw.to(weight.dtype), db.to(weight.dtype)


def ln_fp8_reference(x, weight, bias, eps, *, scale=None):
    """ln_fp8 in torch: (y in x's dtype, y8, scale_out, amax of y (0-dim fp32), mean, rstd)."""
    D = x.shape[-1]
    xf = x.reshape(-1, D).float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False) + eps)
    y = (xf - mean[:, None]) * rstd[:, None] * weight.float()
    if bias is not None:
        y = y + bias.float()
    row_max = y.abs().amax(-1)
    if scale is None:
        s = E4M3_MAX / row_max.clamp(min=1e-12)
        scale_out, s = 1.0 / s, s[:, None]
    else:
        scale_out, s = scale, scale.float()
    y8 = (y * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    shape = x.shape
    return (y.to(x.dtype).view(shape), y8.view(shape), scale_out, row_max.max(), mean, rstd)
