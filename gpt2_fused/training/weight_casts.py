"""The matmul parameters' casts to the compute dtype, kept by the optimizer instead of made anew
by every micro-batch's forward.

Under bf16 autocast the fast paths' ops (mlp.mlp_cublaslt, attention.attention_fast and
attention.proj_residual_fast) multiply by each fp32 weight's bf16 cast and add each bias's, and
the fused loss multiplies by the tied embedding's (the classifier, V x D: 154 MB read and 77 MB
written a micro-batch at 124M).
Cast in the forward, that is every weight and bias once per micro-batch (4 bytes read and 2
written a parameter, eight small kernels a layer), and the casts are held for the backward.
Here each of them gets one persistent cast, in `linear.weight_casts` (weight, bias), that
MultiTensorAdamW rewrites as it updates the parameter (2 bytes more a parameter in a launch it
makes anyway): once a step, whatever the micro-batch count. bench/RESULTS.md#weight-casts.

A cast is right only while nothing but that optimizer changes its parameter. So attach() comes
last in the set-up, after a resume has loaded the weights and DDP has broadcast rank 0's, and
only where that optimizer updates every parameter itself. Nothing is attached under ZeRO-1 (each
rank updates a shard, then broadcasts), FSDP2 (sharded parameters), torch's AdamW or --fp8
(casts of its own). A later model.load_state_dict copies the casts again (a hook); any other
write to a parameter would leave its cast stale. Evaluation, sampling and checkpoints read the
parameters as before; a
Linear whose weight_casts are (None, None) (model.py's default) casts per call.
"""

import torch

from gpt2_fused.kernels.adamw import CAST_CODES, MultiTensorAdamW

SLOT = 8  # elements: each cast starts on a 16-byte boundary (the kernel's wide stores)


def fast_linears(model):
    """The Linears whose forwards read weight_casts: the blocks' on the fast paths (both ops need
    biases, else they hand the call to torch's path) and lm_head under the fused loss (its
    weight only)."""
    found = []
    for block in model.transformer.h:
        if block.attn.use_fast and block.attn.fp8_state is None:
            found += [block.attn.c_attn, block.attn.c_proj]
        if block.mlp.use_cublaslt and block.mlp.fp8_state is None:
            found += [block.mlp.c_fc, block.mlp.c_proj]
    head = [model.lm_head] if model.fused_loss else []
    return head + [m for m in found if m.bias is not None]


def attach(model, optimizer, dtype):
    """Give model's fast-path Linears weight_casts in `dtype` (the autocast dtype), kept by
    optimizer from its next step on; returns how many Linears got them (0 where this does not
    apply: the module docstring)."""
    if dtype not in CAST_CODES or not isinstance(optimizer, MultiTensorAdamW):
        return 0
    owned = {p for group in optimizer.param_groups for p in group["params"]}
    linears = [
        m
        for m in fast_linears(model)
        if all(p in owned and p.dtype == torch.float32 for p in m.parameters())
    ]
    params = [p for m in linears for p in (m.weight, m.bias) if p is not None]
    if not params:
        return 0
    slots = [(p.numel() + SLOT - 1) // SLOT * SLOT for p in params]
    flat = torch.empty(sum(slots), dtype=dtype, device=params[0].device)
    casts, offset = {}, 0
    for p, n in zip(params, slots, strict=True):
        cast = flat[offset : offset + p.numel()].view_as(p)
        with torch.no_grad():
            cast.copy_(p)
        # an address CUDA graphs keep: replays read it in place rather than copying it in
        torch._dynamo.mark_static_address(cast, guard=False)
        casts[p] = cast
        offset += n
    for m in linears:
        m.weight_casts = (casts[m.weight], casts.get(m.bias))
    optimizer.set_weight_casts(casts)

    def reload(module, incompatible_keys):  # weights loaded later: the casts follow them
        with torch.no_grad():
            for p, cast in optimizer.weight_casts.items():
                cast.copy_(p)

    model.register_load_state_dict_post_hook(reload)
    return len(linears)
