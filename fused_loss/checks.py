"""Input validation shared by the fused kernel and the torch reference."""

import math

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_inputs(
    x,
    weight,
    targets,
    ignore_index,
    reduction,
    vocab_size,
    bias=None,
    softcap=None,
    z_loss=0.0,
    label_smoothing=0.0,
):
    """Raise a ValueError/TypeError naming the problem; return the effective vocab size.

    Target values are range-checked only for CPU tensors outside torch.compile: on the GPU that
    check would force a host synchronisation every step, and under compile a data-dependent branch.
    There, an out-of-range target gives a NaN loss instead (never an out-of-bounds read).
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be tensors")
    if x.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 (or int32), got {targets.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V, D), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must equal weight's D: x {tuple(x.shape)} vs weight "
            f"{tuple(weight.shape)}"
        )
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal x's leading dims "
            f"{tuple(x.shape[:-1])}"
        )
    if x.device != weight.device or x.device != targets.device:
        raise ValueError(
            "x, weight, targets must be on one device, got "
            f"{x.device}, {weight.device}, {targets.device}"
        )
    V, D = weight.shape
    if V == 0 or D == 0:
        raise ValueError(f"weight must have V > 0 and D > 0, got shape {tuple(weight.shape)}")
    if vocab_size is None:
        vocab_size = V
    if not 0 < vocab_size <= V:
        raise ValueError(f"vocab_size must be in [1, V={V}], got {vocab_size}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"bias must be a floating point tensor, got {type(bias).__name__}")
        if tuple(bias.shape) != (V,):
            raise ValueError(f"bias must be (V,) = ({V},), got shape {tuple(bias.shape)}")
        if bias.device != weight.device:
            raise ValueError(f"bias must be on weight's device {weight.device}, not {bias.device}")
    if softcap is not None and not (_number(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if not (_number(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if not (_number(label_smoothing) and 0 <= label_smoothing <= 1):
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if targets.device.type == "cpu" and targets.numel() > 0 and not torch.compiler.is_compiling():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
        if bool(bad.any()):
            first = targets[bad][0].item()
            raise ValueError(
                f"target {first} is outside [0, {vocab_size}) "
                f"and is not ignore_index={ignore_index}"
            )
    return vocab_size
