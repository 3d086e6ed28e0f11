"""The GPU memory a run may use: the card (or a cap that stands in for a smaller one), the
micro-batch that fits it (batch_size="auto"), and the one line an out-of-memory error ends with.

Cap: GPT2_FUSED_GPU_GB=24 in the environment limits this process's CUDA allocator to 24 GiB
(torch.cuda.set_per_process_memory_fraction, set once at start-up), so that an 80 GB card
trains as a 24 GB one would; train.py, bench/memory_fit.py and the tests use it. The CUDA
context (~0.5 GiB) lies outside the allocator's count, on a real card as under the cap.

batch_size="auto" (the default) picks the micro-batch on CUDA by a measured probe, not a memory
model: the fast paths' own buffers (the fused loss's chunks, cuBLASLt workspaces, FP8 scales,
FSDP2's gathers) would each need a term, and a probe measures what this torch does on this card.
Each rung of LADDER that total_batch_size allows (B * T * world_size must divide it; 0, one
micro-batch a step, allows all) is tried from the top: one eager forward and backward of the
run's own model on random tokens, with the allocator limited to the budget (the card or cap less
HEADROOM), so a rung that does not fit stops at its first allocation past the budget (an
OutOfMemoryError, caught; its memory released; the next rung). The first that fits is the pick.
Counted besides the activations:
- the AdamW moments (8 B per local parameter; AdamW makes them at the first step): a placeholder
  of their size is held through the probe;
- the grads: the probe's backward makes them (as DDP's buckets hold them later);
- under CUDA graphs with kept grads (kept_grads.KeptGrads, by_grad): their flat buffer, 4 B
  per parameter more, held as a placeholder too;
- the weights' casts to bf16 that weight_casts.py keeps: the eager forward makes its own casts
  of the same weights and holds them for the backward, as many bytes at the peak.
Eager, because a compile per rung would cost minutes; Inductor keeps no more activations than
eager mode (it recomputes cheap pointwise ones, more so with activation_memory_budget < 1), so
the compiled step fits where the probe did. HEADROOM covers what the probe does not run:
CUDA graphs' pool, evaluation (no grad), sampling (batch 1), checkpoint writes (to host memory).
bench/memory_fit.py checks the picks against compiled runs under each cap.

The probe leaves the run as it found it: the RNG states are forked (dropout draws), the FP8
amax slots restored, the grads dropped, no optimizer step is taken; so an auto run equals the
run with the picked --batch_size given (and a resume stays bit-identical). Under torchrun every
rank probes the same rung and the ranks agree on each verdict (all_reduce MIN), so all pick the
same; under shard="full" the probe's forward gathers across ranks: the ranks must have the same
free memory (one kind of card), else pass --batch_size. On a CPU auto is CPU_BATCH, with no
probe. When micro-batch 1 does not fit, the run stops at start-up naming what would make it fit.
"""

import contextlib
import gc
import math
import os
import re

import torch
import torch.distributed as dist

from gpt2_fused.training.checkpoint import newest_note
from gpt2_fused.training.compile_settings import pick_mode, uses_cuda_graphs
from gpt2_fused.training.config import ConfigError
from gpt2_fused.training.data_parallel import graphs_fit, sums_at_step
from gpt2_fused.training.optim import local_optimizer

CAP_ENV = "GPT2_FUSED_GPU_GB"
LADDER = (64, 32, 16, 8, 4, 2, 1)
CPU_BATCH = 8  # auto on a CPU: the default before "auto", so a CPU run is unchanged
# of the usable memory: what the probed step may not take, left for what the probe does not
# run (CUDA graphs' pool, evaluation, sampling); bench/memory_fit.py checks it
HEADROOM = 0.10
GiB = 2**30


def parse_cap(text):
    """GPT2_FUSED_GPU_GB's value -> bytes (None: unset or empty, the whole card); ConfigError
    for anything but a positive number of GiB."""
    if text is None or not text.strip():
        return None
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ConfigError(
            f"{CAP_ENV}={text!r}: give the GiB of GPU memory to use, e.g. {CAP_ENV}=24 "
            "(unset: the whole card)"
        )
    return int(gib * GiB)


class Card:
    """The GPU's memory in bytes (total_memory as torch reports it), the cap, if any, and what
    was free to this process at start-up (None: not read): other processes (a desktop, a second
    run) hold the rest, so the pick must not count on it."""

    def __init__(self, total, cap=None, free=None):
        self.total, self.cap, self.free = total, cap, free

    @property
    def usable(self):
        return min(self.cap or self.total, self.free or self.total)

    @property
    def budget(self):
        """Bytes the training step may reach: the usable memory less HEADROOM."""
        return int(self.usable * (1 - HEADROOM))

    def __str__(self):
        card = f"{self.total / GiB:.1f} GiB card"
        if self.free is not None and self.free < 0.95 * (self.cap or self.total):
            card += f", {self.free / GiB:.1f} GiB of it free"
        return f"{self.cap / GiB:.1f} GiB cap of a {card}" if self.cap else card

    def limit(self, nbytes):
        """The allocator's limit for this process (device: the current one)."""
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / self.total))


