"""A decoding step's linear layers at batch 1: one row times the weight, read once.

    y (N,) = act(W (N, K) @ x (K,) + b (N,))      W, x, b bf16 or fp16; y that dtype or fp32
    act: identity, or GPT-2's tanh GELU: y * sigmoid(2 sqrt(2/pi) (y + 0.044715 y^3))

At batch 1 a step is bound by reading the weights once (124M: 0.25 GB, 1558M: 3.1 GB in bf16),
and cuBLAS's kernels for a one-row matmul read the blocks' weights at 0.5-2.5 TB/s on an H200,
well below the ~4.8 TB/s of its memory; this kernel is 1.2-2.3x faster there (bench/RESULTS.md
§3; the classifier's 50304 rows stay with cuBLAS, which is faster at that size). Each program
reads BLOCK_N whole rows of W in BLOCK_K-wide 16-byte loads, multiplies them by x in fp32 into
a (BLOCK_N, BLOCK_K) accumulator and reduces it once at the end; BLOCK_N is chosen so that
there are at least two programs per SM. The bias and the GELU act on the fp32 sum, which is
rounded once (cuBLAS rounds before its GELU epilogue: the same to a bf16 rounding).

linear() is what model.py calls: the GEMV where it applies (CUDA, one row, no autograd, x and W
in one 16-bit dtype; inside a compiled decoding step too, as an opaque custom op), else
F.linear and F.gelu. gemv() runs the kernel on any device (the Triton interpreter on CPU, for
tests); gemv_reference() is the same math in torch.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fused_loss.triton_kernels import _cast

BLOCK_K = 512  # elements of a row per load step: 1 KB of bf16
NUM_WARPS = 4


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K  # W is (N, K), contiguous
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if GELU:  # 0.5 (1 + tanh(u)) = sigmoid(2 u)
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    tl.store(y_ptr + rows, _cast(y, y_ptr.dtype.element_ty, INTERPRETED), mask=row_ok)


def _block_n(n, device):
    """Rows per program: the largest power of two in [2, 16] that leaves >= 2 programs per SM."""
    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
    block = 16
    while block > 2 and triton.cdiv(n, block) < 2 * sms:
        block //= 2
    return block


def gemv(x, w, b=None, gelu=False, out_dtype=None):
    """act(x @ w.T + b) for x (..., K) holding one row; w (N, K) contiguous, b (N,) or None, in
    x's dtype; returns (..., N) in out_dtype (default x's)."""
    n, k = w.shape
    if x.numel() != k or not w.is_contiguous() or x.dtype != w.dtype:
        raise ValueError(f"gemv: one row of {k} in w's dtype {w.dtype} and a contiguous w needed")
    y = _gemv_op(x.reshape(k), w, b, gelu, out_dtype or x.dtype)
    return y.view(*x.shape[:-1], n)


# An opaque op to torch.compile: a compiled decoding step keeps the kernel (Inductor would use
# cuBLAS for the matmul) and fuses the LayerNorms and residual adds around it.
@torch.library.custom_op("fused_loss::gemv", mutates_args=())
def _gemv_op(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gelu: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    n, k = w.shape
    y = torch.empty(n, dtype=out_dtype, device=x.device)
    block_n = _block_n(n, x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x.contiguous(),
        w,
        w if b is None else b,  # a placeholder pointer when there is no bias
        y,
        n,
        k,
        HAS_BIAS=b is not None,
        GELU=gelu,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        INTERPRETED=x.device.type != "cuda",
        num_warps=NUM_WARPS,
    )
    return y


@_gemv_op.register_fake
def _(x, w, b, gelu, out_dtype):
    return x.new_empty(w.shape[0], dtype=out_dtype)


def gemv_reference(x, w, b=None, gelu=False, out_dtype=None):
    """The same in torch: F.linear (then GPT-2's tanh GELU), in out_dtype if given."""
    y = F.linear(x, w, b)
    y = F.gelu(y, approximate="tanh") if gelu else y
    return y if out_dtype is None else y.to(out_dtype)


def applies(x, w):
    """Whether linear() takes the GEMV: one row on CUDA in w's 16-bit dtype, no autograd (the
    kernel has no backward). Reads only metadata and the grad mode: Dynamo traces it."""
    return (
        x.is_cuda
        and not torch.is_grad_enabled()
        and x.dtype == w.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.numel() == x.shape[-1]
    )


def linear(x, w, b=None, gelu=False):
    """F.linear(x, w, b) (then the tanh GELU), through the GEMV where it applies."""
    if applies(x, w):
        return gemv(x, w, b, gelu)
    return gemv_reference(x, w, b, gelu)
