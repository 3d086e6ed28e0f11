"""Train a GPT-2 on token shards, on one CPU/GPU or many GPUs under torchrun.

    python train.py                                   # small model on the embedded data (CPU ok)
    python train.py configs/gpt2_124m_fineweb.py --batch_size=32 --resume
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb.py

Settings are the fields of `TrainConfig` (config.py); a config file (Python, run with runpy:
`name = value` lines) sets some of them, then `--name=value` arguments override (parsed as Python
literals). Checkpoints go to out_dir/ckpt_{step:07d}.pt; `--resume` continues from the newest one.
"""

import contextlib
import functools
import glob
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from core import distributed, sharding
from core.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_for_resume,
    newest_note,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from core.compile_guard import check_training_step, compiled_loss_mismatch, compiler_settings
from core.config import IMPL_KEYS, MODEL_KEYS, ConfigError, grad_accum_steps, help_text, load_config
from core.device import peak_flops, resolve_dtype
from core.errors import run_main
from core.model_io import checkpoint_settings
from core.optim import get_lr
from core.runlog import (
    LogError,
    RunLog,
    StepLog,
    StepStats,
    StopFlag,
    every,
    git_sha,
    triton_version,
)
from data import hellaswag, resolve_dataset
from data.loader import DataLoader, iter_val_batches
from data.shards import DataError, read_shard
from data.tokenizer import EOT, get_tokenizer
from model import GPT, GPTConfig

# what --resume reads from a checkpoint (save() writes these and more)
RESUME_KEYS = ("model", "model_config", "optimizer", "step", "loader", "rng")

# errors the user can fix: one line on the command line (errors.py; GPT2_DEBUG=1 for a traceback)
USER_ERRORS = {
    ConfigError: "config error",
    DataError: "data error",
    CheckpointError: "checkpoint error",
    LogError: "log error",
}


def open_data(cfg, train_loader, procs):
    """(train_loader(...), train_glob, val_glob) for cfg.dataset; a problem with the data raises
    DataError naming the file. Checked here: every shard's header, the token ids of the val
    shards and of the train shard read first (the loader checks each other one when it opens
    it), and that a step fits in each shard. One process per node goes first: "embedded" is
    prepared on first use."""
    B, T, rank, world_size = cfg.batch_size, cfg.block_size, procs.rank, procs.world_size
    try:
        if procs.local_rank == 0:
            train_glob, val_glob = resolve_dataset(cfg.dataset)
        if procs.ddp:
            dist.barrier()
        if procs.local_rank != 0:
            train_glob, val_glob = resolve_dataset(cfg.dataset)
        order = dict(shuffle=cfg.shuffle, seed=cfg.seed)
        loader = train_loader(train_glob, B, T, rank, world_size, device=procs.device, **order)
        for path in sorted(glob.glob(val_glob)):
            read_shard(path)
        val = iter_val_batches(val_glob, B, T, rank, world_size, cfg.val_tokens, procs.device)
        next(val)
    except DataError:
        raise
    except (FileNotFoundError, ValueError) as e:  # resolve_dataset's and the loader's name the file
        raise DataError(str(e)) from e
    return loader, train_glob, val_glob


