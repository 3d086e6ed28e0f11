"""Train a GPT-2 on token shards, on one CPU/GPU or many GPUs under torchrun.

    python train.py                                   # small model on the embedded data (CPU ok)
    python train.py configs/gpt2_124m_fineweb.py --batch_size=32 --resume
    python train.py configs/finetune_gpt2.py          # from GPT-2's weights (--init_from)
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb.py

Settings are the fields of `TrainConfig` (gpt2_fused/training/config.py) and of the model's
`GPTConfig` nested in it; a config file (Python, run with runpy: `name = value` lines) sets some
of them, then `--name=value` or `--name value` arguments override (Python literals;
training/cli.py). Checkpoints go to out_dir/ckpt_{step:07d}.pt; `--resume` continues from the newest
one, with its model.
"""

import contextlib
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data import hellaswag
from data.loader import DataLoader, iter_val_batches, open_data
from data.shards import DataError
from data.tokenizer import EOT, get_tokenizer
from gpt2_fused.training import (
    compile_cache,
    data_parallel,
    distributed,
    fp8,
    memory,
    plot,
    start,
    weight_casts,
)
from gpt2_fused.training.checkpoint import CheckpointError, newest_note, rng_state, save_checkpoint
from gpt2_fused.training.compile_guard import check_training_step, compiled_loss_mismatch
from gpt2_fused.training.compile_settings import compiler_settings, pick_mode, uses_cuda_graphs
from gpt2_fused.training.config import (
    ConfigError,
    TrainConfig,
    help_text,
    load_config,
    tokens_per_step,
)
from gpt2_fused.training.errors import run_main
from gpt2_fused.training.generate import generate
from gpt2_fused.training.hardware import fast_path_notes, peak_flops, resolve_dtype
from gpt2_fused.training.loss_scale import LossScaler
from gpt2_fused.training.optim import get_lr
from gpt2_fused.training.runlog import (
    LogError,
    RunLog,
    StepLog,
    StepStats,
    device_name,
    print_start,
)
from gpt2_fused.training.signals import StopFlag
from model import GPT

# errors the user can fix: one line (gpt2_fused/training/errors.py; GPT2_DEBUG=1: a traceback)
USER_ERRORS = {
    ConfigError: "config error",
    DataError: "data error",
    CheckpointError: "checkpoint error",
    LogError: "log error",
}


@dataclass
class Run:
    """What the loop's helpers share, set up once by main()."""

    cfg: TrainConfig
    procs: distributed.Processes
    raw_model: GPT  # the module itself: its state_dict has no compile/DDP prefixes
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    val_glob: str
    dtype: torch.dtype  # of the matmuls: bf16 or fp16 under autocast, else fp32
    print0: callable
    shard: data_parallel.DataParallel  # the sharding mode's object: DDP, ZeRO-1 or FSDP2
    scaler: LossScaler  # fp16's loss scale; disabled in other dtypes
    model: torch.nn.Module = None  # evaluates: compiled, or raw_model once a compiled graph failed
    train_model: torch.nn.Module = None  # model, in DDP under torchrun

    @property
    def autocast(self):
        # fp32 weights and optimizer state, bf16 matmuls (bench/RESULTS.md#precision)
        return torch.autocast(self.procs.device.type, self.dtype, self.dtype != torch.float32)


def every(step, interval):
    return interval > 0 and step % interval == 0


