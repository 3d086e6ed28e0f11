"""Muon for the blocks' matrices, AdamW for everything else, as one torch.optim.Optimizer.

Per block matrix W (out x in; c_attn, attention c_proj, c_fc, MLP c_proj), with gradient g (fp32):

    m = mu * m + (1 - mu) * g                   momentum (fp32 state "momentum_buffer")
    u = mu * m + (1 - mu) * g                   Nesterov: the step looks one momentum ahead
    O = orthogonalize(u)                        ~ U V^T of u = U S V^T, in bf16 (below)*
    W = W * (1 - lr * wd) - lr * sqrt(max(1, out / in)) * O

The scale keeps a tall matrix's update as large per entry as a square one's (O's entries have an
RMS of about 1 / sqrt(max(out, in)) there). wte (= the tied head), wpe, the LayerNorm gains and
all biases take torch's AdamW (its functional form: the same state, exp_avg / exp_avg_sq / step)
at learning_rate; the Muon matrices' peak is muon_lr, and `lr_scale` (muon_lr / learning_rate)
lets the trainer's one schedule drive both. (*) In the run's matmul dtype: bf16 on GPUs, fp32
in fp32 runs (CPU).

orthogonalize runs five steps of a quintic Newton-Schulz iteration on X = u / |u|_F (the largest
singular value <= 1), X <- a X + (b A + c A^2) X with A = X X^T (X kept wide: A is the small
Gram matrix). Each step maps every singular value s to a s + b s^3 + c s^5; the coefficients
trade exact convergence for speed: s in [3e-3, 1] ends in [0.68, 1.21], a band Muon
tolerates (bf16 rounding adds ~3 % of the result's norm; tests/test_muon.py). On CUDA the loop
is torch.compile'd (one graph per shape: the norm, scalings and additions fused around the
GEMMs); orthogonalize_reference is the same loop in plain torch.

Distributed: `share_across_ranks` (DDP, FSDP2) orthogonalises matrices of one shape as a batch,
each rank the matrices i with i % W == rank, and one all-gather per shape hands every rank all
results, so each rank applies the same update. Under FSDP2 (DTensor shards along dim 0) each
matrix's u is first gathered whole (in bf16: half the bytes of FSDP2's fp32 weight gathers),
then shared out as under DDP, and each rank keeps its rows of O: orthogonalising each shard alone
would change the math (and the scale), and gathering only to the matrix's owner would need a
gather and a scatter per matrix instead of one all-gather. Under ZeRO-1
data_parallel.py wraps this class in ZeroRedundancyOptimizer: each rank's instance holds only its
own parameters (and momentum), orthogonalises them alone, and ZeRO broadcasts the new weights.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from gpt2_fused.training.hardware import resolve_dtype

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # a, b, c of a s + b s^3 + c s^5
NS_STEPS = 5


def orthogonalize_reference(u, steps=NS_STEPS, dtype=torch.bfloat16):
    """~ U V^T of each (m, n) matrix in u (..., m, n) by the quintic Newton-Schulz iteration
    (module docstring), in `dtype`; returns a tensor of u's shape in that dtype."""
    x = u.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * (A @ A)) @ x
    return x.mT if tall else x


_compiled = None


def orthogonalize(u):
    """orthogonalize_reference in u's dtype, compiled on CUDA (recompiled per shape, a handful a
    model)."""
    global _compiled
    if u.device.type != "cuda":
        return orthogonalize_reference(u, dtype=u.dtype)
    if _compiled is None:
        _compiled = torch.compile(orthogonalize_reference, fullgraph=True, dynamic=False)
    return _compiled(u, dtype=u.dtype)


def is_muon_matrix(name, p):
    """The blocks' 2-D weights (transformer.h.*: c_attn, c_proj, c_fc, c_proj)."""
    return name.startswith("transformer.h.") and p.dim() == 2


