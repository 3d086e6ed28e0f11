"""How the data-parallel ranks under torchrun hold the training state (--shard): DDP, ZeRO-1 or
FSDP2, on torch's own engines.

    none       DDP: every rank holds the fp32 weights, grads and both AdamW moments (16 B/param)
    optimizer  ZeRO-1: DDP all-reduces the grads as before; torch's ZeroRedundancyOptimizer gives
               each rank whole parameters (largest first, to the least loaded rank) whose AdamW
               state and update it owns; after the update each rank broadcasts its parameters,
               packed in one bucket: 4 + 4 + 8/W B/param
    full       FSDP2: fully_shard on each Block, then on the root (wte = lm_head, wpe, ln_f);
               weights, grads and AdamW state are DTensors split along dim 0: 16/W B/param, plus
               the blocks' weights gathered one or two at a time, the root's through the step,
               and with gradient accumulation the grads unsharded (4 B/param) until the last
               micro-step reduce-scatters them; fp8="tensorwise" gathers the blocks' weights in
               float8 (torchao's float8 all-gather: gpt2_fused/training/fp8.py)

The all-reduce of ZeRO-1 is DDP's unchanged (reduce-scatter would need FSDP2's ZeRO-2 layout;
not measured on several GPUs). FSDP2 gathers the fp32 weights and autocast casts them at each
matmul, as under DDP: a bf16 param_dtype would halve the gathers but change the numerics.

Checkpoints are the same file in every mode: rank 0 writes the full model and torch's ordinary
AdamW state dict (integer ids in param-group order), so each loads into any mode at any world
size, in a single process and in sample.py.
"""

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from gpt2_fused.training import fp8
from gpt2_fused.training.compile_settings import uses_cuda_graphs
from gpt2_fused.training.config import ConfigError
from gpt2_fused.training.kept_grads import KeptGrads
from gpt2_fused.training.muon import Muon
from gpt2_fused.training.optim import (
    build_optimizer,
    clipped_step,
    load_optimizer_state,
    optimizer_parts,
)


def mode(cfg, procs):
    """The run's sharding mode (one of the classes below, by cfg.shard, which TrainConfig has
    checked); ConfigError for a combination that does not run with these processes."""
    if procs.ddp and uses_cuda_graphs(cfg.compile_mode) and not graphs_fit(cfg):
        raise ConfigError(
            f"compile_mode={cfg.compile_mode!r} under torchrun: CUDA graphs cannot hold the "
            "all-reduces that DDP's buckets and FSDP2 run in the backward; pass "
            "--compile_mode=default, or (not with shard='full' or ddp_compile='ddp') "
            "--grad_sync=step"
        )
    return {"none": DataParallel, "optimizer": ZeRO1, "full": FSDP2}[cfg.shard](cfg, procs)


def graphs_fit(cfg):
    """Whether the step can run as CUDA graphs under torchrun: only with the grads summed once
    after the backward (grad_sync "step", which "auto" becomes under graphs), not in DDP's
    buckets or FSDP2's reduce-scatters during it."""
    return cfg.shard != "full" and cfg.ddp_compile != "ddp" and cfg.grad_sync != "ddp"


def sums_at_step(cfg, procs, graphs):
    """Whether this run sums the ranks' grads once a step (DataParallel.sync_at_step) rather
    than through DDP: grad_sync "step", or "auto" with the step as CUDA graphs, under torchrun."""
    auto = cfg.grad_sync == "auto" and graphs and graphs_fit(cfg)
    return procs.ddp and (cfg.grad_sync == "step" or auto)


