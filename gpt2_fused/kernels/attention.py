"""GPT-2's causal self-attention up to c_proj as one op on CUDA: c_attn, cuDNN's fused attention,
and a backward that lays out and sums the qkv gradient in one pass.

    qkv = x @ W.T + b            x (M, C), M = B T, W (3C, C): qkv (M, 3C) = [q | k | v]
    y = softmax(q k^T / sqrt(hs) + causal mask) v      per head of hs = C / nh: y (B, T, C)
Backward:
    dq, dk, dv = cuDNN's attention backward     each (B, T, C) in memory, as q is in qkv
    dqkv, db = [dq | dk | dv], its column sums  one Triton pass (grad_sums.qkv_grad)
    dx = dqkv @ W,  dW = dqkv.T @ x            cuBLAS; dW leaves the GEMM in W's own dtype
What goes against c_attn = nn.Linear + F.scaled_dot_product_attention under torch.compile
(bench/RESULTS.md#attention): there, the backward of the qkv split is a copy into
[dq | dk | dv] and the bias gradient a second kernel that reads the three again; and autograd
rounds dW to bf16 before the cast to the fp32 parameter's gradient. The math is the same: the
same cuDNN kernels (torch's own pick on Hopper), the same GEMMs; db and dW are summed in fp32
from the same bf16 dqkv.

proj_residual (proj_residual_fast) is the branch's c_proj with the residual add in its cuBLASLt
epilogue, as the MLP's (mlp.py): out = r + y @ W_proj.T + b_proj, one GEMM with C = r; dr = dout.

attention_fast is the entry point: None where it does not apply (no CUDA, no bf16/fp16 compute
dtype, no bias, head sizes cuDNN does not take), and the caller runs the torch path. Whether
cuDNN's attention is there at all (available()) is the caller's to decide once, at
construction, outside torch.compile's region (model.CausalSelfAttention).
attention_reference and proj_residual_reference are the same two ops in plain torch.
"""

import torch
import torch.nn.functional as F

from gpt2_fused.kernels.fast_paths import gpu_runs
from gpt2_fused.kernels.gemm import as_compute, half_compute_dtype, linear_add, mm_as
from gpt2_fused.kernels.grad_sums import qkv_grad


def available():
    """cuDNN's fused attention on a GPU this op runs on (fast_paths.FAST_PATHS: Hopper, the only
    ones it is tested on)."""
    return (
        torch.cuda.is_available()
        and gpu_runs("attention")
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
    )


def _heads(qkv, n_head):
    """q, k, v (B, nh, T, hs): views of qkv (B, T, 3C)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    return [t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2)]


def _forward(x, w_c, b_c, n_head):
    B, T, C = x.shape
    qkv = torch.addmm(b_c, x.reshape(B * T, C), w_c.t()).view(B, T, 3 * C)
    q, k, v = _heads(qkv, n_head)
    out, lse, *_, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False
    )
    # out (B, nh, T, hs) has q's layout, i.e. (B, T, nh, hs) in memory: y is a view of it. The
    # dropout RNG state is kept as cuDNN gives it (unused at dropout 0)
    return out.transpose(1, 2).reshape(B, T, C), qkv, lse, seed, offset


@torch.library.custom_op("gpt2_fused::attention", mutates_args=())
def attention(
    x: torch.Tensor,
    w: torch.Tensor,
    w_c: torch.Tensor,
    b: torch.Tensor,
    b_c: torch.Tensor,
    n_head: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, qkv, lse, philox seed, offset): y (B, T, C) of the module docstring, the rest for the
    backward. x (B, T, C) in the compute dtype; w, b the parameters (only their gradients'
    dtypes are read), w_c, b_c their casts to the compute dtype."""
    return _forward(x, w_c, b_c, n_head)


@attention.register_fake
def _(x, w, w_c, b, b_c, n_head):
    return _forward(x, w_c, b_c, n_head)  # the meta kernels give the outputs' shapes and strides


def _setup_context(ctx, inputs, output):
    x, w, w_c, b, b_c, n_head = inputs
    y, qkv, lse, seed, offset = output
    ctx.n_head, ctx.dtypes = n_head, (w.dtype, b.dtype)
    ctx.save_for_backward(x, w_c, y, qkv, lse, seed, offset)


