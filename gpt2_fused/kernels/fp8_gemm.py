"""What the FP8 half blocks (mlp_fp8.py, attn_fp8.py) share: delayed scales and the scaled GEMM.

Scales are tensorwise and delayed: FP8_MAX / (2^MARGIN amax), amax the largest |value| the same
tensor had at the previous call, so each cast is one pass and values above the old range
saturate. The casting kernels compute the scale and write 1 / scale themselves from amax slots
that Fp8State keeps (fp8_scale.py): no launch of its own per scalar. A tensor's first cast has
no history: a dry pass measures its amax first (Fp8State.cast). Weights are scaled the same
way: they move little from one step to the next, and their cast (act_fp8 "copy") writes the
transposed copy that the backward's GEMMs read in the same pass.
torch._scaled_mm reads its first operand row-major and its second column-major, and FP8 GEMMs
need one e4m3 operand (e5m2 x e5m2 has no kernel): hence the transposed copies, and e5m2 only
for gradients. Fast accumulation (cuBLAS's FP8 accumulator, promoted to fp32 less often) in the
forward's GEMMs, and in the backward's only when the state asks (torchao's tensorwise recipe
keeps it off there too; bench/RESULTS.md#fp8-variants measured both).
"""

import torch

from gpt2_fused.kernels.act_fp8 import act_fp8
from gpt2_fused.kernels.fp8_scale import Delayed

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


class Fp8State:
    """The amax slots of each delayed-scaled tensor of one call site ((len(names), 3) fp32 on
    the device, in names' order: fp8_scale.py), how many times each was cast, and whether the
    backward's GEMMs accumulate fast."""

    def __init__(self, device, names, fast_grads=False):
        self.names = tuple(names)
        self.slots = torch.zeros(len(self.names), 3, device=device)
        self.calls = dict.fromkeys(self.names, 0)
        self.fast_grads = fast_grads

    def on(self, device):
        """self, its slots on `device`: the model that holds it (as a plain attribute, which
        DDP does not broadcast as it would a buffer) may be built on one device and moved to
        another. A state built on the meta device has cast nothing: new zeros there."""
        if self.slots.device != device:
            meta, slots = self.slots.is_meta, self.slots
            self.slots = torch.zeros_like(slots, device=device) if meta else slots.to(device)
        return self

    @property
    def seen(self):
        """The names cast at least once."""
        return {n for n, k in self.calls.items() if k}

    def last_amax(self, name):
        """The amax that `name`'s last cast left, (1,) (what its next scale comes from)."""
        return self.slots[self.names.index(name), self.calls[name] % 3].view(1)

    def cast(self, name, run):
        """(1 / scale, run(delayed)) for `name`, delayed a fp8_scale.Delayed that the casting
        kernel takes. The first time (no amax yet) run goes twice: a dry run measures the amax,
        the second casts with it."""
        i = self.names.index(name)
        for _ in range(2 if self.calls[name] == 0 else 1):
            inv = torch.empty(1, device=self.slots.device)
            out = run(Delayed(self.slots[i], self.calls[name] % 3, inv))
            self.calls[name] += 1
        return inv, out

    def cast_weight(self, name, w):
        """(1 / scale, w8, w8^T) of a weight (N, K): e4m3, delayed scale, one pass."""
        inv, (w8, w8t) = self.cast(name, lambda d: act_fp8("copy", g=w.detach(), delayed=d,
                                                            transposed=True))  # fmt: skip
        return inv, w8, w8t


def scaled_mm(a, b, inv_a, inv_b, out_dtype, bias=None, fast=True):
    """a @ b on FP8 tensor cores, a row-major, b column-major, descaled by inv_a * inv_b; fast:
    cuBLAS's fast accumulation."""
    return torch._scaled_mm(a, b, scale_a=inv_a.view(()), scale_b=inv_b.view(()), bias=bias,
                            out_dtype=out_dtype, use_fast_accum=fast)  # fmt: skip