def evaluate(run, model):
    """The mean val loss over cfg.val_tokens. A compiled model's (no-grad) graph is checked on the
    first batch against raw_model's; a wrong one is replaced by raw_model (run.model) for the
    rest of the run."""
    cfg, procs, raw_model = run.cfg, run.procs, run.raw_model
    check = cfg.check_compile and model is not raw_model
    device = procs.device
    model.eval()
    total, count, eager = torch.zeros((), device=device), 0, None
    B, T = cfg.batch_size, cfg.model.block_size
    batches = iter_val_batches(
        run.val_glob, B, T, procs.rank, procs.world_size, cfg.val_tokens, device
    )
    with torch.no_grad(), run.autocast:
        for x, y in batches:
            loss = model(x, y)  # eval mode: plain cross-entropy, comparable between runs
            if check and count == 0:  # raw_model is in eval mode with model
                first, eager = loss.clone(), raw_model(x, y)  # clone: CUDA-graph outputs
            total += loss
            count += 1
    model.train()
    if eager is not None:
        wrong = compiled_loss_mismatch(first, eager, procs.ddp, "first validation batch")
        if wrong:
            run.print0(f"warning: {wrong}; validation runs in eager mode from now on")
            run.model = raw_model
            return evaluate(run, raw_model)
    stats = torch.stack([total, torch.tensor(float(count), device=device)])
    if procs.ddp:
        dist.all_reduce(stats)  # every rank has the same number of batches
    return (stats[0] / stats[1]).item()


def save(run, step, val_loss):
    """Write a training checkpoint (rank 0), with every rank's RNG so that a resume restores
    all of them (dropout masks differ by rank)."""
    cfg, procs = run.cfg, run.procs
    rngs = [rng_state(procs.device)]
    if procs.ddp:
        rngs = [None] * procs.world_size
        dist.all_gather_object(rngs, rng_state(procs.device))
    model, state = run.shard.full_state(run.raw_model, run.optimizer, procs.master)
    if not procs.master:
        return
    ckpt = {
        "model": model,
        "model_config": asdict(cfg.model),
        "train_config": asdict(cfg),
        "optimizer": state,
        "step": step,
        "loader": run.loader.state_dict(),  # the same on every rank
        "rng": {k: [r[k] for r in rngs] for k in rngs[0]},  # lists by rank
        "val_loss": val_loss,
        **run.scaler.checkpoint(),  # fp16's loss scale, else nothing
    }
    t0 = time.perf_counter()
    path = save_checkpoint(ckpt, cfg.out_dir, step, cfg.keep_last)
    mb, dt = os.path.getsize(path) / 1e6, time.perf_counter() - t0
    run.print0(f"saved {path} ({mb:,.1f} MB in {dt:.1f} s)")  # a stop's time is mostly this


def sample_text(run, step):
    """Text generated after an EOT prompt, with its own generator so that sampling never moves
    the training RNG (a resumed run would diverge otherwise)."""
    raw_model, device = run.raw_model, run.procs.device
    gen = torch.Generator(device=device).manual_seed(run.cfg.seed + step)
    prompt = EOT if EOT < run.cfg.model.vocab_size else 0  # a small test vocabulary has no EOT
    idx = torch.full((1, 1), prompt, dtype=torch.long, device=device)
    raw_model.eval()
    with torch.no_grad(), run.autocast:
        out = generate(raw_model, idx, run.cfg.sample_tokens, top_k=200, generator=gen)
    raw_model.train()
    return get_tokenizer().decode(out[0, 1:].tolist())


