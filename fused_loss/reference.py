"""Plain PyTorch linear + cross-entropy: the reference every kernel is tested against.

It materialises the (N, V) logits, so it is slow and memory-hungry, but it is obviously right.
Same signature and semantics as `fused_linear_cross_entropy`.
"""

import torch
import torch.nn.functional as F

from fused_loss.checks import check_inputs


def linear_cross_entropy_reference(
    x, weight, targets, *, ignore_index=-100, reduction="mean", vocab_size=None
):
    """Cross-entropy of softmax(x @ weight[:vocab_size].T) at `targets`.

    x: (..., D) float; weight: (V, D); targets: (...) int64, `ignore_index` marks skipped positions.
    Columns >= vocab_size (the padding of a padded vocabulary) are sliced off, so they never enter
    the softmax and their weight rows get exactly zero gradient. Logits are computed in the
    matmul's dtype (bf16 under autocast), then cross-entropy runs in fp32.
    "mean" averages over non-ignored targets and is 0 (not NaN) when all are ignored.
    """
    vocab_size = check_inputs(x, weight, targets, ignore_index, reduction, vocab_size)
    x2 = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1)
    w = weight[:vocab_size]
    if not torch.is_autocast_enabled(x.device.type) and w.dtype != x2.dtype:
        w = w.to(x2.dtype)  # what autocast would do: compute in the activations' dtype
    logits = F.linear(x2, w).float()
    losses = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return losses.view(targets.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    count = (t != ignore_index).sum().clamp(min=1)  # stays on device: no host sync
    return total / count
