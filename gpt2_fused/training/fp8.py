"""FP8 GEMMs (GPTConfig.fp8, --fp8) besides the model: check() that this GPU, torch and torchao
run the recipe, and FSDP2's float8 all-gather. The model builds its blocks for its recipe itself
(model.py), so the FP8 GEMMs run wherever a GPT with that config does.

Under torchao's recipes each block's four Linears (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
are torchao's Float8Linear: the three GEMMs of each, y = x W^T, dx = dy W, dW = dy^T x, run on FP8
tensor cores (torch._scaled_mm), their operands cast to float8 with scales taken from the
operands' absolute maxima at that moment (dynamic scaling), the products summed in fp32 and
written in bf16. Everything else is as without --fp8: the fp32 master weights and AdamW, the
attention itself (SDPA), LayerNorms, GELU, the embeddings, and lm_head (= wte, tied), whose weight
the fused loss reads in bf16. The model's fast MLP and attention paths, which run GEMMs of their
own from the raw weights, are off under torchao's recipes.

    tensorwise  one scale per tensor; x and W in e4m3, dy in e5m2; cuBLAS GEMMs, the fastest
    rowwise     one power-of-two scale per row of each operand, all in e4m3; CUTLASS GEMMs
    fused       not torchao: each block's two halves, x + attention(LN_1(x)) and x + MLP(LN_2(x)),
                with the four GEMMs in FP8 and every operand cast in the kernel that makes it,
                delayed tensorwise scales (gpt2_fused/kernels/attn_fp8.py, mlp_fp8.py); the
                attention itself in bf16 (cuDNN)
    off         no conversion (bf16 autocast with fp32 master weights, the default)

torch._scaled_mm takes dimensions that are multiples of 16 only, the summed one included: n_embd
(GPTConfig checks it) and, in training, the tokens of a micro-batch, B * T (dW sums over them).

Under FSDP2 (shard="full") tensorwise all-gathers the blocks' weights in float8 (1 B/param
instead of fp32's 4): each rank casts its shard with the scale of the whole weight, and
after_optimizer_step computes the new scales of all of them in one all-reduce (data_parallel.FSDP2
calls gather_in_float8, after_optimizer_step and plain_state_dict: only FSDP2 needs them).
torchao has no float8 all-gather for rowwise, which gathers the fp32 weights as without FP8.

Checkpoints hold plain tensors under the plain model's keys (Float8Linear is an nn.Linear with
the same weight and bias; plain_state_dict unwraps the float8 all-gather's weights), so FP8 and
bf16 runs, sample.py and eval load each other's. torchao is imported only inside functions (here
and in GPT's constructor), so it is needed only by runs that ask for FP8.
"""

import dataclasses
import re

import torch
from torch import nn

from gpt2_fused.kernels.fast_paths import gpu_runs
from gpt2_fused.kernels.launch import capability