def compile_and_wrap(run, use_compile, grad_accum):
    """Set run.model, the (compiled) model that evaluates, and run.train_model, the one that
    trains (in DDP under torchrun; ddp_compile="ddp" compiles the DDP module, one module for
    both; FSDP2 has sharded raw_model already: no DDP). The grads get a flat buffer of their own
    (shard.keep_grads) under CUDA graphs with several micro-batches a step, and under torchrun
    when the step sums them (grad_sync; no DDP then); under graphs with one micro-batch, each
    step's grads are the backward graph's outputs, set to None before the next
    (RESULTS.md#cuda-graphs)."""
    cfg, procs, raw_model = run.cfg, run.procs, run.raw_model
    compiled = functools.partial(torch.compile, mode=cfg.compile_mode)
    graphs = use_compile and uses_cuda_graphs(cfg.compile_mode)
    if data_parallel.sums_at_step(cfg, procs, graphs):
        run.shard.sync_at_step(raw_model, graphs)  # keeps the grads itself
    elif graphs and grad_accum > 1:
        run.shard.keep_grads(raw_model, graphs)
    # gradients as views into DDP's all-reduce buckets: one copy of them, not two
    wrap = functools.partial(
        DDP,
        device_ids=[procs.device.index] if procs.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    ddp = procs.ddp and run.shard.wraps_in_ddp
    if ddp and use_compile and cfg.ddp_compile == "ddp":
        run.model = run.train_model = compiled(wrap(raw_model))
        return
    run.model = compiled(raw_model) if use_compile else raw_model
    run.train_model = wrap(run.model) if ddp else run.model


def train_step(run, step, grad_accum, stop, check):
    """One optimizer step over grad_accum micro-batches; returns its StepStats (read later).
    check: compare the first micro-batch's compiled loss with eager mode's before the update
    (gpt2_fused/training/compile_guard.py)."""
    cfg, procs, optimizer = run.cfg, run.procs, run.optimizer
    device, ddp = procs.device, procs.ddp
    lr = get_lr(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's matrices: muon_lr's schedule
    st = StepStats(device, step, lr)
    loss_sum = torch.zeros((), device=device)
    for micro in range(grad_accum):
        try:
            x, y = run.loader.next_batch()
        except DataError as e:  # a later shard's token ids, checked as it is opened
            note = f"stopped at step {step} without saving; {newest_note(cfg.out_dir)}"
            raise DataError(f"{e}; {note}") from e
        sync = not ddp or micro == grad_accum - 1  # reduce grads once per step
        checking = check and micro == 0
        if checking:  # eager first: no activations held yet
            with torch.no_grad(), run.autocast:
                eager_loss = run.raw_model(x, y)
        with run.shard.micro_step(run.train_model, run.raw_model, sync), run.autocast:
            loss = run.train_model(x, y) / grad_accum
        if checking:
            first_loss = loss.detach() * grad_accum
        run.shard.backward(run.scaler.scaled(loss), first=micro == 0)
        loss_sum += loss.detach()
    if check:  # before the update: a wrong graph must not touch the weights
        check_training_step(first_loss, eager_loss, ddp, step)
    norm = run.shard.step(optimizer, run.raw_model, cfg.grad_clip or float("inf"), run.scaler)
    run.shard.zero_grad(optimizer)
    # torch.full, not torch.tensor: a host-to-device copy of a Python number would sync
    stats = torch.stack([loss_sum, torch.full((), float(stop.requested), device=device)])
    if ddp:
        dist.all_reduce(stats)  # loss summed over ranks; a stop on any rank stops all
    st.finish(torch.cat([stats, torch.stack([norm.float(), *run.scaler.stats()])]))
    run.scaler.update()
    return st


def evaluate_and_log(run, step, run_log):
    """Validation (and HellaSwag when asked) at `step`: printed, logged, and returned."""
    cfg, procs = run.cfg, run.procs
    val_loss = evaluate(run, run.model)
    rec, msg = {"step": step, "val_loss": val_loss}, f"val loss {val_loss:.6f}"
    if cfg.hellaswag:  # raw_model: varying row lengths would recompile a compiled one
        low = None if run.dtype == torch.float32 else run.dtype  # autocast's
        path = cfg.hellaswag_path or str(hellaswag.DEFAULT_PATH)
        hs = hellaswag.evaluate(
            run.raw_model, path, procs.device, procs.rank, procs.world_size, autocast_dtype=low
        )
        rec["hellaswag_acc_norm"] = hs["acc_norm"]
        msg += f" | hellaswag acc_norm {hs['acc_norm']:.4f}"
    run.print0(f"step {step:6d}/{cfg.max_steps} | {msg}")
    run_log.write(rec)
    return val_loss


def main(argv=None, train_loader=DataLoader):
    """train_loader: the training batches' source, called like DataLoader (bench/parity.py
    passes a reference sampler)."""
    launched = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text(__doc__, [a for a in argv if a not in ("-h", "--help")]))
        return
    cfg = load_config(argv)
    try:
        procs = distributed.setup(cfg.device)
    except ValueError as e:
        raise ConfigError(f"config key 'device': {e}") from None
    device, rank, world_size = procs.device, procs.rank, procs.world_size
    print0 = distributed.printer(procs)
    run_log, stop, finished = RunLog(), StopFlag(announce=procs.master), False
    compile_settings = contextlib.ExitStack()  # Inductor's global settings, for this run only
    try:  # the model's settings from the checkpoint resumed or the weights of init_from
        begin = start.find(cfg, procs, print0)
        cfg = begin.cfg
        shard = data_parallel.mode(cfg, procs)  # a combination that does not run stops here
        notes = shard.notes  # the start-up report's (shard.sync_at_step adds to it too)
        notes += begin.notes
        T = cfg.model.block_size
        try:  # the GPU, torch and torchao run the model's FP8 GEMMs (nothing for fp8="off")
            notes += fp8.check(cfg.model.fp8, device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # --- set-up: model, optimizer, micro-batch, data, the newest checkpoint when resuming
        card = memory.apply_cap(device)  # GPT2_FUSED_GPU_GB: a smaller card, simulated
        dtype = resolve_dtype(cfg.dtype, device)
        scaler = LossScaler.for_run(cfg, dtype, device)  # fp16's; a ConfigError where it cannot
        use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
        torch.manual_seed(cfg.seed + rank)  # per rank, so dropout masks differ across ranks
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        hs_path = cfg.hellaswag_path or str(hellaswag.DEFAULT_PATH)
        if cfg.hellaswag and not os.path.isfile(hs_path):
            raise ConfigError(
                f"hellaswag=True but {hs_path} is missing: run python -m data.hellaswag download"
            )
        with torch.device(device):  # initialised where it runs: 1558M on a CPU takes seconds
            raw_model = GPT(cfg.model)  # its blocks as cfg.model.fp8 says
        begin.load_weights(raw_model)  # init_from's, before sharding wraps the Linears
        raw_model.z_loss = cfg.z_loss  # in training-mode losses only: val stays plain CE
        shard.shard_model(raw_model)  # FSDP2 under shard="full", in place
        optimizer = shard.make_optimizer(raw_model, cfg, device)
        notes += memory.pick_batch(cfg, procs, raw_model, optimizer, dtype, card)
        tokens, grad_accum = tokens_per_step(cfg, world_size)
        per_layer = raw_model.flops_per_token() * cfg.batch_size * T / cfg.model.n_layer
        bucketed = procs.ddp and not data_parallel.graphs_fit(cfg)  # DDP's or FSDP2's all-reduces
        cfg.compile_mode = pick_mode(cfg.compile_mode, device, bucketed, per_layer)  # "auto"
        loader, train_glob, val_glob = open_data(cfg, train_loader, procs)
        run = Run(cfg, procs, raw_model, optimizer, loader, val_glob, dtype, print0, shard, scaler)
        start_step = 0
        if train_loader is not DataLoader:
            notes.append(f"train batches from {train_loader.__name__}, not data.loader.DataLoader")
        if begin.ckpt is not None:
            start_step = start.resume(run, begin, notes)
            if start_step >= cfg.max_steps:
                print0(
                    f"{begin.path}: the run finished at step {start_step} (max_steps="
                    f"{cfg.max_steps}), nothing to train; a larger --max_steps trains on "
                    "(the learning-rate schedule then follows the new max_steps)"
                )
                finished = True
                return
        if use_compile:  # compilation is lazy (first step, first eval): patched until the end
            compile_cache.use_keyed_cache()  # not another version's custom-op graphs
            compile_settings.enter_context(compiler_settings(cfg))
        compile_and_wrap(run, use_compile, grad_accum)
        # last: the weights as resumed, broadcast (FP8's GEMMs cast the weights themselves)
        if cfg.model.fp8 == "off" and not shard.fully_sharded:
            weight_casts.attach(raw_model, optimizer, dtype)

        flops_per_step = raw_model.flops_per_token() * tokens
        notes += fast_path_notes(cfg, device, dtype)
        if procs.master:
            compile_mode = cfg.compile_mode if use_compile else False
            globs = (train_glob, val_glob)
            print_start(cfg, procs, raw_model, dtype, compile_mode, globs, notes)
            run_log.open(cfg, start_step, ConfigError)
        meter = dict(tokens=tokens, flops=flops_per_step, launched=launched)
        meter.update(first=start_step, peak=peak_flops(device_name(device), dtype))
        meter.update(compiled=use_compile and cfg.compile_mode)
        steps = StepLog(run_log, print0, cfg, world_size=world_size, **meter)
        check_training = use_compile and cfg.check_compile and cfg.model.dropout == 0.0
        if use_compile and cfg.check_compile and not check_training:
            print0("check_compile: skipped, dropout > 0 makes eager and compiled losses differ")
        stop.install()
        loop(run, start_step, grad_accum, stop, steps, run_log, check_training)

        # --- teardown
        data_parallel.report_state(optimizer, procs, print0)
        if device.type == "cuda":
            gib = torch.cuda.max_memory_allocated(device) / 2**30
            print0(f"peak GPU memory allocated: {gib:.2f} GiB" + (" (rank 0)" if procs.ddp else ""))
        if procs.master:  # out_dir/loss.png when matplotlib is installed, else how to draw it
            print0(plot.loss_curve(cfg.out_dir))
        finished = True
    except torch.OutOfMemoryError as e:  # mid-step: no checkpoint is safe to write
        raise SystemExit(memory.stop_line(e, cfg, "training")) from None
    finally:
        compile_settings.close()
        stop.restore()
        run_log.close()
        # under DDP every rank is done, rank 0's last checkpoint included, before the group goes
        distributed.teardown(procs, finished)


def loop(run, start_step, grad_accum, stop, steps, run_log, check_training):
    """llm.c's loop: evaluation, samples and checkpoints at the top of an iteration, so that they
    follow the last step too. stop_all: stop after this step. A process reads its own flag; under
    DDP the ranks agree through the flag in each step's all-reduce, read one step late."""
    cfg, procs = run.cfg, run.procs
    stop_all, val_loss = False, None
    check_now = check_training  # the first step, then the step after each evaluation
    for step in range(start_step, cfg.max_steps + 1):
        last_step = step == cfg.max_steps
        stop_all = stop_all or (stop.requested and not procs.ddp)
        fresh = step > start_step or start_step == 0  # a resumed run did its first top
        intervals = (cfg.eval_interval, cfg.sample_interval, cfg.ckpt_interval)
        # the same on every rank: all of them read the same steps at the same points
        if last_step or stop_all or any(every(step, k) for k in intervals):
            stop_all = steps.flush() or stop_all  # before any eval or checkpoint
        keep = None if procs.ddp or step == 0 else functools.partial(save, run, step, None)
        if fresh and (last_step or every(step, cfg.eval_interval)):
            with memory.stop_on_oom(cfg, "evaluation", keep):
                val_loss = evaluate_and_log(run, step, run_log)
            check_now = check_training
        sample = every(step, cfg.sample_interval) and run.shard.samples
        if procs.master and fresh and step > 0 and sample:
            with memory.stop_on_oom(cfg, "sampling", keep):
                run.print0(f"sample at step {step}: {sample_text(run, step)!r}")
        if fresh and step > 0 and (last_step or stop_all or every(step, cfg.ckpt_interval)):
            save(run, step, val_loss)
        if last_step or stop_all:
            break
        st = train_step(run, step, grad_accum, stop, check_now)
        check_now = False
        stop_all = steps.push(st) or stop_all  # this step is queued: read the previous one


if __name__ == "__main__":
    run_main(main, USER_ERRORS)
    distributed.exit_if_launched()
