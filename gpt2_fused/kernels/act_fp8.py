"""GPT-2's GELU, its gradient, or nothing, with the result cast to FP8 in the same pass (and
laid out transposed too, for a weight-gradient GEMM): the casts made where the data is.

    GELU   out = gelu_tanh(h)                     the MLP's hidden activation, for c_proj
    DGELU  out = g * gelu_tanh'(h)                its gradient, for c_fc's dgrad and wgrad
    COPY   out = g                                a gradient as it comes (c_proj's dout)
    q  = saturate(out * scale) in `fp8`           e4m3 for activations, e5m2 for gradients
    qt = q^T, contiguous (when asked)             torch._scaled_mm reads both operands K-major:
                                                  dW = dy^T x sums over tokens, so it needs
                                                  dy^T and x^T laid out along the token axis
    amax = max(amax, max |out|)                   for the next call's scale (delayed scaling)
    sums = sum over rows of out (when asked)       a bias gradient, from the unrounded values

A separate cast after an unfused producer reads the bf16 tensor for its amax, again for the
cast, and again for a transpose; here `h` (and `g`) are read once and only the FP8 bytes are
written (bench/RESULTS.md#fp8-variants: torchao's casts cost ~1.9 ms a 1558M block). The scale
is known before the first element: the previous call's, computed in the kernel from the amax
slots (fp8_scale.py), or given. That is what makes it one pass.
Tiles of BM x BN: each program reads one tile of its inputs and writes it row-major to q and,
transposed in registers, to qt, so both stores are coalesced. The ptxas that Triton 3.6-3.8
bundle gets the transposed tiles wrong (store_transposed); where a probe says so
(kernel_transposes_right), the kernel reads its tile back from q before transposing it
(transpose_way), and where that is wrong too, transpose_fp8 makes qt from q after the kernel
instead, one more read and write of the FP8 bytes. act_fp8_reference is the same in torch.
"""

import functools

import torch
import triton
import triton.language as tl

from gpt2_fused.kernels import fp8_scale
from gpt2_fused.kernels.fp8_scale import FP8_MAX, scale_and_amax
from gpt2_fused.kernels.interpreter import to_dtype

MODES = ("gelu", "dgelu", "copy")


@triton.jit
def store_transposed(qt_ptr, bits, rows, cols, M, N, HOW: tl.constexpr, q_ptr):
    """Store the tile `bits` (uint8, the FP8 bytes of rows x cols) into qt (N, M) transposed.
    HOW 0: tl.trans of the bytes in registers, which the compiler moves through shared memory;
    ptxas 12.x (bundled with Triton 3.6-3.8) miscompiles that in some kernels, the GELU
    gradient's among them (triton-lang/triton#11111; bench/RESULTS.md#fp8-fused-casts). HOW 2:
    the tile read back from q (M, N), where this program has just stored it, after a barrier (a
    volatile load: no forwarding from registers), then transposed as HOW 0 does: the shape of
    transpose_fp8's kernel, which that ptxas gets right, with the tile still in L2, at no
    measured cost (bench/RESULTS.md#fp8-fused-on-main). Storing to transposed addresses instead
    was slower and as wrong."""
    if HOW == 2:
        tl.debug_barrier()  # the block's stores to q are visible to all its threads after it
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        bits = tl.load(q_ptr + offs, mask=mask, other=0, volatile=True)
    offs = cols.to(tl.int64)[:, None] * M + rows[None, :]
    mask = (cols < N)[:, None] & (rows < M)[None, :]
    tl.store(qt_ptr + offs, tl.trans(bits), mask=mask)


@triton.jit
def act_out(g_ptr, h_ptr, offs, mask, MODE: tl.constexpr):
    """The tile's output in fp32 (module docstring), 0 outside the mask."""
    if MODE != 2:
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)  # sqrt(2 / pi) (h + c h^3)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner)
    if MODE == 0:
        out = 0.5 * h * (1.0 + t)
    else:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 1:  # d/dh of 0.5 h (1 + tanh(u)), u' = sqrt(2/pi) (1 + 3 c h^2)
            du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
            out = g * (0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * du)
        else:
            out = g
    return tl.where(mask, out, 0.0)


@triton.jit
def store_fp8(q_ptr, qt_ptr, out, scale, rows, cols, mask, offs, M, N, FP8_MAX: tl.constexpr,
              E5M2: tl.constexpr, TRANSPOSED: tl.constexpr, HOW: tl.constexpr,
              INTERPRETED: tl.constexpr):  # fmt: skip
    """q = saturate(out * scale) as FP8 bytes, row-major and, when TRANSPOSED, into qt."""
    clamped = tl.minimum(tl.maximum(out * scale, -FP8_MAX), FP8_MAX)
    fp8 = tl.float8e5 if E5M2 else tl.float8e4nv
    bits = to_dtype(clamped, fp8, INTERPRETED).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + offs, bits, mask=mask)
    if TRANSPOSED:
        store_transposed(qt_ptr, bits, rows, cols, M, N, HOW, q_ptr)


