"""What the FP8 half blocks (mlp_fp8.py, attn_fp8.py) share: delayed scales, the weights'
casts, the scaled GEMM and LayerNorm's backward.

Scales are tensorwise. An activation's or gradient's is delayed: FP8_MAX / (2^MARGIN amax), amax
the largest |value| the same tensor had at the previous call (Fp8State keeps it; the kernels
update it as they cast), so each cast is one pass and values above the old range saturate. A
tensor's first cast has no history: a dry pass measures its amax first (Fp8State.cast). A
weight's scale is just in time: a weight is small next to the activations, cast once a call.
torch._scaled_mm reads its first operand row-major and its second column-major, and FP8 GEMMs
need one e4m3 operand (e5m2 x e5m2 has no kernel): hence the transposed copies, and e5m2 only
for gradients.
"""

import torch

from gpt2_fused.kernels.act_fp8 import FP8_MAX

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
MARGIN = 1  # scales leave 2^MARGIN of headroom above the last amax


class Fp8State:
    """The amax of each delayed-scaled tensor of one call site at its last call ((len(names),)
    fp32 on the device, in names' order) and the names that have had one."""

    def __init__(self, device, names):
        self.names = tuple(names)
        self.amax = torch.zeros(len(self.names), device=device)
        self.seen = set()

    def slot(self, name):
        return self.amax[self.names.index(name)].view(1)

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


def scaled_mm(a, b, inv_a, inv_b, out_dtype, bias=None):
    """a @ b on FP8 tensor cores, a row-major, b column-major, descaled by inv_a * inv_b."""
    return torch._scaled_mm(a, b, scale_a=inv_a.view(()), scale_b=inv_b.view(()), bias=bias,
                            out_dtype=out_dtype)  # fmt: skip


def layer_norm_backward(dy, x, mean, rstd, w):
    """(dx, dw, db) of y = (x - mean) rstd w + b for dy, all (M, D) fp32 math."""
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    g = dy * w.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, (dy * xhat).sum(0).to(w.dtype), dy.sum(0).to(w.dtype)
