"""A decoding step's linear layers at batch 1: one row times the weight, read once.

    y (N,) = act(W (N, K) @ LN(x) (K,) + b (N,)) + r (N,)     W, x, b, r bf16 or fp16
    LN: optional, the block's LayerNorm of x (fp32 statistics, its output rounded to x's dtype
        as nn.LayerNorm's is); act: identity or GPT-2's tanh GELU,
        y * sigmoid(2 sqrt(2/pi) (y + 0.044715 y^3)); r: optional, the residual stream

At batch 1 a step is bound by reading the weights once (124M: 0.25 GB, 1558M: 3.1 GB in bf16),
and a GPT-2 block's small kernels (LayerNorm, residual add, a launch gap each) cost as much as
its weight reads. So a block is four calls of this kernel (model.Block): the LayerNorms in the
prologue of c_attn and c_fc, the residual adds in the epilogue of the two projections, the bias
and the GELU on the fp32 sum, rounded once (torch rounds the matmul and then the add: the same
to a bf16 rounding); c_attn's epilogue also stores the step's key and value rows in the static
cache at pos (generate.StaticKVCache), so no cache-write kernels run. Timings:
bench/RESULTS.md#sampling.

Each program loads BLOCK_N whole rows of W at once (K is a compile-time constant: one masked
load of KP = next_power_of_2(K) columns, 16 bytes per thread and step), so all of a program's
weight bytes are in flight together. On Hopper the kernel is launched as a programmatic
dependent launch: the weights do not depend on the previous kernel, so a program issues their
loads, lets the next kernel launch (gdc_launch_dependents) and only then waits for the previous
kernel's output (gdc_wait) before it reads x and r. A following kernel that is not launched this
way waits for this one to end, as always.

model.Block takes this path where applies() holds (CUDA, one row, no autograd, x and W in one
16-bit dtype); gemv() runs the kernel on any device (the Triton interpreter on CPU, for tests);
gemv_reference() is the same math in torch.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpt2_fused.kernels.fast_paths import gpu_runs
from gpt2_fused.kernels.interpreter import to_dtype
from gpt2_fused.kernels.launch import num_sms

ELEMENTS = 8192  # weight elements a program loads (BLOCK_N rows of KP): 16 KB of bf16
NUM_WARPS = 4


@triton.jit
def gemv_kernel(
    x_ptr,  # (K,) the input row
    w_ptr,  # (N, K) contiguous
    b_ptr,  # (N,) bias, when HAS_BIAS
    r_ptr,  # (N,) residual, when RESIDUAL
    ln_w_ptr,  # (K,) LayerNorm weight, when LN
    ln_b_ptr,  # (K,) LayerNorm bias, when LN_BIAS
    y_ptr,  # (N,) out
    k_ptr,  # (nh, L, HEAD) the layer's key cache, when KV
    v_ptr,  # (nh, L, HEAD) its value cache, when KV
    pos_ptr,  # (1,) int64: the position this step stores, when KV
    N,
    eps,
    stride_head,  # L * HEAD, when KV
    K: tl.constexpr,
    KP: tl.constexpr,  # next_power_of_2(K)
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LN: tl.constexpr,
    LN_BIAS: tl.constexpr,
    GELU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    KV: tl.constexpr,  # c_attn's output: also store its key and value rows in the cache
    HEAD: tl.constexpr,  # head size, when KV
    PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, KP)
    k_ok = ks < K
    w_tile = w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
    w = tl.load(w_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if PDL:  # the weights are on their way: let the next kernel launch, then wait for x
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    if LN:  # every program normalises the whole row (K elements from L2): no separate kernel
        mean = tl.sum(x, axis=0) / K
        d = tl.where(k_ok, x - mean, 0.0)
        x = d * tl.rsqrt(tl.sum(d * d, axis=0) / K + eps)
        x *= tl.load(ln_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        if LN_BIAS:
            x += tl.load(ln_b_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = to_dtype(x, x_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)  # as nn.LayerNorm's
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if GELU:  # 0.5 (1 + tanh(u)) = sigmoid(2 u)
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    if RESIDUAL:
        y += tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = to_dtype(y, y_ptr.dtype.element_ty, INTERPRETED)
    tl.store(y_ptr + rows, y, mask=row_ok)
    if KV:  # rows [0, N/3) are q, [N/3, 2N/3) k, [2N/3, N) v: head j // HEAD, dim j % HEAD
        j = rows - N // 3
        is_v = j >= N // 3
        j = tl.where(is_v, j - N // 3, j)
        offs = (j // HEAD) * stride_head + tl.load(pos_ptr) * HEAD + j % HEAD
        tl.store(k_ptr + offs, y, mask=row_ok & (j >= 0) & ~is_v)
        tl.store(v_ptr + offs, y, mask=row_ok & is_v)


def block_n(n, k, device):
    """Rows per program: ELEMENTS weights (at least one row), halved while fewer than two
    programs per SM would be left."""
    cuda = device.type == "cuda"
    sms = num_sms(device.index) if cuda else 132
    block = max(1, ELEMENTS // triton.next_power_of_2(k))
    while block > 1 and triton.cdiv(n, block) < 2 * sms:
        block //= 2
    return block


def pdl(device):
    """Programmatic dependent launch: CUDA on sm_90 and later (its PTX needs Hopper)."""
    return device.type == "cuda" and gpu_runs("gemv pdl", device)


def gemv(x, w, b=None, *, gelu=False, ln=None, residual=None, kv=None, out_dtype=None):
    """act(LN(x) @ w.T + b) + residual for x (..., K) holding one row; w (N, K) contiguous, b,
    residual (..., N) or None, ln (weight, bias or None, eps) or None, all in x's dtype; returns
    (..., N) in out_dtype (default x's).

    kv: (k_cache, v_cache, pos) for c_attn (N = 3 C): its output's k and v thirds are also
    stored at position pos (a (1,) int64 tensor) of the caches (1, n_head, L, C / n_head), in
    place, as StaticKVCache.update would store them."""
    n, k = w.shape
    if x.numel() != k or not w.is_contiguous() or x.dtype != w.dtype:
        raise ValueError(f"gemv: one row of {k} in w's dtype {w.dtype} and a contiguous w needed")
    if residual is not None and residual.numel() != n:
        raise ValueError(f"gemv: the residual needs {n} elements, got {tuple(residual.shape)}")
    ln_w, ln_b, eps = ln if ln is not None else (None, None, 0.0)
    r = None if residual is None else residual.reshape(n)
    args = (x.reshape(k), w, b, r, ln_w, ln_b, eps, gelu, out_dtype or x.dtype)
    if kv is None:
        return _gemv_op(*args).view(*x.shape[:-1], n)
    k_cache, v_cache, pos = kv
    heads = k_cache.shape[1]
    if (
        k_cache.dim() != 4
        or k_cache.shape[0] != 1
        or heads * k_cache.shape[3] * 3 != n
        or v_cache.shape != k_cache.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.dtype != (out_dtype or x.dtype)
    ):
        raise ValueError(
            f"gemv: kv caches must be contiguous (1, n_head, L, {n} / 3 / n_head) in the output's "
            f"dtype, got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)}"
        )
    return _gemv_kv_op(*args, k_cache, v_cache, pos).view(*x.shape[:-1], n)


# An opaque op to torch.compile: a compiled decoding step keeps the kernel (Inductor would use
# cuBLAS for the matmul and its own LayerNorm) and fuses what is around it.
@torch.library.custom_op("gpt2_fused::gemv", mutates_args=())
def _gemv_op(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    r: torch.Tensor | None,
    ln_w: torch.Tensor | None,
    ln_b: torch.Tensor | None,
    eps: float,
    gelu: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return launch(x, w, b, r, ln_w, ln_b, eps, gelu, out_dtype)


@_gemv_op.register_fake
def _(x, w, b, r, ln_w, ln_b, eps, gelu, out_dtype):
    return x.new_empty(w.shape[0], dtype=out_dtype)


# The same with the key and value stores; the caches are mutated in place.
@torch.library.custom_op("gpt2_fused::gemv_kv", mutates_args=("k_cache", "v_cache"))
def _gemv_kv_op(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    r: torch.Tensor | None,
    ln_w: torch.Tensor | None,
    ln_b: torch.Tensor | None,
    eps: float,
    gelu: bool,
    out_dtype: torch.dtype,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
) -> torch.Tensor:
    return launch(x, w, b, r, ln_w, ln_b, eps, gelu, out_dtype, kv=(k_cache, v_cache, pos))


@_gemv_kv_op.register_fake
def _(x, w, b, r, ln_w, ln_b, eps, gelu, out_dtype, k_cache, v_cache, pos):
    return x.new_empty(w.shape[0], dtype=out_dtype)


def launch(x, w, b, r, ln_w, ln_b, eps, gelu, out_dtype, kv=None):
    """The kernel's launch: y (N,) in out_dtype; kv None or (k_cache, v_cache, pos)."""
    n, k = w.shape
    k_cache, v_cache, pos = kv if kv is not None else (w, w, w)  # w: no such input
    y = torch.empty(n, dtype=out_dtype, device=x.device)
    bn = block_n(n, k, x.device)
    use_pdl = pdl(x.device)
    gemv_kernel[(triton.cdiv(n, bn),)](
        x.contiguous(),
        w,
        *(w if t is None else t.contiguous() for t in (b, r, ln_w, ln_b)),  # w: no such input
        y,
        k_cache,
        v_cache,
        pos,
        n,
        eps,
        k_cache.stride(1) if kv is not None else 0,
        K=k,
        KP=triton.next_power_of_2(k),
        BLOCK_N=bn,
        HAS_BIAS=b is not None,
        LN=ln_w is not None,
        LN_BIAS=ln_b is not None,
        GELU=gelu,
        RESIDUAL=r is not None,
        KV=kv is not None,
        HEAD=k_cache.shape[3] if kv is not None else 1,
        PDL=use_pdl,
        INTERPRETED=x.device.type != "cuda",
        num_warps=NUM_WARPS,
        **(dict(launch_pdl=True) if use_pdl else {}),
    )
    return y


def gemv_reference(x, w, b=None, *, gelu=False, ln=None, residual=None, out_dtype=None):
    """The same in torch: F.layer_norm, F.linear, GPT-2's tanh GELU, the residual add."""
    if ln is not None:
        x = F.layer_norm(x, x.shape[-1:], ln[0], ln[1], ln[2])
    y = F.linear(x, w, b)
    y = F.gelu(y, approximate="tanh") if gelu else y
    y = y if residual is None else residual + y
    return y if out_dtype is None else y.to(out_dtype)


def applies(x, w):
    """Whether the GEMV takes x @ w.T: one row on CUDA in w's 16-bit dtype, no autograd (the
    kernel has no backward). Reads only metadata and the grad mode: Dynamo traces it."""
    return (
        x.is_cuda
        and not torch.is_grad_enabled()
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.numel() == x.shape[-1]
    )