def _backward(ctx, dy, _dqkv, _dlse, _dseed, _doffset):
    x, w_c, y, qkv, lse, seed, offset = ctx.saved_tensors
    B, T, C = y.shape
    n_head, hs = ctx.n_head, C // ctx.n_head
    q, k, v = _heads(qkv, n_head)
    out = y.view(B, T, n_head, hs).transpose(1, 2)
    dout = dy.contiguous().view(B, T, n_head, hs).transpose(1, 2)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, None, None, T, T, 0.0, True
    )
    flat = [g.transpose(1, 2).reshape(B * T, C) for g in (dq, dk, dv)]  # views: (B, T, C)
    dqkv, db = qkv_grad(*flat)
    dw_dtype, db_dtype = ctx.dtypes
    dx = (dqkv @ w_c).view(B, T, C)
    return dx, mm_as(dqkv.t(), x.reshape(B * T, C), dw_dtype), None, db.to(db_dtype), None, None


attention.register_autograd(_backward, setup_context=_setup_context)


def attention_fast(x, w, b, n_head, weight_casts=(None, None)):
    """y (B, T, C) before c_proj for x (B, T, C) on CUDA, in bf16/fp16 or under such autocast,
    causal, no dropout; None where the op does not apply. weight_casts: w's and b's kept casts, or
    None (gemm.as_compute). Only tensor metadata is read here, so that Dynamo traces it into the
    graph."""
    if not x.is_cuda or b is None or x.dim() != 3:
        return None
    dt = half_compute_dtype(x)
    C = x.shape[-1]
    hs = C // n_head
    if dt is None or C % n_head or hs % 8 or hs > 128:
        return None
    w_c, b_c = (as_compute(t, c, dt) for t, c in zip((w, b), weight_casts, strict=True))
    y, *_ = attention(x.to(dt), w, w_c, b, b_c, n_head)
    return y


@torch.library.custom_op("gpt2_fused::proj_residual", mutates_args=())
def proj_residual(
    y: torch.Tensor,
    w: torch.Tensor,
    w_c: torch.Tensor,
    b: torch.Tensor,
    b_c: torch.Tensor,
    residual: torch.Tensor,
) -> torch.Tensor:
    """residual + y @ w_c.T + b_c (gemm.linear_add): y (M, C) and residual (M, C) contiguous in
    the compute dtype, w_c (C, C) and b_c the casts of the parameters w, b (only their dtypes
    are read)."""
    return linear_add(y, w_c, b_c, residual)


@proj_residual.register_fake
def _(y, w, w_c, b, b_c, residual):
    return torch.empty_like(residual)


def _proj_setup(ctx, inputs, output):
    y, w, w_c, b, b_c, residual = inputs
    ctx.dtypes = w.dtype, b.dtype
    ctx.save_for_backward(y, w_c)


def _proj_backward(ctx, dout):
    y, w_c = ctx.saved_tensors
    dw_dtype, db_dtype = ctx.dtypes
    db = dout.sum(0, dtype=torch.float32).to(db_dtype)
    return dout @ w_c, mm_as(dout.t(), y, dw_dtype), None, db, None, dout


proj_residual.register_autograd(_proj_backward, setup_context=_proj_setup)


def proj_residual_fast(y, w, b, residual, weight_casts=(None, None)):
    """residual + c_proj(y) for y, residual (B, T, C) on CUDA in bf16/fp16 (or under such
    autocast), residual in the compute dtype; None where the op does not apply (the caller adds
    residual + F.linear(y, w, b)); weight_casts as attention_fast's. Only tensor metadata is read
    here (Dynamo traces it)."""
    if not y.is_cuda or b is None:
        return None
    dt = half_compute_dtype(y)
    if dt is None or residual.dtype != dt or y.shape[-1] % 8:
        return None
    if residual.shape != y.shape or not residual.is_contiguous():
        return None
    C = y.shape[-1]
    w_c, b_c = (as_compute(t, c, dt) for t, c in zip((w, b), weight_casts, strict=True))
    out = proj_residual(y.to(dt).reshape(-1, C), w, w_c, b, b_c, residual.view(-1, C))
    return out.view(residual.shape)


def attention_reference(x, w, b, n_head):
    """attention_fast in plain torch (nanoGPT's path): c_attn as F.linear, the split into heads,
    causal F.scaled_dot_product_attention, the heads merged: y (B, T, C)."""
    B, T, C = x.shape
    q, k, v = F.linear(x, w, b).split(C, dim=2)
    q, k, v = [t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v)]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, C)


def proj_residual_reference(y, w, b, residual):
    """proj_residual_fast in plain torch: residual + F.linear(y, w, b)."""
    return residual + F.linear(y, w, b)