@triton.jit
def act_fp8_kernel(
    g_ptr,  # (M, N) in: the gradient (DGELU, COPY); unused for GELU
    h_ptr,  # (M, N) in: the pre-activation (GELU, DGELU); unused for COPY
    q_ptr,  # (M, N) out: the FP8 bytes as uint8
    qt_ptr,  # (N, M) out: the same transposed, uint8 (when TRANSPOSED)
    scale_ptr,  # (1,) fp32 in (unless DELAYED)
    amax_ptr,  # (1,) fp32 in/out: atomic max (unless DELAYED)
    slots_ptr,  # DELAYED: (3,) fp32, the amax slots (fp8_scale.py)
    k3,  # DELAYED: the call's index mod 3
    inv_ptr,  # DELAYED: (1,) fp32 out, 1 / scale
    sums_ptr,  # (cdiv(M, BM), N) fp32 out: each row of tiles' column sums of out (when SUMS)
    M,
    N,
    FP8_MAX: tl.constexpr,
    E5M2: tl.constexpr,  # e5m2, else e4m3
    MODE: tl.constexpr,  # 0 GELU, 1 DGELU, 2 COPY
    TRANSPOSED: tl.constexpr,
    HOW: tl.constexpr,  # store_transposed's
    SUMS: tl.constexpr,
    DELAYED: tl.constexpr,  # the scale from the slots
    BM: tl.constexpr,
    BN: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    out = act_out(g_ptr, h_ptr, offs, mask, MODE)
    scale, amax_ptr = scale_and_amax(scale_ptr, amax_ptr, slots_ptr, k3, inv_ptr, first,
                                     FP8_MAX, DELAYED)  # fmt: skip
    store_fp8(q_ptr, qt_ptr, out, scale, rows, cols, mask, offs, M, N, FP8_MAX, E5M2,
              TRANSPOSED, HOW, INTERPRETED)  # fmt: skip
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(out), axis=1), axis=0))
    if SUMS:  # a bias gradient from the unrounded values, in a fixed order (no atomics)
        tl.store(sums_ptr + tl.program_id(0).to(tl.int64) * N + cols, tl.sum(out, axis=0),
                 mask=cols < N)  # fmt: skip


def act_fp8(mode, scale=None, amax=None, *, h=None, g=None, fp8=torch.float8_e4m3fn,
            transposed=False, sums=False, delayed=None, block=(64, 64), how=None,
            split=None):  # fmt: skip
    """(q, qt or None[, column sums]): `mode`'s output (module docstring) of h and/or g ((M, N),
    contiguous, one dtype) times scale ((1,) fp32), saturated and cast to `fp8`; qt = q^T
    contiguous when `transposed`; with `sums`, the output's column sums (N,) in fp32 before
    scaling and rounding (a bias gradient). amax ((1,) fp32) becomes max(amax, max |output|),
    in place. Or, in place of scale and amax, delayed (a fp8_scale.Delayed): the scale from its
    slots, which take this call's amax. how: store_transposed's (None: transpose_way's for this
    GPU). split: qt by transpose_fp8 after the kernel (True) or in it (False); None: in it where
    this GPU's compiled kernel gets it right that way (kernel_transposes_right), else after."""
    if mode not in MODES:
        raise ValueError(f"act_fp8: mode must be one of {MODES}, got {mode!r}")
    ins = [t for t in (h, g) if t is not None]
    needed = {"gelu": ("h",), "dgelu": ("h", "g"), "copy": ("g",)}[mode]
    if len(ins) != len(needed) or any({"h": h, "g": g}[n] is None for n in needed):
        raise ValueError(f"act_fp8: mode {mode!r} takes {' and '.join(needed)}")
    a = ins[0]
    if any(t.dim() != 2 or not t.is_contiguous() or t.shape != a.shape for t in ins):
        raise ValueError("act_fp8: inputs must be contiguous 2-D tensors of one shape")
    if (delayed is None) == (scale is None or amax is None):
        raise ValueError("act_fp8: give scale and amax, or delayed")
    if fp8 not in FP8_MAX:
        raise ValueError(f"act_fp8: fp8 must be one of {list(FP8_MAX)}, got {fp8}")
    if how is None:
        how = transpose_way(a.device) if transposed else 0
    if split is None:
        split = transposed and not kernel_transposes_right(a.device, how)
    in_kernel = transposed and not split
    M, N = a.shape
    q = torch.empty((M, N), device=a.device, dtype=fp8)
    qt = torch.empty((N, M), device=a.device, dtype=fp8) if in_kernel else q
    BM, BN = block
    partial = torch.empty((triton.cdiv(M, BM) if sums else 0, N), device=a.device,
                          dtype=torch.float32)  # fmt: skip
    d = delayed or (partial, 0, partial)  # unused unless delayed
    args = (a if g is None else g, a if h is None else h, q.view(torch.uint8), qt.view(torch.uint8),
            d[0] if scale is None else scale, d[0] if amax is None else amax, d[0], d[1], d[2],
            partial, M, N)  # fmt: skip
    meta = dict(FP8_MAX=FP8_MAX[fp8], E5M2=fp8 == torch.float8_e5m2, MODE=MODES.index(mode),
                TRANSPOSED=in_kernel, HOW=how, SUMS=sums, DELAYED=delayed is not None, BM=BM,
                BN=BN, INTERPRETED=a.device.type != "cuda", num_warps=4)  # fmt: skip
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    act_fp8_kernel[grid](*args, **meta)
    if transposed and split:
        qt = transpose_fp8(q, block)
    out = q, (qt if transposed else None)
    return (*out, partial.sum(0)) if sums else out


