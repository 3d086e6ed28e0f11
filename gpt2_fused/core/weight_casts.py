"""The matmul weights' casts to the compute dtype, kept by the optimizer instead of made anew by
every micro-batch's forward.

Under bf16 autocast the fast paths' ops (mlp.mlp_cublaslt, attention.attention_fast and
attention.proj_residual_fast) multiply by each fp32 weight's bf16 cast. Cast in the forward,
that is every weight once per micro-batch (4 bytes read and 2 written a parameter, four kernels
a layer), and the casts are held for the backward. Here each of those weights gets one
persistent cast, `linear.weight_cast`, that MultiTensorAdamW rewrites as it updates the weight
(2 bytes more a parameter in a launch it makes anyway): once a step, whatever the micro-batch
count. bench/RESULTS.md#weight-casts.

A cast is right only while nothing but that optimizer changes its weight. So attach() comes last
in the set-up, after a resume has loaded the weights and DDP has broadcast rank 0's, and only
where that optimizer updates every weight itself. Nothing is attached under ZeRO-1 (each rank
updates a shard, then broadcasts), FSDP2 (sharded parameters), torch's AdamW or --fp8 (casts of
its own). Evaluation, sampling and checkpoints read the weights as before; a Linear whose
weight_cast is None (the default, set by model.py) casts per call.
"""

import torch

from gpt2_fused.kernels.adamw import CAST_CODES, MultiTensorAdamW

SLOT = 8  # elements: each cast starts on a 16-byte boundary (the kernel's wide stores)


def fast_linears(model):
    """The Linears of model's blocks whose forwards take a weight_cast (the fast paths)."""
    found = []
    for block in model.transformer.h:
        if block.attn.use_fast and block.attn.fp8_state is None:
            found += [block.attn.c_attn, block.attn.c_proj]
        if block.mlp.use_cublaslt and block.mlp.fp8_state is None:
            found += [block.mlp.c_fc, block.mlp.c_proj]
    return found


def attach(model, optimizer, dtype):
    """Give model's fast-path Linears a weight_cast in `dtype` (the autocast dtype), kept by
    optimizer from its next step on; returns how many got one (0 where this does not apply:
    the module docstring)."""
    if dtype not in CAST_CODES or not isinstance(optimizer, MultiTensorAdamW):
        return 0
    owned = {p for group in optimizer.param_groups for p in group["params"]}
    linears = [
        m for m in fast_linears(model) if m.weight in owned and m.weight.dtype == torch.float32
    ]
    if not linears:
        return 0
    slots = [(m.weight.numel() + SLOT - 1) // SLOT * SLOT for m in linears]
    flat = torch.empty(sum(slots), dtype=dtype, device=linears[0].weight.device)
    casts, offset = {}, 0
    for m, n in zip(linears, slots, strict=True):
        cast = flat[offset : offset + m.weight.numel()].view_as(m.weight)
        with torch.no_grad():
            cast.copy_(m.weight)
        # an address CUDA graphs keep: replays read it in place rather than copying it in
        torch._dynamo.mark_static_address(cast, guard=False)
        m.weight_cast = cast
        casts[m.weight] = cast
        offset += n
    optimizer.set_casts(casts)
    return len(linears)


def detach(model, optimizer):
    """Undo attach: the Linears cast per call again, the optimizer writes no casts."""
    for m in fast_linears(model):
        m.weight_cast = None
    optimizer.casts = {}