def apply_cap(device):
    """The run's Card, its cap (GPT2_FUSED_GPU_GB) applied to the allocator; None on a CPU (the
    variable is still checked)."""
    cap = parse_cap(os.environ.get(CAP_ENV))
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    card = Card(total, cap, free + torch.cuda.memory_reserved(device))
    if cap is not None and cap > card.total:
        raise ConfigError(
            f"{CAP_ENV}={os.environ[CAP_ENV]} is more than the {card}: give less, or unset it"
        )
    card.limit(card.usable)
    return card


def allowed_rungs(total_batch_size, T, world_size, fp8=False):
    """The rungs of LADDER that total_batch_size allows (B * T * world_size divides it; 0 allows
    all), and with fp8 those whose B * T is a multiple of 16 (torch._scaled_mm); ConfigError if
    none is left."""
    rungs = [
        b
        for b in LADDER
        if (total_batch_size == 0 or total_batch_size % (b * T * world_size) == 0)
        and not (fp8 and b * T % 16)
    ]
    if not rungs:
        raise ConfigError(
            f"batch_size='auto': no micro-batch of {LADDER} gives a multiple of "
            f"total_batch_size={total_batch_size} (B * T {T} * world_size {world_size}): pass a "
            f"total_batch_size that is a multiple of {T * world_size}, or --batch_size"
        )
    return rungs


def first_fitting(rungs, fits):
    """The first rung for which fits(rung) is true (they go largest first), or None."""
    return next((b for b in rungs if fits(b)), None)


def try_rung(step, B):
    """Whether step(B) runs without an OutOfMemoryError; what it allocated is released either
    way (the error's frames go with it, then the allocator's cache)."""
    try:
        step(B)
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    if torch.cuda.is_available():  # (the tensors went with the frames, by reference counts)
        gc.collect()
        torch.cuda.empty_cache()
    return ok


def state_bytes(model, optimizer):
    """(parameter count, parameter bytes, AdamW moment bytes) on this rank: local shards under
    FSDP2, the moments of this rank's parameters under ZeRO-1."""

    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    mine = [local(p) for p in model.parameters()]
    owned = [local(p) for g in local_optimizer(optimizer).param_groups for p in g["params"]]
    count = sum(p.numel() for p in mine)
    return (
        count,
        sum(p.numel() * p.element_size() for p in mine),
        2 * sum(p.numel() * p.element_size() for p in owned),
    )


@contextlib.contextmanager
def unchanged(model, device):
    """Run the block with the RNG states and FP8 amax slots saved and restored after, and the
    grads dropped: what a probe may touch."""
    states = [m.fp8_state for m in model.modules() if getattr(m, "fp8_state", None) is not None]
    saved = [(s.slots.clone(), dict(s.calls)) for s in states]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        for s, (slots, calls) in zip(states, saved, strict=True):
            s.slots.copy_(slots)
            s.calls = calls
        for p in model.parameters():
            p.grad = None


def probe_step(model, cfg, dtype, hold_bytes):
    """step(B): one eager forward and backward of model on B random sequences, holding
    hold_bytes(B) more (the optimizer state and buffers the step will have)."""
    device = next(model.parameters()).device
    T, V = cfg.model.block_size, cfg.model.vocab_size
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step(B):
        gen = torch.Generator(device=device).manual_seed(0)
        idx = torch.randint(0, V, (B, T + 1), device=device, generator=gen)
        held = torch.empty(hold_bytes(B), dtype=torch.uint8, device=device)
        with autocast:
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        del held

    return step