@functools.cache
def kernel_transposes_right(device, how=0):
    """Whether act_fp8_kernel's transposed copies, stored the `how` way, can be trusted on
    `device`, by two calls in the modes that show the fault (the GELU gradient with a given
    scale, e5m2; the GELU with a delayed one, e4m3; 512 x 1024): with how 0, Triton 3.6-3.8's
    bundled ptxas (12.x) gets a quarter of their bytes wrong on an H200, where CUDA 13's gets
    them all right (bench/RESULTS.md#fp8-fused-casts). Always True off the GPU (the interpreter
    is right)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    g = torch.Generator(device=device).manual_seed(0)
    h, dy = (torch.randn(512, 1024, device=device, generator=g).bfloat16() for _ in range(2))
    one, amax = torch.ones(1, device=device), torch.zeros(1, device=device)
    slots = torch.tensor([4.0, 0.0, 0.0], device=device)  # a last amax near the GELU's
    delayed = fp8_scale.Delayed(slots, 0, torch.empty(1, device=device))
    way = dict(transposed=True, how=how, split=False)
    copies = [act_fp8("dgelu", one, amax, h=h, g=dy, fp8=torch.float8_e5m2, **way),
              act_fp8("gelu", h=h, delayed=delayed, **way)]  # fmt: skip
    return all(torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t()) for q, qt in copies)


@functools.cache
def transpose_way(device):
    """store_transposed's way for act_fp8's transposed copies on `device`: 0 (tl.trans of the
    tile in registers) where the compiled kernel gets it right, else 2 (the tile read back from
    q first), which act_fp8 still splits off where that is wrong too (kernel_transposes_right)."""
    return 0 if kernel_transposes_right(device, 0) else 2


@triton.jit
def transpose_bytes_kernel(q_ptr, qt_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    bits = tl.load(q_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0)
    store_transposed(qt_ptr, bits, rows, cols, M, N, 0, q_ptr)


def transpose_fp8(q, block=(64, 64)):
    """q^T contiguous, for a contiguous FP8 tensor q (M, N): the operand layout a weight-gradient
    GEMM reads (torch's own transposing copy is a strided elementwise kernel: 0.16 ms for 1558M's
    26 MB LayerNorm output, bench/RESULTS.md#fp8-fused-casts)."""
    M, N = q.shape
    if not q.is_contiguous():
        raise ValueError("transpose_fp8: q must be contiguous")
    qt = torch.empty((N, M), device=q.device, dtype=q.dtype)
    BM, BN = block
    transpose_bytes_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        q.view(torch.uint8), qt.view(torch.uint8), M, N, BM=BM, BN=BN, num_warps=4
    )
    return qt


def act_fp8_reference(mode, scale, *, h=None, g=None, fp8=torch.float8_e4m3fn):
    """act_fp8 in torch: (output in fp32, q, max |output| as a 0-dim fp32 tensor)."""
    if mode == "gelu":
        out = torch.nn.functional.gelu(h.float(), approximate="tanh")
    elif mode == "dgelu":
        hf = h.float().requires_grad_(True)
        with torch.enable_grad():
            a = torch.nn.functional.gelu(hf, approximate="tanh")
        (out,) = torch.autograd.grad(a, hf, g.float())
    else:
        out = g.float()
    top = FP8_MAX[fp8]
    q = (out * scale.float()).clamp(-top, top).to(fp8)
    return out, q, out.abs().max()
