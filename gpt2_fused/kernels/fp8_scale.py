"""Delayed tensorwise FP8 scales computed inside the kernel that casts: no launches of
their own, so an FP8 half block costs the host a handful of launches, not one per scalar.

A tensor's scale comes from the largest |value| it had at the previous call (its amax), with
2^MARGIN of headroom:  scale = FP8_MAX / (2^MARGIN amax_prev);  q = saturate(value * scale).
Gradients (e5m2) get more headroom than activations and weights (e4m3): their amax can jump
several-fold from one step to the next early in training, and e5m2's range (about 2^32 from
its largest value to its smallest subnormal) makes headroom nearly free; e4m3 has 2^18.
Each call site keeps three amax slots per tensor (Fp8State, fp8_gemm.py) and call k uses them
in turn, so that no slot is read and written by the same launch:

    slot k % 3        amax_prev: read by every program (written by call k - 1, finished)
    slot (k + 1) % 3  this call's amax: every program's atomic max (zeroed by call k - 1)
    slot (k + 2) % 3  zeroed by program 0 for call k + 1 (call k - 1 read it as its amax_prev)

Program 0 also writes 1 / scale, the descale torch._scaled_mm takes, into a fresh (1,) tensor.

A delayed scale cannot see a tensor outgrow its last amax; the values above the range then
saturate. A second launch that cast such a tensor again with its own amax changed no loss
measured and cost about 1 % of a 124M step, so there is none (bench/RESULTS.md#fp8-fused-on-main).
fp8_scale_reference is the same arithmetic in torch.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MARGIN = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 4}  # 2^MARGIN above the last amax
HEADROOM_E4M3 = tl.constexpr(2.0 ** MARGIN[torch.float8_e4m3fn])
HEADROOM_E5M2 = tl.constexpr(2.0 ** MARGIN[torch.float8_e5m2])


class Delayed(NamedTuple):
    """What a casting kernel needs for a delayed scale: the tensor's three amax slots ((3,) fp32
    on the device), the call's index mod 3, and the (1,) fp32 tensor that receives 1 / scale."""

    slots: torch.Tensor
    k3: int
    inv: torch.Tensor


@triton.jit
def scale_and_amax(scale_ptr, amax_ptr, slots_ptr, k3, inv_ptr, FIRST,
                   FP8_MAX: tl.constexpr, DELAYED: tl.constexpr):  # fmt: skip
    """(scale, pointer for this call's atomic amax). DELAYED: from the slots (module docstring),
    FIRST (program 0) writing 1 / scale and zeroing the slot after next; else the scale at
    scale_ptr and amax at amax_ptr, as given."""
    if DELAYED:
        prev = tl.load(slots_ptr + k3)
        if FP8_MAX > 448.0:  # e5m2
            scale = FP8_MAX / (tl.maximum(prev, 1e-30) * HEADROOM_E5M2)
        else:
            scale = FP8_MAX / (tl.maximum(prev, 1e-30) * HEADROOM_E4M3)
        if FIRST:
            tl.store(inv_ptr, 1.0 / scale)
            tl.store(slots_ptr + (k3 + 2) % 3, 0.0)
        return scale, slots_ptr + (k3 + 1) % 3
    else:
        return tl.load(scale_ptr), amax_ptr


def fp8_scale_reference(amax_prev, fp8):
    """The delayed scale of a tensor whose last amax was amax_prev, in torch."""
    return FP8_MAX[fp8] / (amax_prev.float().clamp(min=1e-30) * 2.0 ** MARGIN[fp8])
