"""The optimizer for training (AdamW, or muon.py's Muon): its construction, state loading, the
clipped step and the LR schedule."""

import math

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from gpt2_fused.kernels.adamw import MultiTensorAdamW
from gpt2_fused.kernels.fast_paths import gpu_runs
from gpt2_fused.training.config import ConfigError
from gpt2_fused.training.muon import muon_parts


def adamw_parts(model, cfg, device):
    """(optimizer class, param groups, keyword arguments) of the run's AdamW: weight decay only on
    >= 2-D tensors (matmul weights, embeddings), not on biases or LayerNorm gains. On CUDA:
    MultiTensorAdamW (one Triton launch) for fp32 parameters unless adamw_impl="torch" or the GPU
    is one it does not run on (kernels/fast_paths.py), else torch's fused kernel. Both keep the
    same state (checkpoints move). data_parallel.py wraps the same parts in
    ZeroRedundancyOptimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kw = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    fp32 = all(p.dtype == torch.float32 for p in params)
    if device.type == "cuda" and cfg.adamw_impl == "fast" and fp32 and gpu_runs("adamw", device):
        return MultiTensorAdamW, groups, kw
    return torch.optim.AdamW, groups, dict(kw, fused=device.type == "cuda")


def optimizer_parts(model, cfg, device):
    """(class, param groups, keyword arguments) of cfg.optimizer: adamw_parts or muon_parts."""
    return (muon_parts if cfg.optimizer == "muon" else adamw_parts)(model, cfg, device)


def build_optimizer(model, cfg, device):
    """The run's optimizer (optimizer_parts)."""
    cls, groups, kw = optimizer_parts(model, cfg, device)
    return cls(groups, **kw)


def _kind(groups):
    """The optimizer ("muon" or "adamw") these param groups, or a state dict's, belong to."""
    return "muon" if any(g.get("muon") for g in groups) else "adamw"


def local_optimizer(optimizer):
    """The optimizer that updates this rank's parameters: ZeroRedundancyOptimizer's own (this
    rank's shard of them), else optimizer itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def load_optimizer_state(optimizer, state, load=None):
    """load(state) (by default optimizer.load_state_dict), keeping the optimizer's own choice of
    kernel: a state saved by MultiTensorAdamW carries no "fused"/"foreach" flags, and torch's
    AdamW would otherwise take them from it (and drop to its slower per-tensor loop). A fused
    AdamW keeps its step counters on the parameters' device (torch moves them only for fused
    states). Under ZeroRedundancyOptimizer the flags and counters that matter are its local
    optimizer's, which keeps this rank's part of the full state."""
    saved, mine = _kind(state["param_groups"]), _kind(optimizer.param_groups)
    if saved != mine:
        raise ConfigError(
            f"the checkpoint holds {saved}'s optimizer state, this run uses {mine}: pass "
            f"--optimizer={saved} to resume it"
        )
    local = local_optimizer(optimizer)
    # lr_scale: Muon's muon_lr / learning_rate, the run's own (as the LR itself is)
    keep = ("fused", "foreach", "lr_scale")
    how = [{k: g[k] for k in keep if k in g} for g in local.param_groups]
    (load or optimizer.load_state_dict)(state)
    if local is not optimizer:
        # the wrapper also loaded this rank's part (on a GPU a second copy), which it never reads
        optimizer.state.clear()
        for group, flags in zip(optimizer.param_groups, how, strict=True):
            group.update(flags)
    for group, flags in zip(local.param_groups, how, strict=True):
        group.update(flags)
        for p in group["params"] if group.get("fused") else []:
            if "step" in local.state.get(p, {}):
                step = local.state[p]["step"]
                local.state[p]["step"] = step.to(dtype=torch.float32, device=p.device)


def clipped_step(optimizer, params, max_norm, scaler=None):
    """clip_grad_norm_(params, max_norm), then optimizer.step(); returns the total grad norm
    before clipping (a device scalar: no host sync). params: the optimizer's parameters, in the
    model's order (the norm's summation order, so the plain path is bitwise what it was).
    scaler: an fp16 run's loss_scale.LossScaler (the grads are scaled by it; a step with an inf
    or a nan among them is skipped), or None.

    A fused AdamW divides each grad by `optimizer.grad_scale` (a device tensor; the hook
    GradScaler uses) as it reads it, so there the clip factor rides along: the grads are read
    once for the norm and once by the update, instead of also being scaled in place in between
    (4 of 40 bytes per parameter fewer; bench/bench_adamw.py times both). The loss scale rides
    along too, and `optimizer.found_inf` skips the update on the device. The grads left behind
    are the clipped ones (MultiTensorAdamW leaves them unclipped: 4 bytes fewer again).
    Non-fused optimizers (CPU) take the plain path. Under ZeroRedundancyOptimizer the grads are
    whole on every rank (DDP all-reduced them), so the norm over params is the global one (its
    local MultiTensorAdamW's total_norm would cover this rank's shard only); grad_scale goes to
    the local optimizer, which runs the update."""
    params = list(params)
    local = local_optimizer(optimizer)
    scaled = scaler is not None and scaler.enabled
    if local is optimizer and isinstance(optimizer, MultiTensorAdamW):  # the norm in one launch
        norm = optimizer.total_norm()
    elif isinstance(local, MultiTensorAdamW) or all(g.get("fused") for g in local.param_groups):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    elif scaled:
        return _unfused_scaled_step(optimizer, params, max_norm, scaler)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm
    # clip_grad_norm_ multiplies by min(max_norm / (norm + 1e-6), 1); the kernel divides by
    # the inverse (within an ulp of it; a non-finite norm poisons the step the same way)
    if scaled:
        norm = scaler.check(norm)  # the unscaled norm
        local.found_inf = scaler.found_inf
    local.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    if scaled:
        local.grad_scale *= scaler.scale
    optimizer.step()
    return norm


def _unfused_scaled_step(optimizer, params, max_norm, scaler):
    """clipped_step for an unfused AdamW (on a CPU) under a loss scale: it takes no grad_scale
    or found_inf, so the grads are unscaled and clipped in place, and a step with an inf or a nan
    is skipped on the host's reading of found_inf (a CPU has nothing to overlap it with)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = scaler.check(torch.nn.utils.get_total_norm(grads))
    if scaler.found_inf.item():
        return norm
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) / scaler.scale
    torch._foreach_mul_(grads, coef)
    optimizer.step()
    return norm


def get_lr(step, cfg):
    """Linear warmup over warmup_steps, then cosine down to learning_rate * final_lr_frac."""
    max_lr, min_lr = cfg.learning_rate, cfg.learning_rate * cfg.final_lr_frac
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return min_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)
