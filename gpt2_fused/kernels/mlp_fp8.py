"""The second half of a GPT-2 block, out = x + MLP(LN_2(x)), with the MLP's four GEMMs on FP8
tensor cores and every FP8 operand cast where its data is made (issue 56):

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
    dx = dout + LayerNorm's backward of dy             (torch, from mean and rstd)

Scales are tensorwise. The activations' and gradients' (s_y, s_a, s_d, s_h) are delayed: each is
FP8_MAX / (2^MARGIN amax), amax the largest |value| the same tensor had at the previous call
(Fp8State keeps it; the kernels update it as they cast), so each cast is one pass; values above
the old range saturate. A tensor's first cast has no history: a dry pass measures its amax
first (Fp8State.cast). The weights' (s_fc, s_proj) are just-in-time: a weight is small
next to the activations, cast once a call.
torch._scaled_mm reads its first operand row-major and its second column-major, and FP8 GEMMs
need one e4m3 operand (e5m2 x e5m2 has no kernel): hence the transposed copies, and e5m2 only
for gradients.
mlp_fp8_reference is the same half block in fp32 torch.
"""

import torch
import torch.nn.functional as F

from gpt2_fused.kernels.act_fp8 import FP8_MAX, act_fp8
from gpt2_fused.kernels.ln_fp8 import ln_fp8

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
MARGIN = 1  # scales leave 2^MARGIN of headroom above the last amax
NAMES = ("y", "a", "d", "h")  # LN output, GELU output, dout, dh


class Fp8State:
    """The amax of each delayed-scaled tensor at the last call ((4,) fp32 on the device, in
    NAMES' order) and the names that have had one."""

    def __init__(self, device):
        self.amax = torch.zeros(len(NAMES), device=device)
        self.seen = set()

    def slot(self, name):
        return self.amax[NAMES.index(name)].view(1)

    def cast(self, name, fp8, run):
        """run(scale, amax_slot) with the delayed scale FP8_MAX / (2^MARGIN amax) of `name`,
        after zeroing its slot so that the call leaves its own amax there; its result. The first
        time (no amax yet) run goes twice: a dry run measures the amax, the second casts with it."""
        amax = self.slot(name)
        if name not in self.seen:
            amax.zero_()
            run(torch.ones_like(amax), amax)
            self.seen.add(name)
        scale = FP8_MAX[fp8] / (amax.clamp(min=1e-30) * 2.0**MARGIN)
        amax.zero_()
        return scale, run(scale, amax)


def cast_weight(w, fp8=E4):
    """(w8, 1 / scale) of a weight, tensorwise just in time."""
    s = FP8_MAX[fp8] / w.detach().abs().amax().float().clamp(min=1e-12)
    return (w.detach().float() * s).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8), (1 / s).view(())


def _mm(a, b, inv_a, inv_b, out_dtype, bias=None):
    """a @ b on FP8 tensor cores, a row-major, b column-major, descaled by inv_a * inv_b."""
    return torch._scaled_mm(a, b, scale_a=inv_a.view(()), scale_b=inv_b.view(()), bias=bias,
                            out_dtype=out_dtype)  # fmt: skip


class MlpFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w_fc, b_fc, w_proj, b_proj, state, eps):
        shape, D = x.shape, x.shape[-1]
        x2 = x.reshape(-1, D)
        s_y, (_, y8, _, mean, rstd) = state.cast("y", E4, lambda scale, amax: ln_fp8(
            x2, ln_w, ln_b, eps, scale=scale, amax=amax, store_y=False))  # fmt: skip
        w_fc8, inv_fc = cast_weight(w_fc)
        w_proj8, inv_proj = cast_weight(w_proj)
        dt = torch.bfloat16
        h = _mm(y8, w_fc8.t(), 1 / s_y, inv_fc, dt, b_fc.to(dt))
        s_a, (a8, a8t) = state.cast("a", E4, lambda scale, amax: act_fp8(
            "gelu", scale, amax, h=h, transposed=True))  # fmt: skip
        out = _mm(a8, w_proj8.t(), 1 / s_a, inv_proj, dt, b_proj.to(dt))
        out = x2.to(dt) + out
        ctx.save_for_backward(x2, mean, rstd, ln_w, y8, h, a8t, w_fc8, w_proj8, inv_fc, inv_proj,
                              s_y, s_a)  # fmt: skip
        ctx.state, ctx.shape, ctx.dtypes = state, shape, (x.dtype, w_fc.dtype, w_proj.dtype)
        ctx.has_ln_b = ln_b is not None
        return out.view(shape).to(x.dtype)

    @staticmethod
    def backward(ctx, dout):
        x2, mean, rstd, ln_w, y8, h, a8t, w_fc8, w_proj8, inv_fc, inv_proj, s_y, s_a = (
            ctx.saved_tensors
        )
        state, dt = ctx.state, torch.bfloat16
        x_dtype, dw_fc_dtype, dw_proj_dtype = ctx.dtypes
        d = dout.reshape(-1, x2.shape[1]).to(dt).contiguous()
        s_d, (d8, d8t, db_proj) = state.cast("d", E5, lambda scale, amax: act_fp8(
            "copy", scale, amax, g=d, fp8=E5, transposed=True, sums=True))  # fmt: skip
        dw_proj = _mm(d8t, a8t.t(), 1 / s_d, 1 / s_a, torch.float32)
        da = _mm(d8, w_proj8.t().contiguous().t(), 1 / s_d, inv_proj, dt)
        s_h, (dh8, dh8t, db_fc) = state.cast("h", E5, lambda scale, amax: act_fp8(
            "dgelu", scale, amax, h=h, g=da, fp8=E5, transposed=True, sums=True))  # fmt: skip
        y8t = y8.t().contiguous()
        dw_fc = _mm(dh8t, y8t.t(), 1 / s_h, 1 / s_y, torch.float32)
        dy = _mm(dh8, w_fc8.t().contiguous().t(), 1 / s_h, inv_fc, torch.float32)
        dx, dln_w, dln_b = _layer_norm_backward(dy, x2, mean, rstd, ln_w)
        dx = (d.float() + dx).to(x_dtype).view(ctx.shape)
        return (dx, dln_w, dln_b if ctx.has_ln_b else None, dw_fc.to(dw_fc_dtype),
                db_fc.to(dw_fc_dtype), dw_proj.to(dw_proj_dtype), db_proj.to(dw_proj_dtype), None,
                None)  # fmt: skip


def _layer_norm_backward(dy, x, mean, rstd, w):
    """(dx, dw, db) of y = (x - mean) rstd w + b for dy, all (M, D) fp32 math."""
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    g = dy * w.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, (dy * xhat).sum(0).to(w.dtype), dy.sum(0).to(w.dtype)


def mlp_fp8(x, ln, w_fc, b_fc, w_proj, b_proj, state):
    """x + MLP(LayerNorm(x)) with FP8 GEMMs (module docstring). x (..., D); ln the LayerNorm
    module (its weight, bias, eps); state an Fp8State, one per call site."""
    return MlpFp8.apply(x, ln.weight, ln.bias, w_fc, b_fc, w_proj, b_proj, state, ln.eps)


def mlp_fp8_reference(x, ln, w_fc, b_fc, w_proj, b_proj):
    """The same half block in fp32 torch."""
    y = F.layer_norm(x.float(), (x.shape[-1],), ln.weight.float(),
                     None if ln.bias is None else ln.bias.float(), ln.eps)  # fmt: skip
    a = F.gelu(F.linear(y, w_fc.float(), b_fc.float()), approximate="tanh")
    return x.float() + F.linear(a, w_proj.float(), b_proj.float())