def resume(cfg, path, ckpt, model_config, raw_model, optimizer, loader, procs, notes):
    """Load a checkpoint's weights, optimizer, data position and RNG; returns its step. Every
    model setting but the IMPL_KEYS (how a layer is computed) must match the checkpoint's."""
    mine, saved = asdict(model_config), checkpoint_settings(ckpt["model_config"])
    keys = sorted((set(mine) | set(saved)) - set(IMPL_KEYS))
    differ = [k for k in keys if mine.get(k) != saved.get(k)]
    if differ:
        fix = " ".join(f"--{k}={saved[k]!r}" for k in differ if k in mine and k in saved)
        raise ConfigError(
            f"model config differs from {path}'s in {differ}"
            + (f"; to resume it, pass {fix}" if fix else "")
        )
    sharding.load_state(raw_model, optimizer, ckpt, cfg.shard)  # each rank keeps its part
    note = loader.load_state_dict(ckpt["loader"])  # one position for all ranks, any W
    step = ckpt["step"]
    notes.append(f"resumed from {path} at step {step}")
    if note:  # the checkpoint's data order is not the one cfg asks for; it continues
        notes.append(note)
    if len(ckpt["rng"]["torch"]) == procs.world_size:
        set_rng_state(ckpt["rng"], procs.rank, procs.device)
    else:  # the data order still continues exactly; dropout masks cannot
        torch.manual_seed(cfg.seed + procs.rank + procs.world_size * step)
        notes.append(
            f"it was written by {len(ckpt['rng']['torch'])} ranks, not "
            f"{procs.world_size}: RNG re-seeded, the run is not bit-identical"
        )
    return step


def evaluate(model, raw_model, cfg, val_glob, autocast, procs, print0):
    """(mean val loss over cfg.val_tokens, the model to evaluate with next time). A compiled
    model's (no-grad) graph is checked on the first batch against raw_model's; a wrong one is
    replaced by raw_model for the rest of the run."""
    check = cfg.check_compile and model is not raw_model
    device = procs.device
    model.eval()
    total, count, eager = torch.zeros((), device=device), 0, None
    batches = iter_val_batches(
        val_glob,
        cfg.batch_size,
        cfg.block_size,
        procs.rank,
        procs.world_size,
        max_tokens=cfg.val_tokens,
        device=device,
    )
    with torch.no_grad(), autocast:
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
            print0(f"warning: {wrong}; validation runs in eager mode from now on")
            return evaluate(raw_model, raw_model, cfg, val_glob, autocast, procs, print0)
    stats = torch.stack([total, torch.tensor(float(count), device=device)])
    if procs.ddp:
        dist.all_reduce(stats)  # every rank has the same number of batches
    return (stats[0] / stats[1]).item(), model


def save(step, val_loss, cfg, raw_model, model_config, optimizer, loader, procs, print0):
    """Write a training checkpoint (rank 0), with every rank's RNG so that a resume restores
    all of them (dropout masks differ by rank)."""
    rngs = [rng_state(procs.device)]
    if procs.ddp:
        rngs = [None] * procs.world_size
        dist.all_gather_object(rngs, rng_state(procs.device))
    model, state = sharding.full_state(raw_model, optimizer, cfg.shard, procs.master)
    if not procs.master:
        return
    ckpt = {
        "model": model,
        "model_config": asdict(model_config),
        "train_config": asdict(cfg),
        "optimizer": state,
        "step": step,
        "loader": loader.state_dict(),  # the same on every rank
        "rng": {k: [r[k] for r in rngs] for k in rngs[0]},  # lists by rank
        "val_loss": val_loss,
    }
    t0 = time.perf_counter()
    path = save_checkpoint(ckpt, cfg.out_dir, step, cfg.keep_last)
    mb, dt = os.path.getsize(path) / 1e6, time.perf_counter() - t0
    print0(f"saved {path} ({mb:,.1f} MB in {dt:.1f} s)")  # a stop's time is mostly this


