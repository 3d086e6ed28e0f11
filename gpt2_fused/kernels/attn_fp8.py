"""The first half of a GPT-2 block, out = x + c_proj(attention(c_attn(LN_1(x)))), with c_attn and
c_proj on FP8 tensor cores, each FP8 operand cast where it is made; the attention
itself in bf16 (cuDNN's on CUDA, as gpt2_fused/kernels/attention.py; torch's math elsewhere):

    y8       = e4m3(LN(x) * s_y)                ln_fp8, with its amax
    qkv      = y8 W_attn8^T / (s_y s_attn) + b_attn       (M, 3C) bf16, torch._scaled_mm
    o        = causal attention of q, k, v                  (M, C) bf16
    o8, o8T  = e4m3(o * s_o)                    act_fp8 "copy": one pass over o
    out      = x + o8 W_proj8^T / (s_o s_proj) + b_proj
Backward, from dout:
    d8, d8T, db_proj = e5m2(dout * s_d), ..., sum_rows(dout)            act_fp8 "copy"
    dW_proj = d8T o8T^T,  do = d8 W_proj8
    dq, dk, dv = the attention's backward of do
    dqkv, db_attn = [dq | dk | dv], its column sums                     grad_sums.qkv_grad
    q8, q8T = e5m2(dqkv * s_q)                                          act_fp8 "copy"
    dW_attn = q8T y8T^T,  dy = q8 W_attn8,  dx = dout + LayerNorm's backward of dy
Scales: tensorwise and delayed (fp8_gemm.py), the weights' too: their cast writes W8 and W8^T.
attn_fp8_reference is the same half block in fp32 torch.
"""

import torch
import torch.nn.functional as F

from gpt2_fused.kernels.act_fp8 import act_fp8, transpose_fp8
from gpt2_fused.kernels.fp8_gemm import E5, Fp8State
from gpt2_fused.kernels.fp8_gemm import scaled_mm as _mm
from gpt2_fused.kernels.grad_sums import qkv_grad
from gpt2_fused.kernels.ln_fp8 import ln_backward, ln_fp8

# the delayed-scaled tensors: LN output, attention out, dout, dqkv, and the two weights
NAMES = ("y", "o", "d", "q", "w_attn", "w_proj")


