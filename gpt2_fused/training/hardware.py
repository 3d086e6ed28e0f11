"""Which device and dtype a process computes on, and facts about the hardware."""

import ctypes
import re
import sys

import torch

from gpt2_fused.kernels import fast_paths

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name="auto"):
    """ "auto" -> cuda if available else cpu; also "cpu", "cuda", "cuda:N"."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"bad device {name!r}: use auto, cpu, cuda or cuda:N") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"unsupported device {name!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name, device):
    """dtype name -> torch dtype; "auto" is bfloat16 on a GPU that computes in it natively
    (sm_80 and later), float16 on an older GPU (T4, V100: tensor cores in fp16 only; the run
    then scales its loss, training/loss_scale.py), float32 on a CPU."""
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if native_bf16(device) else torch.float16


def native_bf16(device):
    """Whether this GPU computes in bf16 itself: sm_80 and later, and ROCm's. (torch's
    is_bf16_supported() also says True where bf16 is only emulated, unless
    including_emulation=False: a T4 or V100 runs it at fp32 speed, without tensor cores.)"""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


# Dense peak FLOP/s (vendor spec sheets and whitepapers, no sparsity) by GPU: (key, bf16, fp16,
# fp32), None where the GPU has no such path. GeForce cards: the FP32-accumulate figure (what
# autocast's GEMMs use; half their FP16-accumulate one). fp32 is what an fp32 run's matmuls reach:
# TF32 tensor cores from Ampere on (train.py allows TF32), the CUDA cores on T4 and V100. The
# A10G (AWS's part) has no NVIDIA sheet: the figures cloud vendors list (half the A10's tensor
# rate).
# A key matches a name's model (lower case) followed only by memory and form-factor words
# (PEAK_SUFFIX): "rtx 4090" takes "NVIDIA GeForce RTX 4090", not "... RTX 4090 D" or a laptop's.
# Most specific key first.
PEAK_FLOPS = (
    ("h100 pcie", 756e12, 756e12, 378e12),
    ("h100 nvl", 835e12, 835e12, 418e12),
    ("h200 nvl", 835e12, 835e12, 418e12),
    ("h100", 989e12, 989e12, 495e12),  # SXM
    ("h200", 989e12, 989e12, 495e12),  # SXM
    ("gh200", 989e12, 989e12, 495e12),
    ("b200", 2250e12, 2250e12, 1125e12),
    ("a100", 312e12, 312e12, 156e12),  # SXM and PCIe alike
    ("a10g", 70e12, 70e12, 35e12),
    ("a10", 125e12, 125e12, 62.5e12),
    ("l40s", 362e12, 362e12, 183e12),
    ("l40", 181e12, 181e12, 90.5e12),
    ("l4", 121e12, 121e12, 60e12),
    ("rtx 3090", 71e12, 71e12, 35.6e12),
    ("rtx 4090", 165.2e12, 165.2e12, 82.6e12),
    ("rtx 5090", 209.5e12, 209.5e12, 104.8e12),
    ("t4", None, 65e12, 8.1e12),  # no bf16 tensor cores, no TF32
    ("v100-pcie", None, 112e12, 14e12),
    ("v100s", None, 130e12, 16.4e12),
    ("v100", None, 125e12, 15.7e12),  # SXM2
    ("mi300x", 1307e12, 1307e12, None),
)
PEAK_SUFFIX = r"(?:[\s-]+(?:\d+gb|pcie|sxm\d*|hbm\d*e?))*"
PEAK_COLUMN = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def peak_flops(device_name, dtype):
    """Dense peak FLOP/s of a GPU (its torch.cuda.get_device_name()) for matmuls in `dtype`, or
    None for a GPU not in PEAK_FLOPS or a dtype it has no figure for: no MFU then, rather than
    a wrong one."""
    name = (device_name or "").lower()
    for row in PEAK_FLOPS:
        if re.search(rf"(?:^|[\s-]){re.escape(row[0])}{PEAK_SUFFIX}$", name):
            return row[PEAK_COLUMN[dtype]]
    return None


def fast_path_notes(cfg, device, dtype):
    """The start-up notice, as a list of at most one line, of the fast paths that `cfg` (a
    TrainConfig) asks for and that this GPU or dtype rules out (kernels/fast_paths.py)."""
    m = cfg.model
    asked = {
        "loss": m.loss_impl == "fast",
        "loss epilogue": m.loss_impl == "fast",
        "mlp": m.mlp_impl == "fast",
        "attention": m.attn_impl == "fast" and m.dropout == 0,
        "adamw": cfg.adamw_impl == "fast",
        "gemv": cfg.sample_interval > 0,
    }
    line = fast_paths.notice([name for name, on in asked.items() if on], device, dtype)
    return [line] if line else []


def keep_freed_memory():
    """Keep large freed blocks in this process's heap instead of returning them to the OS.

    glibc serves blocks over 32 MiB with mmap and unmaps them when freed, so on a CPU every step
    would page-fault its (tokens x vocab) logits in anew and spend most of its time in the
    kernel. Up to 1 GiB of freed memory stays with the process. Returns whether glibc took the
    settings (False without glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    return bool(mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
