"""Which GPUs and compute dtypes each fast path runs on: one table (FAST_PATHS), read by the code
that picks a path and by the start-up notice (notice()) that names those a run falls back from.

A path runs on CUDA where the GPU's compute capability (launch.capability(), which
GPT2_FUSED_FORCE_CAPABILITY overrides) lies in [lowest, below) and the matmuls' dtype (autocast's,
else the tensors') is one of its dtypes; elsewhere its twin runs, the same math in plain torch
unless the row says otherwise. On a CPU the Triton kernels run in the interpreter (tests) and the
CUDA-only ops step aside by themselves; this table is about GPUs.

Why each bound:
- Triton kernels (the loss's row kernels, colsum in the MLP and attention backward, AdamW, the
  GEMVs): sm_80 and later, what Triton supports; every launch setting fits the shared memory of
  sm_80 (163 KB a block) and sm_86/sm_89 (99 KB) (tests/test_fast_paths.py compiles them).
- The loss's logits-GEMM epilogue (fused_loss/exp_gemm.py): TMA, wgmma and 225 KB of shared memory
  a block, Hopper only; else the cuBLAS GEMM and the row kernel, still the fused loss.
- attention: cuDNN's fused attention, tuned and tested on Hopper only.
- fp16: the fused loss forms its gradient G = g (softmax - onehot) in the forward, before the
  loss scale multiplies it in; with a mean's g = 1/tokens a probability below ~1e-3 at 16K tokens
  a micro-batch would fall under fp16's least subnormal step (6e-8), so under fp16 autocast the
  model asks it for the sum's gradients (g = 1) and takes the mean after (model.GPT.forward;
  tests/test_fast_paths.py). The epilogue's E reaches e^60, past fp16
  (linear_cross_entropy.use_single_read): bf16 only. The other paths take fp16 as torch's ops do
  (their GEMMs accumulate in fp32, the upstream gradient arrives scaled).
- fp8 (--fp8, gpt2_fused/training/fp8.py): FP8 tensor cores, sm_89 and later; a run that asks for it
  on an older GPU stops with one line instead of falling back.
"""

from dataclasses import dataclass

import torch

from gpt2_fused.kernels.launch import capability

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class Needs:
    lowest: tuple  # (major, minor): the oldest GPU the path runs on
    below: tuple | None  # the first capability it no longer runs on, or None
    dtypes: tuple  # compute dtypes it is correct in
    twin: str  # what runs instead


# name -> Needs; the names are what notice() prints
FAST_PATHS = {
    "loss": Needs((8, 0), None, (BF16, FP16, FP32), "the torch loss (full logits)"),
    "loss epilogue": Needs((9, 0), (10, 0), (BF16,), "cuBLAS logits GEMM + row kernel"),
    "mlp": Needs((8, 0), None, (BF16, FP16), "F.linear + F.gelu"),
    "attention": Needs((9, 0), (10, 0), (BF16, FP16), "F.linear + F.scaled_dot_product_attention"),
    "adamw": Needs((8, 0), None, (BF16, FP16, FP32), "torch's fused AdamW"),
    "gemv": Needs((8, 0), None, (BF16, FP16), "torch's decoding step"),
    "gemv pdl": Needs((9, 0), None, (BF16, FP16), "an ordinary launch"),
    "fp8": Needs((8, 9), None, (BF16,), "none: the run stops (--fp8=off)"),
}


def gpu_runs(name, device=None):
    """Whether CUDA device `device` (None: the current one) is a GPU the path runs on."""
    need = FAST_PATHS[name]
    cc = capability(device)
    return need.lowest <= cc and (need.below is None or cc < need.below)


def dtype_runs(name, dtype):
    """Whether the path is correct with its matmuls in `dtype`. Reads only the table: Dynamo
    traces it."""
    return dtype in FAST_PATHS[name].dtypes


def compute_dtype(x):
    """The dtype x's matmuls run in: autocast's on x's device when it is on, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def notice(names, device, dtype):
    """One start-up line naming the paths of `names` (those the run asks for) that device or dtype
    rule out, with what each needs and what runs instead; None when all of them run (or on a
    CPU)."""
    if torch.device(device).type != "cuda":
        return None
    cc = capability(device)
    off = []
    for name in names:
        need = FAST_PATHS[name]
        if not gpu_runs(name, device):
            span = f"sm_{need.lowest[0]}{need.lowest[1]}" + ("" if need.below else "+")
            if need.below is not None and need.below[0] == need.lowest[0] + 1:
                span = f"sm_{need.lowest[0]}x"
            off.append(f"{name} (needs {span}; {need.twin})")
        elif not dtype_runs(name, dtype):
            dts = "/".join(str(d).removeprefix("torch.") for d in need.dtypes)
            off.append(f"{name} (needs {dts}; {need.twin})")
    if not off:
        return None
    dt = str(dtype).removeprefix("torch.")
    return f"fast paths off on sm_{cc[0]}{cc[1]} in {dt}: " + ", ".join(off)