# torchao 0.17 is the first release built against torch's stable ABI (torch 2.11 and later);
# older ones must match torch's version exactly. This module is written against 0.18's API.
MIN_TORCHAO = (0, 17)
MIN_TORCH = (2, 11)
# the Linears of each Block whose GEMMs a recipe puts on FP8 tensor cores, by their names in it
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def check(recipe, device):
    """The start-up report's lines on `recipe` (GPTConfig.fp8) on `device` (a torch.device or its
    string): none for "off". ValueError (one line: what is wrong, what to do) where this run
    cannot train with it. Every sharding mode runs ("none", "optimizer", "full"): rowwise under
    FSDP2 gathers the fp32 weights (torchao's float8 all-gather is tensorwise only). Runs a tiny
    FP8 GEMM on the GPU, forward and backward, so that a missing kernel (say rowwise on a GPU or
    torch build without it) stops the run here, not at its first step."""
    if recipe == "off":  # the name itself is GPTConfig's to check
        return []
    device = torch.device(device)
    if recipe == "fused":
        name = _check_gpu(recipe, device)
        try:
            _tiny_fused_step(device)
        except Exception as e:  # a GPU or torch build without the FP8 GEMM
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"fp8='fused': FP8 GEMMs fail on {name} with torch "
                             f"{torch.__version__} ({first}): pass --fp8=off") from e  # fmt: skip
        if not _transposes_right(device):
            raise ValueError(
                f"fp8='fused': on {name} Triton's ptxas miscompiles the kernels that write the "
                "transposed FP8 copies (triton-lang/triton#11111, ptxas 12.x): set "
                "TRITON_PTXAS_PATH to a CUDA 13 ptxas (e.g. /usr/local/cuda/bin/ptxas) or pass "
                "--fp8=tensorwise"
            )
        return _notes(recipe, device)
    torchao = _import_torchao(recipe)
    ours, theirs = _version(torch.__version__), _version(torchao.__version__)
    if theirs is not None and theirs < MIN_TORCHAO:
        raise ValueError(
            f"fp8={recipe!r}: torchao {torchao.__version__} is older than "
            f"{_dotted(MIN_TORCHAO)} (its builds match one torch version): pip install -U torchao"
        )
    if ours < MIN_TORCH:
        raise ValueError(
            f"fp8={recipe!r}: torchao {torchao.__version__} needs torch >= {_dotted(MIN_TORCH)}, "
            f"this is torch {torch.__version__}: upgrade torch or pass --fp8=off"
        )
    try:
        from torchao.float8 import (  # noqa: F401
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )
    except ImportError as e:
        raise ValueError(
            f"fp8={recipe!r}: torchao {torchao.__version__} lacks the float8 training API used "
            f"here ({e}); written against torchao 0.18: pip install torchao==0.18.0"
        ) from e
    name = _check_gpu(recipe, device)
    try:
        _tiny_step(recipe, device)
    except Exception as e:  # whatever torch or torchao raise: the run cannot use the recipe
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"fp8={recipe!r}: torchao's FP8 GEMMs fail on {name} with torch {torch.__version__}, "
            f"torchao {torchao.__version__} ({first}): try the other recipe or --fp8=off"
        ) from e
    return _notes(recipe, device)


def _check_gpu(recipe, device):
    """ValueError unless `device` (a torch.device) is a CUDA GPU with FP8 tensor cores; its
    name."""
    if device.type != "cuda":
        raise ValueError(
            f"fp8={recipe!r} needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+: "
            f"Ada, Hopper, Blackwell), this run is on {device.type}: pass --fp8=off"
        )
    name, cc = torch.cuda.get_device_name(device), capability(device)
    if not gpu_runs("fp8", device):
        raise ValueError(
            f"fp8={recipe!r}: {name} (compute capability {cc[0]}.{cc[1]}) has no FP8 tensor "
            "cores (8.9+: Ada, Hopper, Blackwell): pass --fp8=off"
        )
    return name


def gather_in_float8(model):
    """Under FSDP2, before fully_shard (data_parallel.FSDP2.shard_model): a tensorwise model's block
    Linears swapped again (a Float8Linear is an nn.Linear: the same Parameters, a new module) with
    torchao's float8 all-gather on, which wraps their weights. Nothing for the other recipes."""
    if model.config.fp8 != "tensorwise":
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    for block in model.transformer.h:  # as GPT's constructor swaps them
        convert_to_float8_training(block, config=config)


def after_optimizer_step(model):
    """Under FSDP2, after every optimizer step (data_parallel.FSDP2.step; model: the sharded raw
    model). With the float8 all-gather (tensorwise) computes the next forward's scales of all
    the blocks' weights in one all-reduce; without it each weight's all-gather would all-reduce
    its own amax. Nothing for the other recipes."""
    if model.config.fp8 == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def plain_state_dict(state):
    """The model state dict `state` with plain tensors only, for a checkpoint. The float8
    all-gather wraps the blocks' weights in a torchao tensor subclass, and FSDP2's full state
    dict keeps that wrapper at world size 1 (at 2 and more its gather returns plain tensors);
    torch.load(weights_only=True) reads it only where torchao is imported, so never in sample.py.
    Wrapped values are copied out into plain tensors, the others returned as they are."""
    return {name: _plain(t) for name, t in state.items()}