class DataParallel:
    """shard="none": every rank holds everything; under torchrun DDP all-reduces the grads (the
    trainer wraps the model), in one process the model trains as it is."""

    name = "none"
    wraps_in_ddp = True  # the trainer puts the (compiled) model in DDP under torchrun
    samples = True  # generate() can read the weights between steps
    fully_sharded = False  # parameters are DTensor shards (fp8's float8 all-gather)

    kept = None  # the grads' own buffer (kept_grads.KeptGrads: keep_grads), or None
    summed = False  # the grads summed across ranks once a step, in step() (sync_at_step)

    def __init__(self, cfg, procs):
        self.notes = []  # for the start-up report

    def shard_model(self, raw_model):
        """Shard raw_model in place (before compile and DDP); nothing here."""

    def keep_grads(self, raw_model, graphs):
        """The grads in one flat buffer of their own, summed over the micro-batches there
        (kept_grads.KeptGrads; graphs: the step runs as CUDA graphs)."""
        self.kept = KeptGrads(raw_model, by_grad=graphs)

    def sync_at_step(self, raw_model, graphs):
        """Sum the ranks' grads once a step, after the last micro-step's backward, instead of
        in DDP's buckets (grad_sync "step"): what lets the step run as CUDA graphs under
        torchrun. The default DDP (ddp_compile="model") does not overlap its all-reduce with
        the compiled backward either (bench/RESULTS.md#ddp-compile-order). No DDP module then:
        rank 0's weights go to every rank, as DDP's wrap does, and the grads are kept in one
        flat buffer that step() all-reduces."""
        for t in itertools.chain(raw_model.parameters(), raw_model.buffers()):
            dist.broadcast(t.detach(), src=0)
        self.wraps_in_ddp, self.summed = False, True
        self.keep_grads(raw_model, graphs)
        self.notes.append("grads summed across ranks once a step, after the backward (grad_sync)")

    def make_optimizer(self, raw_model, cfg, device):
        return build_optimizer(raw_model, cfg, device)

    def micro_step(self, train_model, raw_model, sync):
        """The context of one micro-step's forward; sync: reduce the grads in this backward (the
        last micro-step). DDP: no_sync() on the others; nothing to do with the grads summed at
        the step."""
        if sync or self.summed:
            return contextlib.nullcontext()
        return train_model.no_sync()

    def backward(self, loss, first):
        """One micro-step's backward; first: the step's first (kept grads start again there)."""
        if self.kept is None:
            loss.backward()
        else:
            self.kept.backward(loss, first)

    def step(self, optimizer, raw_model, max_norm, scaler=None):
        """Clip to max_norm by the global grad norm, update; returns that norm (device scalar).
        With sync_at_step's buffer, the ranks' mean grads first (as DDP's). scaler: fp16's loss
        scale (optim.clipped_step), or None."""
        if self.summed:
            flat = self.kept.flat
            if dist.get_backend() == "nccl":
                dist.all_reduce(flat, op=dist.ReduceOp.AVG)
            else:  # gloo has no AVG
                dist.all_reduce(flat)
                flat.div_(dist.get_world_size())
        return clipped_step(optimizer, raw_model.parameters(), max_norm, scaler)

    def zero_grad(self, optimizer):
        """After the update: kept grads made ready for the next step (KeptGrads.zero), others
        set to None."""
        if self.kept is not None:
            self.kept.zero()
        else:
            optimizer.zero_grad(set_to_none=True)

    def full_state(self, raw_model, optimizer, master):
        """(model state dict, optimizer state dict) as a single process has them, on rank 0;
        (None, None) elsewhere. Every rank must call it: it may gather."""
        return (raw_model.state_dict(), optimizer.state_dict()) if master else (None, None)

    def load_state(self, raw_model, optimizer, ckpt):
        """Load a checkpoint's full model and optimizer state (any mode's, any world size); each
        rank keeps its own part."""
        raw_model.load_state_dict(ckpt["model"])
        load_optimizer_state(optimizer, ckpt["optimizer"])  # ZeRO: this rank's part


def _needs_torchrun(cfg, procs):
    if not procs.ddp:
        raise ConfigError(
            f"shard={cfg.shard!r} needs a process group: run it under torchrun (one GPU: "
            "torchrun --standalone --nproc_per_node=1 train.py ...)"
        )


