"""Plain PyTorch linear + cross-entropy: the reference every kernel is tested against.

It materialises the (N, V) logits, so it is slow and memory-hungry, but it is obviously right.
Same signature and semantics as `fused_linear_cross_entropy`.
"""

import torch
import torch.nn.functional as F

from fused_loss.checks import check_inputs


def linear_cross_entropy_reference(
    x,
    weight,
    targets,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    vocab_size=None,
    softcap=None,
    z_loss=0.0,
    label_smoothing=0.0,
    return_lse=False,
):
    """Cross-entropy of softmax(u) at `targets`, u = x @ weight[:vocab_size].T + bias, capped.

    x: (..., D) float; weight: (V, D); bias: (V,) or None; targets: (...) int64, `ignore_index`
    marks skipped positions. Columns >= vocab_size (the padding of a padded vocabulary) are sliced
    off, so they never enter the softmax and their weight rows and bias entries get exactly zero
    gradient. Logits are computed in the matmul's dtype (bf16 under autocast), then:
        softcap:          u = softcap * tanh(u / softcap)
        loss per token:   (1 - e) (lse - u_y) + e (lse - mean_v u_v) + z_loss * lse^2,
                          e = label_smoothing, lse = log sum_v exp(u_v) (F.cross_entropy's
                          label smoothing, over the real columns); 0 for ignored targets
    "mean" averages over non-ignored targets and is 0 (not NaN) when all are ignored.
    return_lse=True returns (loss, lse), lse (...) fp32 per token, also for ignored ones; it
    carries no gradient.
    """
    vocab_size = check_inputs(
        x, weight, targets, ignore_index, reduction, vocab_size, bias, softcap, z_loss,
        label_smoothing,
    )  # fmt: skip
    x2 = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1)
    w = weight[:vocab_size]
    b = None if bias is None else bias[:vocab_size]
    if not torch.is_autocast_enabled(x.device.type) and w.dtype != x2.dtype:
        w = w.to(x2.dtype)  # what autocast would do: compute in the activations' dtype
    if b is not None and not torch.is_autocast_enabled(x.device.type):
        b = b.to(x2.dtype)
    logits = F.linear(x2, w, b).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    losses = F.cross_entropy(
        logits, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    lse = torch.logsumexp(logits, dim=-1)
    if z_loss:
        losses = losses + torch.where(t != ignore_index, z_loss * lse.square(), 0.0)
    if reduction == "none":
        loss = losses.view(targets.shape)
    elif reduction == "sum":
        loss = losses.sum()
    else:
        loss = losses.sum() / (t != ignore_index).sum().clamp(min=1)  # on device: no host sync
    return (loss, lse.detach().view(targets.shape)) if return_lse else loss