def _import_torchao(recipe):
    """The torchao module; ValueError if it is not installed or fails to import."""
    try:
        import torchao
    except ModuleNotFoundError as e:
        if e.name != "torchao":
            raise ValueError(f"fp8={recipe!r}: torchao failed to import: {e}") from e
        raise ValueError(
            f"fp8={recipe!r} needs torchao's float8 training: pip install torchao"
        ) from e
    except Exception as e:  # a build that does not match this torch, say
        raise ValueError(f"fp8={recipe!r}: torchao failed to import: {e}") from e
    return torchao


def _tiny_step(recipe, device):
    """One forward and backward of a 32 x 32 Float8Linear under bf16 autocast on `device`."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    net = nn.Sequential(nn.Linear(32, 32)).to(device)
    convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(16, 32, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = net(x)
    y.float().sum().backward()
    torch.cuda.synchronize(device)


def _tiny_fused_step(device):
    """One forward and backward of mlp_fp8 at width 32 on `device`."""
    from gpt2_fused.kernels.mlp_fp8 import mlp_fp8, mlp_state

    ln, fc, proj = nn.LayerNorm(32), nn.Linear(32, 128), nn.Linear(128, 32)
    for m in (ln, fc, proj):
        m.to(device)
    x = torch.randn(16, 32, device=device, requires_grad=True)
    out = mlp_fp8(x, ln, fc.weight, fc.bias, proj.weight, proj.bias, mlp_state(device))
    out.float().sum().backward()
    torch.cuda.synchronize(device)


def _notes(recipe, device):
    """check()'s start-up report lines on a recipe it passed."""
    how = "our kernels' casts" if recipe == "fused" else "torchao"
    out = [f"fp8 {recipe}: the blocks' Linears on FP8 GEMMs ({how}), lm_head bf16"]
    if recipe == "fused" and transposes_split(device):  # bench/RESULTS.md#fp8-fused-casts
        out.append("fp8 fused: the transposed FP8 copies by passes of their own, as this ptxas "
                   "miscompiles them in the casting kernels: a CUDA 13 ptxas in "
                   "TRITON_PTXAS_PATH saves those passes")  # fmt: skip
    return out


def transposes_split(device):
    """Whether act_fp8 makes its transposed FP8 copies by transpose_fp8 after the kernel, as
    this GPU's compiled kernel gets them wrong (Triton's bundled ptxas on an H200), rather than
    in the kernel (CUDA 13's ptxas): bench/RESULTS.md#fp8-fused-casts."""
    from gpt2_fused.kernels.act_fp8 import kernel_transposes_right, transpose_way

    return not kernel_transposes_right(device, transpose_way(device))


def _transposes_right(device):
    """Whether every transposed FP8 copy the fused recipe makes is its row-major copy transposed,
    byte for byte, at 512 x 1024 on `device`: act_fp8's (in the kernel, or after it where
    transposes_split says so) and transpose_fp8's, which the split ones are."""
    from gpt2_fused.kernels.act_fp8 import act_fp8, transpose_fp8

    g = torch.Generator(device=device).manual_seed(0)
    h, dy = (torch.randn(512, 1024, device=device, generator=g).bfloat16() for _ in range(2))
    q, qt = act_fp8("dgelu", torch.ones(1, device=device), torch.zeros(1, device=device), h=h,
                    g=dy, fp8=torch.float8_e5m2, transposed=True)  # fmt: skip
    want = q.view(torch.uint8).t()
    return all(torch.equal(t.view(torch.uint8), want) for t in (qt, transpose_fp8(q)))


def _plain(t):
    """t itself if it is a plain tensor (or not a tensor), else its values in a plain tensor."""
    if not isinstance(t, torch.Tensor) or type(t) in (torch.Tensor, nn.Parameter):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)  # the subclass's copy_ copies its inner tensor: out stays plain
    return out


def _version(text):
    """(major, minor) of a version string such as "2.11.0+cu130"; None if it has none."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _dotted(version):
    return ".".join(map(str, version))