def muon_parts(model, cfg, device):
    """(Muon, param groups, keyword arguments), as optim.adamw_parts gives AdamW's: the block
    matrices in one Muon group, then AdamW's two groups (decay on >= 2-D: wte, wpe; none on
    gains and biases)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_muon_matrix(n, p)]
    rest = [p for n, p in named if not is_muon_matrix(n, p)]
    scale = cfg.muon_lr / cfg.learning_rate
    groups = [
        dict(
            params=matrices,
            muon=True,
            lr=cfg.muon_lr,
            lr_scale=scale,
            weight_decay=cfg.muon_weight_decay,
        ),
        dict(params=[p for p in rest if p.dim() >= 2], muon=False, weight_decay=cfg.weight_decay),
        dict(params=[p for p in rest if p.dim() < 2], muon=False, weight_decay=0.0),
    ]
    kw = dict(lr=cfg.learning_rate, momentum=cfg.muon_momentum, betas=(cfg.beta1, cfg.beta2))
    ns_dtype = str(resolve_dtype(cfg.dtype, device)).removeprefix("torch.")
    return Muon, groups, dict(kw, adamw_fused=device.type == "cuda", ns_dtype=ns_dtype)


class Muon(torch.optim.Optimizer):
    """Muon on groups with muon=True, torch's AdamW on the others (module docstring).
    adamw_fused: AdamW's fused kernel (CUDA); only the AdamW groups get the "fused" flag, so
    optim.clipped_step clips the grads before the step (Muon reads no grad_scale).
    share_across_ranks: under a process group, split the orthogonalisation across the ranks
    (every rank must hold every parameter, whole or as FSDP2 shards); False where each rank holds
    its own parameters (ZeRO-1). ns_dtype: the orthogonalisation's, the run's matmul dtype
    ("bfloat16"; "float32" in fp32 runs on a CPU, where bf16 GEMMs are slow and their rounding
    would hide the ranks' float-exact match with one process)."""

    def __init__(self, params, lr=1e-3, momentum=0.95, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.0, adamw_fused=False, share_across_ranks=True,
                 ns_dtype="bfloat16"):  # fmt: skip
        defaults = dict(lr=lr, momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, dict(defaults, muon=False, lr_scale=1.0))
        for group in self.param_groups:  # torch's load_state_dict keeps fused steps on device
            if adamw_fused and not group["muon"]:
                group["fused"] = True
        self.share, self.ns_dtype = share_across_ranks, getattr(torch, ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_step if group["muon"] else self._adamw_step)(group)
        return loss

    def _adamw_step(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:
                on_device = p.device if group.get("fused") else "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=on_device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [self.state[p]["exp_avg"] for p in params],
            [self.state[p]["exp_avg_sq"] for p in params],
            [],
            [self.state[p]["step"] for p in params],
            foreach=False,
            fused=group.get("fused", False),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _muon_step(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        ahead = []  # the Nesterov u of each matrix, in ns_dtype, whole
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m = state["momentum_buffer"]
            m.lerp_(p.grad, 1 - mu)
            u = torch.lerp(p.grad, m, mu).to(self.ns_dtype)
            ahead.append(u.full_tensor() if isinstance(u, DTensor) else u)
        for p, o in zip(params, self._orthogonalized(ahead), strict=True):
            scale = math.sqrt(max(1.0, o.size(-2) / o.size(-1)))  # the whole matrix's shape
            if isinstance(p, DTensor):
                p, o = p.to_local(), _rows_of_this_rank(o, p)
            p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * scale)

    def _orthogonalized(self, us):
        """orthogonalize(u) for each u (whole matrices, the same on every rank), each
        shape as one batch; under a process group (share) each rank computes its share."""
        world = dist.get_world_size() if self.share and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        out = [None] * len(us)
        by_shape = {}
        for i, u in enumerate(us):
            by_shape.setdefault(tuple(u.shape), []).append(i)
        for idx in by_shape.values():
            mine = idx[rank::world]  # rank r: the shape's matrices r, r + W, ...
            per_rank = math.ceil(len(idx) / world)
            batch = torch.stack([us[i] for i in mine]) if mine else us[idx[0]][None][:0]
            o = orthogonalize(batch) if mine else batch
            if world > 1:
                if len(mine) < per_rank:  # all-gather takes equal sizes
                    o = torch.cat([o, o.new_zeros((per_rank - len(mine), *o.shape[1:]))])
                parts = [torch.empty_like(o) for _ in range(world)]
                dist.all_gather(parts, o.contiguous())
            else:
                parts = [o]
            for k, i in enumerate(idx):
                out[i] = parts[k % world][k // world]
        return out


def _rows_of_this_rank(o, p):
    """This rank's rows of the whole matrix o, for p, a DTensor sharded along dim 0 as FSDP2
    shards (torch.chunk: ceil(rows / W) rows a rank, the last ones fewer or none)."""
    mesh = p.device_mesh
    rows, world = o.size(0), mesh.size()
    chunk = math.ceil(rows / world)
    start = min(mesh.get_local_rank() * chunk, rows)
    local = o[start : start + chunk]
    if local.shape != p.to_local().shape:
        raise ValueError(f"Muon: a DTensor shard of {tuple(local.shape)} rows is not dim-0 chunks")
    return local
