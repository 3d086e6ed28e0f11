"""The run's record: per-step stats read one step late, out_dir/log.jsonl and W&B, and what the
start-up report names (git SHA, Triton version)."""

import json
import math
import os
import subprocess
import time

import torch

from gpt2_fused.training.checkpoint import newest_note
from gpt2_fused.training.compile_settings import uses_cuda_graphs
from gpt2_fused.training.config import flat, tokens_per_step
from gpt2_fused.training.jsonl import read_jsonl


class StepStats:
    """One step's (loss, stop flag, grad norm), and under fp16 (skipped, steps skipped so far,
    loss scale), read back one step late.

    Reading them at once (.item()) makes the host wait for the GPU at the end of every step, and
    the GPU then idles while the host launches the next one. Instead the numbers go to pinned
    host memory behind an event, and the loop reads them after it has queued the next step. On
    CPU the same order is kept with wall-clock times.
    """

    def __init__(self, device, step, lr):
        self.cuda = device.type == "cuda"
        self.step, self.lr = step, lr
        self.start = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self, stats):
        if self.cuda:
            self.host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            self.host.copy_(stats, non_blocking=True)
        else:
            self.host = stats
        self.end = self._mark()

    def read(self, since=None):
        """The stats as floats and the step's time in seconds: from `since` (the previous step's
        end, when nothing ran in between) or from this step's start."""
        since = self.start if since is None else since
        if not self.cuda:
            return self.host.tolist(), self.end - since
        self.end.synchronize()
        return self.host.tolist(), since.elapsed_time(self.end) / 1000


def format_step(rec, max_steps):
    line = (
        f"step {rec['step']:6d}/{max_steps} | loss {rec['loss']:.6f} | lr {rec['lr']:.2e} | "
        f"norm {rec['grad_norm']:.4f} | {rec['ms']:.1f} ms | {rec['tok_per_s']:,.0f} tok/s"
    )
    if rec.get("mfu") is not None:
        line += f" | MFU {100 * rec['mfu']:.1f}%"
    if "loss_scale" in rec:  # fp16: a step with inf or nan grads is skipped, not applied
        line += f" | scale {rec['loss_scale']:g} | skipped {rec['skipped_steps']}"
        line += " (this one)" if rec["skipped"] else ""
    return line


class StepLog:
    """Logs finished steps one step late: push(st) after a step is queued reads the one before;
    flush() reads the last one now (before an eval or checkpoint, which may stop the run). Both
    return whether any rank asked to stop. A non-finite loss or norm stops the run, but for the
    norm of a step that fp16's loss scale skipped (loss_scale.py). On a CPU,
    where a step has finished when push() gets it, push() reads it at once."""

    def __init__(
        self, run_log, print0, cfg, *, world_size, tokens, flops, peak, launched, first, compiled=""
    ):
        self.run_log, self.print0 = run_log, print0
        self.compiled = compiled  # torch.compile's mode, or "" (False) when not compiled
        # perf_counter() at launch, and the first step: the second one's record says how long
        # start-up took (compiling, autotuning, the first evaluation, recording CUDA graphs)
        self.launched, self.warm_step = launched, first + 1
        self.max_steps, self.out_dir, self.world_size = cfg.max_steps, cfg.out_dir, world_size
        self.tokens, self.flops, self.peak = tokens, flops, peak  # per step; peak FLOP/s or None
        self.pending = self.prev_end = None  # the last step's StepStats, and the one before's end

    def push(self, st):
        stop = False
        if self.pending is not None:
            stop = self._report(self.pending, self.prev_end)
            self.prev_end = self.pending.end  # nothing ran in between: time end to end
        self.pending = st
        if not st.cuda:  # nothing ran ahead: waiting for the next step only delays the line
            stop = self._report(st, self.prev_end) or stop
            self.pending, self.prev_end = None, st.end
        return stop

    def flush(self):
        stop = False if self.pending is None else self._report(self.pending, self.prev_end)
        self.pending = self.prev_end = None  # what runs next (an eval) is not the next step's
        return stop

    def _report(self, st, since):
        (loss, stop, norm, *scaling), dt = st.read(since)
        loss /= self.world_size  # summed over ranks
        skipped = bool(scaling) and scaling[0] > 0
        if not (math.isfinite(loss) and (math.isfinite(norm) or skipped)):
            raise SystemExit(
                f"error: step {st.step}: loss {loss}, grad norm {norm}: not finite. "
                f"Stopped without saving; {newest_note(self.out_dir)}. Try a lower "
                "learning_rate or more warmup_steps."
            )
        mfu = self.flops / dt / (self.peak * self.world_size) if self.peak else None
        rec = {
            "step": st.step,
            "loss": loss,
            "lr": st.lr,
            "grad_norm": norm,
            "ms": 1000 * dt,
            "tok_per_s": self.tokens / dt,
            "mfu": mfu,
        }
        if scaling:
            rec.update(skipped=skipped, skipped_steps=int(scaling[1]), loss_scale=scaling[2])
        self.print0(format_step(rec, self.max_steps))
        if st.step == self.warm_step:
            rec["startup_s"] = time.perf_counter() - self.launched
            what = ""  # an eager run's start-up is set-up and the first evaluation
            if self.compiled:
                graphs = uses_cuda_graphs(self.compiled)
                what = f" (compiling{' and CUDA-graph recording' if graphs else ''} included)"
            self.print0(
                f"start-up: {rec['startup_s']:.1f} s from launch to the end of step {st.step}{what}"
            )
        self.run_log.write(rec)
        return stop > 0