def sample_text(raw_model, autocast, cfg, step):
    """Text generated after an EOT prompt, with its own generator so that sampling never moves
    the training RNG (a resumed run would diverge otherwise)."""
    device = next(raw_model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(cfg.seed + step)
    idx = torch.full((1, 1), EOT, dtype=torch.long, device=device)
    raw_model.eval()
    with torch.no_grad(), autocast:
        out = raw_model.generate(idx, cfg.sample_tokens, top_k=200, generator=gen)
    raw_model.train()
    return get_tokenizer().decode(out[0, 1:].tolist())


def compile_and_wrap(raw_model, cfg, procs, use_compile):
    """(model, train_model): the (compiled) model that evaluates, and the one that trains (in
    DDP under torchrun). ddp_compile="ddp" compiles the DDP module: one module for both. Under
    shard="full" raw_model is FSDP2's already (sharding.shard_model): no DDP."""
    # gradients as views into DDP's all-reduce buckets: one copy of them, not two
    wrap = functools.partial(
        DDP,
        device_ids=[procs.device.index] if procs.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    if cfg.shard == "full":
        model = torch.compile(raw_model, mode=cfg.compile_mode) if use_compile else raw_model
        return model, model
    if procs.ddp and use_compile and cfg.ddp_compile == "ddp":
        model = torch.compile(wrap(raw_model), mode=cfg.compile_mode)
        return model, model
    model = torch.compile(raw_model, mode=cfg.compile_mode) if use_compile else raw_model
    return model, wrap(model) if procs.ddp else model


def print_start(cfg, procs, raw_model, dtype, use_compile, globs, grad_accum, notes, print0):
    """The start-up report: enough to reproduce the run."""
    world_size, T = procs.world_size, cfg.block_size
    tokens_per_step = cfg.batch_size * T * world_size * grad_accum
    device_name = name_of(procs.device)
    print0("config:\n" + "\n".join(f"  {k} = {v!r}" for k, v in asdict(cfg).items()))
    print0(
        f"git {git_sha()} | torch {torch.__version__} | triton {triton_version()} | "
        f"cuda {torch.version.cuda} | {device_name} x {world_size} | "
        f"{str(dtype).removeprefix('torch.')} | "
        f"compile {cfg.compile_mode if use_compile else False}"
    )
    print0(
        f"params {raw_model.num_params(non_embedding=False):,} | train {globs[0]} | val {globs[1]}"
    )
    print0(
        f"tokens/step = batch_size {cfg.batch_size} x T {T} x world_size {world_size}"
        f" x grad_accum {grad_accum} = {tokens_per_step:,}; {cfg.max_steps} steps = "
        f"{tokens_per_step * cfg.max_steps:,} tokens"
    )
    for note in notes:
        print0(note)


def name_of(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def train_step(step, lr, models, optimizer, loader, cfg, procs, autocast, grad_accum, stop, check):
    """One optimizer step over grad_accum micro-batches; returns its StepStats (read later).
    models: (train_model, raw_model). check: compare the first micro-batch's compiled loss with
    eager mode's before the update (compile_guard)."""
    train_model, raw_model = models
    device, ddp = procs.device, procs.ddp
    for group in optimizer.param_groups:
        group["lr"] = lr
    st = StepStats(device, step, lr)
    loss_sum = torch.zeros((), device=device)
    for micro in range(grad_accum):
        try:
            x, y = loader.next_batch()
        except DataError as e:  # a later shard's token ids, checked as it is opened
            note = f"stopped at step {step} without saving; {newest_note(cfg.out_dir)}"
            raise DataError(f"{e}; {note}") from e
        sync = not ddp or micro == grad_accum - 1  # reduce grads once per step
        checking = check and micro == 0
        if checking:  # eager first: no activations held yet
            with torch.no_grad(), autocast:
                eager_loss = raw_model(x, y)
        with sharding.micro_step(train_model, raw_model, cfg.shard, sync), autocast:
            loss = train_model(x, y) / grad_accum
        if checking:
            first_loss = loss.detach() * grad_accum
        loss.backward()
        loss_sum += loss.detach()
    if check:  # before the update: a wrong graph must not touch the weights
        check_training_step(first_loss, eager_loss, ddp, step)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    norm = sharding.step(optimizer, raw_model, cfg.shard, max_norm)
    optimizer.zero_grad(set_to_none=True)
    # torch.full, not torch.tensor: a host-to-device copy of a Python number would sync
    stats = torch.stack([loss_sum, torch.full((), float(stop.requested), device=device)])
    if ddp:
        dist.all_reduce(stats)  # loss summed over ranks; a stop on any rank stops all
    st.finish(torch.cat([stats, norm.reshape(1).to(stats.dtype)]))
    return st


def main(argv=None, train_loader=DataLoader):
    """train_loader: the training batches' source, called like DataLoader (bench/parity.py
    passes a reference sampler)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text(__doc__))
        return
    cfg = load_config(argv)
    try:
        procs = distributed.setup(cfg.device)
    except ValueError as e:
        raise ConfigError(f"config key 'device': {e}") from None
    device, ddp, rank, world_size = procs.device, procs.ddp, procs.rank, procs.world_size
    print0 = distributed.printer(procs)
    run_log, stop, finished = RunLog(), StopFlag(), False
    compile_settings = contextlib.ExitStack()  # Inductor's global settings, for this run only
    try:
        notes = sharding.check(cfg, procs)  # a combination that does not run stops here
        # --- set-up: data, model, optimizer, the newest checkpoint when resuming
        T = cfg.block_size
        grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.batch_size, T, world_size)
        dtype = resolve_dtype(cfg.dtype, device)
        use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
        # fp32 weights and optimizer state, bf16 matmuls under autocast (bench/RESULTS.md §4)
        autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16
        )
        torch.manual_seed(cfg.seed + rank)  # per rank, so dropout masks differ across ranks
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        loader, train_glob, val_glob = open_data(cfg, train_loader, procs)
        hs_path = cfg.hellaswag_path or str(hellaswag.DEFAULT_PATH)
        if cfg.hellaswag and not os.path.isfile(hs_path):
            raise ConfigError(
                f"hellaswag=True but {hs_path} is missing: run python -m data.hellaswag download"
            )
        try:
            model_config = GPTConfig(**{k: getattr(cfg, k) for k in MODEL_KEYS})
        except ValueError as e:
            raise ConfigError(f"model settings: {e}") from None
        with torch.device(device):  # initialised where it runs: 1558M on a CPU takes seconds
            raw_model = GPT(model_config)
        raw_model.z_loss = cfg.z_loss  # in training-mode losses only: val stays plain CE
        sharding.shard_model(raw_model, cfg.shard)  # FSDP2 under shard="full", in place
        optimizer = sharding.make_optimizer(raw_model, cfg, device)
        start_step, ckpts = 0, list_checkpoints(cfg.out_dir)
        if train_loader is not DataLoader:
            notes.append(f"train batches from {train_loader.__name__}, not data.loader.DataLoader")
        if ckpts and not cfg.resume:
            raise ConfigError(
                f"out_dir {cfg.out_dir!r} already holds checkpoints ({ckpts[-1]}); "
                "pass --resume to continue, or choose another out_dir"
            )
        if cfg.resume:  # the newest that loads; newer damaged ones are set aside with a warning
            path, ckpt = load_for_resume(cfg.out_dir, RESUME_KEYS, print0, ddp, rank)
            if ckpt is None:
                notes.append(f"--resume: no checkpoint in {cfg.out_dir!r}, starting at step 0")
            else:
                args = (model_config, raw_model, optimizer, loader, procs, notes)
                start_step = resume(cfg, path, ckpt, *args)
                del ckpt
                if start_step >= cfg.max_steps:
                    print0(
                        f"{path}: the run finished at step {start_step} (max_steps="
                        f"{cfg.max_steps}), nothing to train; a larger --max_steps trains on "
                        "(the learning-rate schedule then follows the new max_steps)"
                    )
                    finished = True
                    return
        if use_compile:  # compilation is lazy (first step, first eval): patched until the end
            compile_settings.enter_context(compiler_settings(cfg))
        model, train_model = compile_and_wrap(raw_model, cfg, procs, use_compile)
        eval_model = model  # raw_model instead once a compiled eval graph was found wrong

        tokens_per_step = cfg.batch_size * T * world_size * grad_accum
        flops_per_step = raw_model.flops_per_token() * tokens_per_step
        peak = peak_flops(name_of(device)) if dtype == torch.bfloat16 else None
        if procs.master:
            globs = (train_glob, val_glob)
            args = (raw_model, dtype, use_compile, globs, grad_accum, notes, print0)
            print_start(cfg, procs, *args)
            run_log.open(cfg, start_step, ConfigError)
        steps = StepLog(run_log, print0, cfg, world_size, tokens_per_step, flops_per_step, peak)

        # --- the loop (llm.c's): eval, samples, checkpoints at the top, so they follow the last
        # step too. stop_all: stop after this step. A process reads its own flag; under DDP the
        # ranks agree through the flag in each step's all-reduce, read one step late
        stop.install()
        stop_all, val_loss = False, None
        check_training = use_compile and cfg.check_compile and cfg.dropout == 0.0
        check_now = check_training  # the first step, then the step after each evaluation
        if use_compile and cfg.check_compile and not check_training:
            print0("check_compile: skipped, dropout > 0 makes eager and compiled losses differ")
        for step in range(start_step, cfg.max_steps + 1):
            last_step = step == cfg.max_steps
            stop_all = stop_all or (stop.requested and not ddp)
            fresh = step > start_step or start_step == 0  # a resumed run did its first top
            intervals = (cfg.eval_interval, cfg.sample_interval, cfg.ckpt_interval)
            # the same on every rank: all of them read the same steps at the same points
            if last_step or stop_all or any(every(step, k) for k in intervals):
                stop_all = steps.flush() or stop_all  # before any eval or checkpoint
            if fresh and (last_step or every(step, cfg.eval_interval)):
                val_loss, eval_model = evaluate(
                    eval_model, raw_model, cfg, val_glob, autocast, procs, print0
                )
                rec, msg = {"step": step, "val_loss": val_loss}, f"val loss {val_loss:.6f}"
                if cfg.hellaswag:  # raw_model: varying row lengths would recompile a compiled one
                    hs_dtype = torch.bfloat16 if dtype == torch.bfloat16 else None
                    hs = hellaswag.evaluate(
                        raw_model, hs_path, device, rank, world_size, autocast_dtype=hs_dtype
                    )
                    rec["hellaswag_acc_norm"] = hs["acc_norm"]
                    msg += f" | hellaswag acc_norm {hs['acc_norm']:.4f}"
                print0(f"step {step:6d}/{cfg.max_steps} | {msg}")
                run_log.write(rec)
                check_now = check_training
            sample = every(step, cfg.sample_interval) and cfg.shard != "full"
            if procs.master and fresh and step > 0 and sample:
                print0(f"sample at step {step}: {sample_text(raw_model, autocast, cfg, step)!r}")
            if fresh and step > 0 and (last_step or stop_all or every(step, cfg.ckpt_interval)):
                parts = (cfg, raw_model, model_config, optimizer, loader, procs, print0)
                save(step, val_loss, *parts)
            if last_step or stop_all:
                break

            models, parts = (train_model, raw_model), (cfg, procs, autocast, grad_accum, stop)
            st = train_step(step, get_lr(step, cfg), models, optimizer, loader, *parts, check_now)
            check_now = False
            stop_all = steps.push(st) or stop_all  # this step is queued: read the previous one

        # --- teardown
        sharding.report_state(optimizer, procs, print0)
        if device.type == "cuda":
            gib = torch.cuda.max_memory_allocated(device) / 2**30
            print0(f"peak GPU memory allocated: {gib:.2f} GiB" + (" (rank 0)" if ddp else ""))
        finished = True
    except torch.OutOfMemoryError as e:
        raise torch.OutOfMemoryError(
            f"{e}\nHint: lower the micro-batch, e.g. --batch_size={max(1, cfg.batch_size // 2)}; "
            f"total_batch_size stays {cfg.total_batch_size} through more gradient accumulation."
        ) from e
    finally:
        compile_settings.close()
        stop.restore()
        run_log.close()
        # under DDP every rank is done, rank 0's last checkpoint included, before the group goes
        distributed.teardown(procs, finished)


if __name__ == "__main__":
    run_main(main, USER_ERRORS)
    distributed.exit_if_launched()
