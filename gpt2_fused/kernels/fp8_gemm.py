"""What the FP8 half blocks (mlp_fp8.py, attn_fp8.py) share: delayed scales and the scaled GEMM.

Scales are tensorwise and delayed: FP8_MAX / (2^MARGIN amax), amax the largest |value| the same
tensor had at the previous call (Fp8State keeps it; the kernels update it as they cast), so each
cast is one pass and values above the old range saturate. A tensor's first cast has no history:
a dry pass measures its amax first (Fp8State.cast). Weights are scaled the same way: they move
little from one step to the next, and their cast (act_fp8 "copy") writes the transposed copy
that the backward's GEMMs read in the same pass.
torch._scaled_mm reads its first operand row-major and its second column-major, and FP8 GEMMs
need one e4m3 operand (e5m2 x e5m2 has no kernel): hence the transposed copies, and e5m2 only
for gradients. Fast accumulation (cuBLAS's FP8 accumulator, promoted to fp32 less often) in the
forward's GEMMs, and in the backward's only when the state asks (torchao's tensorwise recipe
keeps it off there too; bench/RESULTS.md#fp8-variants measured both).
"""

import torch

from gpt2_fused.kernels.act_fp8 import FP8_MAX, act_fp8

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
MARGIN = 1  # scales leave 2^MARGIN of headroom above the last amax


class Fp8State:
    """The amax of each delayed-scaled tensor of one call site at its last call ((len(names),)
    fp32 on the device, in names' order), the names that have had one, and whether the
    backward's GEMMs accumulate fast."""

    def __init__(self, device, names, fast_grads=False):
        self.names = tuple(names)
        self.amax = torch.zeros(len(self.names), device=device)
        self.seen = set()
        self.fast_grads = fast_grads

    def slot(self, name):
        return self.amax[self.names.index(name)].view(1)

    def cast(self, name, fp8, run):
        """run(scale, amax_slot) with the delayed scale FP8_MAX / (2^MARGIN amax) of `name`,
        after zeroing its slot so that the call leaves its own amax there; (scale, its result).
        The first time (no amax yet) run goes twice: a dry run measures the amax, the second
        casts with it."""
        amax = self.slot(name)
        if name not in self.seen:
            amax.zero_()
            run(torch.ones_like(amax), amax)
            self.seen.add(name)
        scale = FP8_MAX[fp8] / (amax.clamp(min=1e-30) * 2.0**MARGIN)
        amax.zero_()
        return scale, run(scale, amax)

    def cast_weight(self, name, w):
        """(1 / scale, w8, w8^T) of a weight (N, K): e4m3, delayed scale, one pass."""
        s, (w8, w8t) = self.cast(name, E4, lambda scale, amax: act_fp8(
            "copy", scale, amax, g=w.detach(), transposed=True))  # fmt: skip
        return 1 / s, w8, w8t


def scaled_mm(a, b, inv_a, inv_b, out_dtype, bias=None, fast=True):
    """a @ b on FP8 tensor cores, a row-major, b column-major, descaled by inv_a * inv_b; fast:
    cuBLAS's fast accumulation."""
    return torch._scaled_mm(a, b, scale_a=inv_a.view(()), scale_b=inv_b.view(()), bias=bias,
                            out_dtype=out_dtype, use_fast_accum=fast)  # fmt: skip