class LogError(OSError):
    """out_dir/log.jsonl cannot be written (disk full) or read back on resume; the message names
    it."""


def trim_log(path, step):
    """Drop the records a run resumed at `step` writes again (train steps >= step, val > step),
    and a last line that a stopped run left half-written."""
    if not os.path.exists(path):
        return
    try:
        recs = read_jsonl(path, torn_tail=True)
    except ValueError as e:
        raise LogError(f"{e}: move the file aside to resume with a new log") from None
    keep = [r for r in recs if r["step"] < step or ("val_loss" in r and r["step"] == step)]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(path + ".tmp", path)


class RunLog:
    """out_dir/log.jsonl (one JSON record a line) and W&B when asked; on rank 0 only."""

    def __init__(self):
        self.file = self.wandb_run = None
        self.failed = False  # a write failed (disk full): reported once, the file is dropped

    def open(self, cfg, start_step, config_error):
        if cfg.wandb:  # first: a W&B that cannot start leaves no log.jsonl behind
            self.wandb_run = _start_wandb(cfg, config_error)
        os.makedirs(cfg.out_dir, exist_ok=True)
        path = os.path.join(cfg.out_dir, "log.jsonl")
        trim_log(path, start_step)
        self.out_dir = cfg.out_dir
        self.file = open(path, "a")  # closed by close()

    def write(self, rec):
        if self.file is not None:
            try:
                self.file.write(json.dumps(rec) + "\n")
                self.file.flush()
            except OSError as e:  # the run stops: a log with holes would hide what happened
                self.failed = True
                raise LogError(
                    f"cannot write {self.file.name} ({e.strerror or e}): stopped at step "
                    f"{rec['step']} without saving; {newest_note(self.out_dir)}"
                ) from e
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in rec.items() if v is not None}, step=rec["step"])

    def close(self):
        if self.file is not None:
            try:
                self.file.close()  # flushes what a failed write left in the buffer
            except OSError:
                if not self.failed:  # else the write's own error is already on its way
                    raise
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _start_wandb(cfg, config_error):
    """wandb.init for the run; no wandb package is config_error's (exit 2), a W&B that refuses to
    start (no login, most often) a LogError (exit 1) saying what to do, as nanoGPT users expect
    a run to stop rather than train hours unlogged."""
    try:
        import wandb
    except ImportError as e:
        raise config_error("wandb=True needs wandb: pip install wandb") from e
    try:
        return wandb.init(
            project=cfg.wandb_project, name=cfg.wandb_run_name or None, config=flat(cfg)
        )
    except wandb.errors.Error as e:
        reason = " ".join(str(e).split())
        raise LogError(
            f"wandb=True, but W&B did not start ({reason}): run `wandb login` (or set "
            "WANDB_API_KEY), or set WANDB_MODE=offline to log locally, or drop --wandb"
        ) from None


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def print_start(cfg, procs, model, dtype, compile_mode, globs, notes):
    """The start-up report, enough to reproduce the run: the config, versions, the device (a
    CPU's threads), the data and the tokens-per-step arithmetic; rank 0 calls it."""
    print0, world_size, T = print, procs.world_size, cfg.model.block_size
    print0("config:\n" + "\n".join(f"  {k} = {v!r}" for k, v in flat(cfg).items()))
    where = f"{device_name(procs.device)} x {world_size}"
    if procs.device.type == "cpu":
        where = f"cpu, {torch.get_num_threads()} threads" + (
            f" x {world_size} processes" if world_size > 1 else ""
        )
    print0(
        f"git {git_sha()} | torch {torch.__version__} | triton {triton_version()} | "
        f"cuda {torch.version.cuda} | {where} | {str(dtype).removeprefix('torch.')} | "
        f"compile {compile_mode}"
    )
    print0(f"params {model.num_params(non_embedding=False):,} | train {globs[0]} | val {globs[1]}")
    tokens, grad_accum = tokens_per_step(cfg, world_size)
    derived = " (total_batch_size=0: one micro-batch a process)" if not cfg.total_batch_size else ""
    print0(
        f"tokens/step = batch_size {cfg.batch_size} x T {T} x world_size {world_size}"
        f" x grad_accum {grad_accum} = {tokens:,}{derived}; {cfg.max_steps} steps = "
        f"{tokens * cfg.max_steps:,} tokens"
    )
    for note in notes:
        print0(note)


def triton_version():
    try:
        import triton  # absent on some CPU-only installs; training does not need it there
    except ImportError:
        return "not installed"
    return triton.__version__


def git_sha():
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