def pick_batch(cfg, procs, model, optimizer, dtype, card):
    """cfg.batch_size set to an int: "auto" picked (module docstring), an int kept; returns the
    start-up report's lines (none for a CPU run given its batch size)."""
    T, W = cfg.model.block_size, procs.world_size
    if cfg.batch_size != "auto":
        return [] if card is None else [f"micro-batch {cfg.batch_size} (as given, {card})"]
    rungs = allowed_rungs(cfg.total_batch_size, T, W, cfg.model.fp8 != "off")
    if card is None:
        cfg.batch_size = max([b for b in rungs if b <= CPU_BATCH] or [rungs[-1]])
        return [f"micro-batch {cfg.batch_size} (auto, cpu)"]
    count, params, moments = state_bytes(model, optimizer)

    def hold(B):  # the moments, and the kept grads' buffer where the step will have one
        return moments + (params if grads_kept(cfg, procs, model, B) else 0)

    step = probe_step(model, cfg, dtype, hold)

    def fits(B):
        ok = try_rung(step, B)
        if procs.ddp:  # every rank the same verdict: the same pick, and the same next rung
            flag = torch.tensor([int(ok)], device=procs.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        return ok

    card.limit(card.budget)  # a rung past the budget fails at once, as an OOM
    try:
        with unchanged(model, procs.device):
            B = first_fitting(rungs, fits)
    finally:
        card.limit(card.usable)
    if B is None:
        raise ConfigError(refusal(cfg, card, count, params, moments, W))
    cfg.batch_size = B
    larger = [b for b in LADDER if b > B]
    if not larger:
        why = "the largest tried"
    elif B == rungs[0]:
        why = f"the largest that total_batch_size={cfg.total_batch_size} allows"
    else:
        why = f"{rungs[rungs.index(B) - 1]} needs more than {card.budget / GiB:.1f} GiB"
    return [f"micro-batch {B} (auto, {card}; {why})"]


def grads_kept(cfg, procs, model, B):
    """Whether micro-batch B's step keeps its grads in a buffer of their own beside the CUDA
    graphs' outputs (train.compile_and_wrap: graphs with grad accumulation or a sum at the step)."""
    if cfg.compile is False:
        return False
    T = cfg.model.block_size
    per_layer = model.flops_per_token() * B * T / cfg.model.n_layer
    mode = pick_mode(cfg.compile_mode, procs.device, procs.ddp and not graphs_fit(cfg), per_layer)
    graphs = uses_cuda_graphs(mode)
    accum = cfg.total_batch_size // (B * T * procs.world_size)
    return graphs and (accum > 1 or sums_at_step(cfg, procs, graphs))


def refusal(cfg, card, count, params, moments, world_size):
    """The start-up error when micro-batch 1 does not fit: what would, estimated from the bytes of
    the weights, grads and AdamW moments."""
    state = 2 * params + moments
    head = (
        f"micro-batch 1 does not fit the {card} ({card.budget / GiB:.1f} GiB for the step): "
        f"{count / 1e6:,.0f}M parameters' weights, grads and AdamW state take {state / GiB:.1f} GiB"
    )
    if state * 2 > card.budget:  # the state alone leaves too little for one sequence
        gpus = 2
        while state / gpus > card.budget / 2:
            gpus *= 2
        return (
            f"{head}; to fit, split them over {gpus} or more such GPUs: torchrun "
            f"--nproc_per_node={gpus} train.py ... --shard=full --adamw_impl=torch, or use a "
            "larger GPU"
        )
    fixes = []
    if cfg.activation_memory_budget > 0.5:
        fixes.append("--activation_memory_budget=0.5 (recomputes activations)")
    if cfg.model.fp8 == "off":
        fixes.append("--fp8=fused (compute capability 8.9+)")
    if world_size == 1 or cfg.shard == "none":
        fixes.append("torchrun --shard=optimizer over 2+ GPUs")
    return f"{head}; to fit, try {', or '.join(fixes) or 'a larger GPU'}"


def stop_line(e, cfg, what, saved=None):
    """The one line an OutOfMemoryError in `what` ends the run with (SystemExit: status 1):
    torch's own first sentence, what was saved or is intact, and the setting to lower."""
    said = re.search(r"Tried to allocate [^(]*?(?:\.\s|$)", str(e))
    cause = said.group(0).strip().rstrip(".") if said else "CUDA out of memory"
    kept = ("saved this step's checkpoint: " if saved else "") + newest_note(cfg.out_dir)
    B = cfg.batch_size
    if what == "sampling":
        n = cfg.sample_tokens
        fix = f"pass --sample_tokens={max(1, n // 2)} or --sample_interval=0"
    elif isinstance(B, int) and B > 1:
        T = cfg.model.block_size
        total = cfg.total_batch_size or B * T * int(os.environ.get("WORLD_SIZE", "1"))
        fix = (
            f"pass --batch_size={B // 2} --total_batch_size={total} (the step keeps its "
            "tokens through more gradient accumulation)"
        )
    elif B == "auto":  # before the probe: building the model itself ran out
        fix = "split the model over more GPUs: torchrun ... --shard=full --adamw_impl=torch"
    else:
        fix = "pass --activation_memory_budget=0.5, or --fp8=fused, or --shard over more GPUs"
    return f"error: out of memory in {what} ({cause}); {kept}; to go on, {fix} with --resume"


@contextlib.contextmanager
def stop_on_oom(cfg, what, save=None):
    """An OutOfMemoryError in the block ends the run with stop_line's one line. save: a
    function writing this step's checkpoint (None where that is not safe: mid-step, or under
    torchrun, where every rank would have to join), called after the allocator's cache is
    emptied."""
    failed = None
    try:
        yield
    except torch.OutOfMemoryError as e:
        failed = e
    if failed is None:
        return
    message = str(failed)
    failed = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    saved = False
    if save is not None:
        try:
            save()
            saved = True
        except torch.OutOfMemoryError:
            pass
    raise SystemExit(stop_line(message, cfg, what, saved))
