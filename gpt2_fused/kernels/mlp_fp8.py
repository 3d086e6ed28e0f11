"""The second half of a GPT-2 block, out = x + MLP(LN_2(x)), with the MLP's four GEMMs on FP8
tensor cores and every FP8 operand cast where its data is made:

    y8      = e4m3(LN(x) * s_y)           ln_fp8: the LayerNorm writes it, and its amax
    h       = y8 W_fc8^T / (s_y s_fc) + b_fc           torch._scaled_mm, bf16 out
    a8, a8T = e4m3(gelu(h) * s_a)         act_fp8 "gelu": one pass over h
    out     = x + a8 W_proj8^T / (s_a s_proj) + b_proj
Backward, from dout (= d out / d x's residual share as well):
    d8, d8T = e5m2(dout * s_d)            act_fp8 "copy"
    dW_proj = d8T a8T^T,  da = d8 W_proj8             (dW in fp32: the master weights')
    dh8, dh8T = e5m2(da * gelu'(h) * s_h) act_fp8 "dgelu": one pass over da and h
    dW_fc = dh8T y8T^T,  dy = dh8 W_fc8,  db_fc = sum_rows(dh), db_proj = sum_rows(dout)
                                          (the bias sums from the casts' own passes, unrounded)
    dx = dout + LayerNorm's backward of dy             (ln_backward, one pass)

Scales: tensorwise and delayed (fp8_gemm.py), the weights' too: their cast writes W8 and W8^T.
mlp_fp8_reference is the same half block in fp32 torch.
"""

import torch
import torch.nn.functional as F

from gpt2_fused.kernels.act_fp8 import act_fp8, transpose_fp8
from gpt2_fused.kernels.fp8_gemm import E5, Fp8State
from gpt2_fused.kernels.fp8_gemm import scaled_mm as _mm
from gpt2_fused.kernels.ln_fp8 import ln_backward, ln_fp8

# the delayed-scaled tensors: LN output, GELU output, dout, dh, and the two weights
NAMES = ("y", "a", "d", "h", "w_fc", "w_proj")


class MlpFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w_fc, b_fc, w_proj, b_proj, state, eps):
        shape, D = x.shape, x.shape[-1]
        x2 = x.reshape(-1, D)
        inv_y, (_, y8, _, mean, rstd) = state.cast("y", lambda dl: ln_fp8(
            x2, ln_w, ln_b, eps, delayed=dl, store_y=False))  # fmt: skip
        inv_fc, w_fc8, w_fc8t = state.cast_weight("w_fc", w_fc)
        inv_proj, w_proj8, w_proj8t = state.cast_weight("w_proj", w_proj)
        dt = torch.bfloat16
        h = _mm(y8, w_fc8.t(), inv_y, inv_fc, dt, b_fc.to(dt))
        inv_a, (a8, a8t) = state.cast(
            "a", lambda dl: act_fp8("gelu", delayed=dl, h=h, transposed=True)
        )
        out = x2 + _mm(a8, w_proj8.t(), inv_a, inv_proj, dt, b_proj.to(dt))  # x's dtype
        ctx.save_for_backward(x2, mean, rstd, ln_w, y8, h, a8t, w_fc8t, w_proj8t, inv_fc,
                              inv_proj, inv_y, inv_a)  # fmt: skip
        ctx.state, ctx.shape, ctx.dtypes = state, shape, (x.dtype, w_fc.dtype, w_proj.dtype)
        ctx.has_ln_b = ln_b is not None
        return out.view(shape)

    @staticmethod
    def backward(ctx, dout):
        x2, mean, rstd, ln_w, y8, h, a8t, w_fc8t, w_proj8t, inv_fc, inv_proj, inv_y, inv_a = (
            ctx.saved_tensors
        )
        state, dt, fast = ctx.state, torch.bfloat16, ctx.state.fast_grads
        x_dtype, dw_fc_dtype, dw_proj_dtype = ctx.dtypes
        d = dout.reshape(-1, x2.shape[1]).to(dt).contiguous()
        inv_d, (d8, d8t, db_proj) = state.cast(
            "d", lambda dl: act_fp8("copy", delayed=dl, g=d, fp8=E5, transposed=True, sums=True)
        )
        dw_proj = _mm(d8t, a8t.t(), inv_d, inv_a, torch.float32, fast=fast)
        da = _mm(d8, w_proj8t.t(), inv_d, inv_proj, dt, fast=fast)
        inv_h, (dh8, dh8t, db_fc) = state.cast(
            "h",
            lambda dl: act_fp8("dgelu", delayed=dl, h=h, g=da, fp8=E5, transposed=True, sums=True),
        )
        dw_fc = _mm(dh8t, transpose_fp8(y8).t(), inv_h, inv_y, torch.float32, fast=fast)
        dy = _mm(dh8, w_fc8t.t(), inv_h, inv_fc, dt, fast=fast)
        dx, dln_w, dln_b = ln_backward(dy, x2, mean, rstd, ln_w, residual=d, out_dtype=x_dtype)
        return (dx.view(ctx.shape), dln_w, dln_b if ctx.has_ln_b else None,
                dw_fc.to(dw_fc_dtype), db_fc.to(dw_fc_dtype), dw_proj.to(dw_proj_dtype),
                db_proj.to(dw_proj_dtype), None, None)  # fmt: skip


def mlp_fp8(x, ln, w_fc, b_fc, w_proj, b_proj, state):
    """x + MLP(LayerNorm(x)) with FP8 GEMMs (module docstring). x (..., D); ln the LayerNorm
    module (its weight, bias, eps); state an Fp8State of NAMES (mlp_state), one per call site."""
    return MlpFp8.apply(x, ln.weight, ln.bias, w_fc, b_fc, w_proj, b_proj, state, ln.eps)


def mlp_state(device, fast_grads=False):
    """A new Fp8State for one mlp_fp8 call site."""
    return Fp8State(device, NAMES, fast_grads)


def mlp_fp8_reference(x, ln, w_fc, b_fc, w_proj, b_proj):
    """The same half block in fp32 torch."""
    y = F.layer_norm(x.float(), (x.shape[-1],), ln.weight.float(),
                     None if ln.bias is None else ln.bias.float(), ln.eps)  # fmt: skip
    a = F.gelu(F.linear(y, w_fc.float(), b_fc.float()), approximate="tanh")
    return x.float() + F.linear(a, w_proj.float(), b_proj.float())