def _split_heads(qkv, n_head):
    """q, k, v (B, nh, T, hs), views of qkv (B, T, 3C)."""
    B, T, C3 = qkv.shape
    return [t.view(B, T, n_head, C3 // 3 // n_head).transpose(1, 2) for t in qkv.chunk(3, dim=2)]


def _attend(qkv, n_head):
    """(o (B, T, C) bf16, what _attend_backward needs) for qkv (B, T, 3C)."""
    B, T, C3 = qkv.shape
    q, k, v = _split_heads(qkv, n_head)
    if qkv.is_cuda:
        out, lse, *_, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False
        )
        saved = (out, lse, seed, offset)
    else:  # torch's math attention; the backward recomputes it
        out, saved = F.scaled_dot_product_attention(q, k, v, is_causal=True), None
    return out.transpose(1, 2).reshape(B, T, C3 // 3), saved


def _attend_backward(do, qkv, n_head, saved):
    """dq, dk, dv as (M, C) views, for do (B, T, C), the gradient of _attend's o."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = _split_heads(qkv, n_head)
    dout = do.contiguous().view(B, T, n_head, C // n_head).transpose(1, 2)
    if saved is not None:
        out, lse, seed, offset = saved
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, None, None, T, T, 0.0, True
        )
    else:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        grads = torch.autograd.grad(out, leaves, dout)
    return [g.transpose(1, 2).reshape(B * T, C) for g in grads]


class AttnFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w_attn, b_attn, w_proj, b_proj, n_head, state, eps):
        B, T, C = x.shape
        x2, dt = x.reshape(B * T, C), torch.bfloat16
        inv_y, (_, y8, _, mean, rstd) = state.cast("y", lambda dl: ln_fp8(
            x2, ln_w, ln_b, eps, delayed=dl, store_y=False))  # fmt: skip
        inv_attn, w_attn8, w_attn8t = state.cast_weight("w_attn", w_attn)
        inv_proj, w_proj8, w_proj8t = state.cast_weight("w_proj", w_proj)
        qkv = _mm(y8, w_attn8.t(), inv_y, inv_attn, dt, b_attn.to(dt)).view(B, T, 3 * C)
        o, saved = _attend(qkv, n_head)
        o2 = o.reshape(B * T, C).contiguous()
        inv_o, (o8, o8t) = state.cast(
            "o", lambda dl: act_fp8("copy", delayed=dl, g=o2, transposed=True)
        )
        out = x2 + _mm(o8, w_proj8.t(), inv_o, inv_proj, dt, b_proj.to(dt))  # x's dtype
        ctx.save_for_backward(x2, mean, rstd, ln_w, y8, qkv, o8t, w_attn8t, w_proj8t, inv_attn,
                              inv_proj, inv_y, inv_o)  # fmt: skip
        ctx.saved_attention, ctx.n_head, ctx.state = saved, n_head, state
        ctx.dtypes = x.dtype, w_attn.dtype, w_proj.dtype
        ctx.has_ln_b = ln_b is not None
        return out.view(B, T, C)

    @staticmethod
    def backward(ctx, dout):
        x2, mean, rstd, ln_w, y8, qkv, o8t, w_attn8t, w_proj8t, inv_attn, inv_proj, inv_y, inv_o = (
            ctx.saved_tensors
        )
        state, dt, (B, T, C3) = ctx.state, torch.bfloat16, qkv.shape
        fast = state.fast_grads
        x_dtype, dw_attn_dtype, dw_proj_dtype = ctx.dtypes
        d = dout.reshape(B * T, C3 // 3).to(dt).contiguous()
        inv_d, (d8, d8t, db_proj) = state.cast(
            "d", lambda dl: act_fp8("copy", delayed=dl, g=d, fp8=E5, transposed=True, sums=True)
        )
        dw_proj = _mm(d8t, o8t.t(), inv_d, inv_o, torch.float32, fast=fast)
        do = _mm(d8, w_proj8t.t(), inv_d, inv_proj, dt, fast=fast)
        dq, dk, dv = _attend_backward(do.view(B, T, -1), qkv, ctx.n_head, ctx.saved_attention)
        dqkv, db_attn = qkv_grad(dq, dk, dv)
        inv_q, (q8, q8t) = state.cast(
            "q", lambda dl: act_fp8("copy", delayed=dl, g=dqkv, fp8=E5, transposed=True)
        )
        dw_attn = _mm(q8t, transpose_fp8(y8).t(), inv_q, inv_y, torch.float32, fast=fast)
        dy = _mm(q8, w_attn8t.t(), inv_q, inv_attn, dt, fast=fast)
        dx, dln_w, dln_b = ln_backward(dy, x2, mean, rstd, ln_w, residual=d, out_dtype=x_dtype)
        dx = dx.view(B, T, C3 // 3)
        return (dx, dln_w, dln_b if ctx.has_ln_b else None, dw_attn.to(dw_attn_dtype),
                db_attn.to(dw_attn_dtype), dw_proj.to(dw_proj_dtype), db_proj.to(dw_proj_dtype),
                None, None, None)  # fmt: skip


def attn_fp8(x, ln, w_attn, b_attn, w_proj, b_proj, n_head, state):
    """x + c_proj(attention(c_attn(LayerNorm(x)))) with FP8 GEMMs (module docstring): x (B, T,
    C); ln the LayerNorm module; state an Fp8State of NAMES (attn_state), one per call site."""
    return AttnFp8.apply(x, ln.weight, ln.bias, w_attn, b_attn, w_proj, b_proj, n_head, state,
                         ln.eps)  # fmt: skip


def attn_state(device, fast_grads=False):
    """A new Fp8State for one attn_fp8 call site."""
    return Fp8State(device, NAMES, fast_grads)


def attn_fp8_reference(x, ln, w_attn, b_attn, w_proj, b_proj, n_head):
    """The same half block in fp32 torch."""
    B, T, C = x.shape
    y = F.layer_norm(x.float(), (C,), ln.weight.float(),
                     None if ln.bias is None else ln.bias.float(), ln.eps)  # fmt: skip
    qkv = F.linear(y, w_attn.float(), b_attn.float())
    q, k, v = _split_heads(qkv, n_head)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    return x.float() + F.linear(o, w_proj.float(), b_proj.float())
