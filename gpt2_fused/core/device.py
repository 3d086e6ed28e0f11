"""Which device and dtype a process computes on, and facts about the hardware."""

import ctypes
import sys

import torch

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
    then scales its loss, core/loss_scale.py), float32 on a CPU."""
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


# Dense bf16 tensor-core peak FLOP/s by substring of torch.cuda.get_device_name(), most specific
# first (vendor spec sheets, no sparsity).
PEAK_BF16_FLOPS = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h200 nvl", 835e12),
    ("h100", 989e12),  # SXM
    ("h200", 989e12),  # SXM, and GH200
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l40", 181e12),
    ("l4", 121e12),
    ("rtx 4090", 165e12),
    ("mi300x", 1307e12),
)


def peak_flops(device_name):
    """bf16 dense peak FLOP/s for a GPU name, or None when unknown (MFU is then not reported)."""
    name = (device_name or "").lower()
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


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