class ZeRO1(DataParallel):
    """shard="optimizer": DDP's all-reduce, each rank the AdamW state of its own parameters."""

    name = "optimizer"

    def __init__(self, cfg, procs):
        super().__init__(cfg, procs)
        _needs_torchrun(cfg, procs)

    def make_optimizer(self, raw_model, cfg, device):
        """ZeroRedundancyOptimizer around the run's AdamW (the Triton one included: it sees only
        this rank's parameters) or Muon (each rank orthogonalises its own matrices alone)."""
        cls, groups, kw = optimizer_parts(raw_model, cfg, device)
        if cls is Muon:
            kw["share_across_ranks"] = False
        _count_parameters_by_their_own_bytes()
        # parameters as views into one bucket per rank: one broadcast per rank, not per tensor
        # (580 at 1558M); the weights move into the buckets, no copy is kept
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=cls, parameters_as_bucket_view=True, **kw
        )

    def full_state(self, raw_model, optimizer, master):
        optimizer.consolidate_state_dict(to=0)  # each rank's part to rank 0, in CPU memory
        if not master:
            return None, None
        state = optimizer.state_dict()
        optimizer._all_state_dicts = []  # that CPU copy: 8 B/param of host memory until the next
        return raw_model.state_dict(), state


class FSDP2(DataParallel):
    """shard="full": fully_shard on each Block, then on the root; no DDP."""

    name = "full"
    wraps_in_ddp = False
    samples = False  # generate() reads the weights outside any FSDP2 forward
    fully_sharded = True

    def __init__(self, cfg, procs):
        super().__init__(cfg, procs)
        _needs_torchrun(cfg, procs)
        if procs.device.type == "cuda" and cfg.adamw_impl == "fast" and cfg.optimizer == "adamw":
            raise ConfigError(
                "shard='full' with adamw_impl='fast': the Triton AdamW addresses plain tensors, "
                "FSDP2's parameters are DTensor shards; pass --adamw_impl=torch (torch's fused "
                "AdamW)"
            )
        if cfg.hellaswag:
            raise ConfigError(
                "hellaswag=True with shard='full': an FSDP2 forward is collective and the ranks "
                "score different numbers of examples; score a checkpoint with eval_hellaswag.py "
                "instead"
            )
        if cfg.ddp_compile == "ddp":
            raise ConfigError(
                "ddp_compile='ddp' with shard='full': FSDP2 has no DDP module to compile"
            )
        if cfg.sample_interval > 0:
            self.notes = ["shard='full': no samples in training (sample.py reads checkpoints)"]

    def shard_model(self, raw_model):
        """FSDP2 on each Block, then on the root model, in place (raw_model's parameters become
        DTensor shards). The root holds wte, which is lm_head (one Parameter): its pre-forward
        gathers it, so the loss inside GPT.forward reads the full, current weight."""
        fp8.gather_in_float8(raw_model)  # tensorwise: torchao's wrappers, before all else
        # each rank initialised its own weights (seed + rank) and FSDP2 keeps the slice it finds:
        # rank 0's go to every rank first, as DDP does when it wraps the model
        for t in itertools.chain(raw_model.parameters(), raw_model.buffers()):
            dist.broadcast(t.detach(), src=0)
        # At world size 1 (torch 2.13, read, measured on CPU only) FSDP2 skips the all-gather
        # but copies each parameter into its unsharded tensor (one copy per tensor) at every
        # unshard: in the forward, and again in the backward for the resharded blocks; its
        # reduce-scatter still packs the grads (chunk_cat) per group; its hooks are eager Python
        # per module (a torch.compile of the root runs 13 graphs, cut at each Block, as many as
        # DDP's 14); the clip and the fused AdamW dispatch over DTensors (on CPU ~2.5x their
        # plain-tensor time). reshard_after_forward=False on every block would drop the
        # backward's copies at 4 B/param of gathered weights held from forward to backward (the
        # memory FSDP2 is there to save)
        blocks = raw_model.transformer.h
        for i, block in enumerate(blocks):
            # the last block's backward comes right after its forward: keep it gathered between
            fully_shard(block, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(raw_model)

    def micro_step(self, train_model, raw_model, sync):
        """FSDP2 reads its flag in the backward, so it is set here and stays until the next
        micro-step sets it (the grads accumulate unsharded meanwhile)."""
        raw_model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def step(self, optimizer, raw_model, max_norm, scaler=None):
        """clip_grad_norm_ over the DTensor grads all-reduces the shards' squared sums; the
        in-place clip reads only this rank's 1/W of the grads. No loss scale: float16 is refused
        with shard='full' (loss_scale.LossScaler.for_run)."""
        norm = torch.nn.utils.clip_grad_norm_(list(raw_model.parameters()), max_norm)
        optimizer.step()
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        fp8.after_optimizer_step(raw_model)  # the float8 all-gather's scales, of the new weights
        return norm

    def full_state(self, raw_model, optimizer, master):
        """CPU tensors on rank 0."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(raw_model, options=opts)
        state = get_optimizer_state_dict(raw_model, optimizer, options=opts)
        if not master:
            return None, None
        model["lm_head.weight"] = model["transformer.wte.weight"]  # tied: one tensor, saved once
        # at world size 1 the float8 all-gather's wrappers stay: plain tensors for the checkpoint
        model = fp8.plain_state_dict(model)
        return model, _by_index(state)

    def load_state(self, raw_model, optimizer, ckpt):
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(raw_model, ckpt["model"], options=opts)
        state = _by_name(ckpt["optimizer"], raw_model, optimizer)
        load_optimizer_state(
            optimizer,
            state,
            load=lambda s: set_optimizer_state_dict(raw_model, optimizer, s, options=opts),
        )


def _count_parameters_by_their_own_bytes():
    """Make torch.compile's DDP graph splitter (Dynamo's DDPOptimizer, which cuts the compiled
    graph where DDP's 25 MB gradient buckets end, for comm/compute overlap) count a parameter's
    own bytes, not its storage's. It adds `param.untyped_storage().nbytes()`: for ZeRO's bucket
    views that is the whole bucket (495 MB at 124M), so every parameter overflowed a bucket and
    the graph was cut at nearly every parameter: 76 subgraphs at 124M instead of DDP's 14, 292
    at 1558M instead of 146 (each a separate Inductor graph: fusions lost at the cuts, more
    launches, a compiled-function call and autograd node per cut). With the correction the cuts
    are DDP's exactly. For a parameter with storage of its own the correction is 0, so the
    patch (process-wide, applied once) changes nothing outside ZeRO-1; without DDPOptimizer's
    add_param (another torch) it does nothing."""
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError:
        return
    counted = getattr(DDPOptimizer, "add_param", None)
    if counted is None or getattr(counted, "_own_bytes", False):
        return

    def add_param(self, bucket, param, name):
        counted(self, bucket, param, name)
        bucket.size -= param.untyped_storage().nbytes() - param.numel() * param.element_size()

    add_param._own_bytes = True
    DDPOptimizer.add_param = add_param


def _by_index(state):
    """torch.distributed.checkpoint's optimizer state, keyed by parameter name, in torch's own
    layout: ids 0, 1, ... in param-group order, as optimizer.state_dict() writes it."""
    names = [n for g in state["param_groups"] for n in g["params"]]
    return _rekeyed(state, {n: i for i, n in enumerate(names)})


def _by_name(state, raw_model, optimizer):
    """The inverse of _by_index for this optimizer: ids to the names of its parameters."""
    name = {p: n for n, p in raw_model.named_parameters()}
    return _rekeyed(
        state, dict(enumerate(name[p] for g in optimizer.param_groups for p in g["params"]))
    )


def _rekeyed(state, key):
    """An optimizer state dict with each parameter's key (id or name) mapped through `key`."""
    groups = [dict(g, params=[key[k] for k in g["params"]]) for g in state["param_groups"]]
    return {"state": {key[k]: s for k, s in state["state"].items()}, "param_groups": groups}


def state_bytes(optimizer):
    """Bytes of the tensors in this rank's optimizer state, each storage counted once: a
    ZeroRedundancyOptimizer's local optimizer (and its own state, empty unless something kept a
    copy there), the local shards of DTensors."""
    states = [optimizer.state]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        states.append(optimizer.optim.state)
    seen, total = set(), 0
    for per_param in (s for st in states for s in st.values() if s):
        for v in per_param.values():
            if not isinstance(v, torch.Tensor):
                continue
            t = v.to_local() if isinstance(v, DTensor) else v
            if t.numel() and t.data_ptr() not in seen:  # MultiTensorAdamW shares one step
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def report_state(optimizer, procs, print0):
    """Print every rank's optimizer-state size, measured (after the run: AdamW makes its state
    lazily)."""
    mine, sizes = state_bytes(optimizer), [None] * procs.world_size
    if procs.ddp:
        dist.all_gather_object(sizes, mine)
    else:
        sizes = [mine]
    print0("optimizer state by rank (bytes): " + " | ".join(f"{n:,}" for n in sizes))
