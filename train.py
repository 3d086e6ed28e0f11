"""Train a GPT-2 on token shards, on one CPU/GPU or many GPUs under torchrun.

    python train.py                                   # small model on the embedded data (CPU ok)
    python train.py configs/gpt2_124m_fineweb.py --batch_size=32 --resume
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb.py

Settings are the fields of `TrainConfig`; a config file (Python, run with runpy: `name = value`
lines) sets some of them, then `--name=value` arguments override (parsed as Python literals).
Checkpoints go to out_dir/ckpt_{step:07d}.pt; `--resume` continues from the newest one.
"""

import ast
import contextlib
import ctypes
import dataclasses
import functools
import glob
import json
import math
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import types
import typing
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_for_resume,
    newest_note,
    save_checkpoint,
)
from data import hellaswag, resolve_dataset
from data.loader import DataLoader, iter_val_batches
from data.shards import DataError, read_shard
from data.tokenizer import EOT, get_tokenizer
from errors import run_main
from fused_loss.adamw import MultiTensorAdamW
from model import GPT, GPTConfig, checkpoint_settings, pick_device


@dataclass
class TrainConfig:
    """Every setting of a run. The defaults train a 4-layer GPT on the embedded text in about
    2 minutes on a 2-core CPU (bench/notes_train.md); configs/ holds the real recipes."""

    # data: "embedded" (small text shipped in the repo) or a directory of llm.c shards
    dataset: str = "embedded"
    # a new order of the training windows every epoch, from seed (data/loader.py); False: the
    # shards' own order. Validation is never shuffled
    shuffle: bool = True
    # model: a preset ("gpt2"/"124M", ..., "gpt2-xl") sets the shape fields below unless they are
    # given explicitly too; "" leaves them as written here
    model: str = ""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128  # also the training sequence length T
    vocab_size: int = 50257
    padded_vocab_size: int = 50304
    dropout: float = 0.0
    bias: bool = True
    loss_impl: str = "fused"  # "fused" or "torch" (the reference that materialises logits)
    mlp_impl: str = "cublaslt"  # or "torch": the MLP's GELU in GEMM epilogues or not (model.py)
    # the residual stream in bf16 under autocast (llm.c) instead of fp32 (nanoGPT); model.py
    low_precision_residual: bool = True
    # batch: total_batch_size tokens per optimizer step = batch_size * T * world_size * grad_accum
    batch_size: int = 8
    total_batch_size: int = 1024
    max_steps: int = 300
    # optimizer: AdamW; linear warmup, then cosine to learning_rate * final_lr_frac
    learning_rate: float = 2e-3
    final_lr_frac: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    # "triton": fp32 parameters on CUDA take the grad norm and AdamW in one Triton launch each
    # (fused_loss/adamw.py); "torch": torch.optim.AdamW(fused=True). CPU: torch's AdamW always.
    adamw_impl: str = "triton"
    # evaluation and samples (0 disables the interval; val still runs after the last step)
    eval_interval: int = 50
    val_tokens: int = 8192  # tokens per validation pass, split over ranks
    sample_interval: int = 150
    sample_tokens: int = 48
    # HellaSwag acc_norm next to each val loss (data file: python -m data.hellaswag download)
    hellaswag: bool = False
    hellaswag_path: str = ""  # "" -> data/cache/hellaswag/hellaswag_val.jsonl
    # checkpoints and logs
    out_dir: str = "out"
    ckpt_interval: int = 100  # 0: only at the end (and on SIGTERM/SIGINT)
    keep_last: int = 1  # the newest n (0: all); the demo's is 87 MB, the configs/ recipes keep 3
    resume: bool = False  # continue from the newest checkpoint in out_dir
    wandb: bool = False
    wandb_project: str = "gpt2"
    wandb_run_name: str = ""
    # system
    device: str = "auto"  # "auto", "cpu", "cuda"
    dtype: str = "auto"  # "auto" (bfloat16 autocast on CUDA, float32 on CPU), "bfloat16", "float32"
    compile: bool | None = None  # None: on for CUDA, off on CPU
    # torch.compile's mode: "default", "max-autotune-no-cudagraphs" (Triton GEMM templates with
    # fused epilogues, minutes of autotuning at start-up), "max-autotune", "reduce-overhead"
    compile_mode: str = "default"
    # torch.compile's activation memory budget (torch._functorch.config): 1 saves what the
    # partitioner chooses; below 1 the backward recomputes cheap (pointwise) activations instead
    # of keeping them, trading a little time for memory at large models
    activation_memory_budget: float = 1.0
    # Inductor tunes its generated kernels' block sizes by coordinate descent while compiling
    coordinate_descent_tuning: bool = False
    # Inductor's buffer reuse in compiled graphs: "all" (its default), "no_inplace" (no kernel
    # writes its output over its input: inplace_buffers off), "none" (also allow_buffer_reuse off).
    # "no_inplace": with in-place buffers, torch 2.11 compiles GPT-2 774M and 1558M (2+ layers)
    # into a step with a wrong loss and gradients (1558M: first loss 11.1155, eager 11.1472; the
    # same with the torch loss); 124M and 350M compile right. Cost: none measured (1558M 49.1K
    # tok/s against 48.9K with the faulty graph; 124M 0.998x). H200, bench/RESULTS.md runs 24-28.
    buffer_reuse: str = "no_inplace"
    # at the run's first step and at the step after each evaluation, compare the compiled
    # model's loss on the first micro-batch with eager mode's (one extra forward without
    # gradients) and stop with an error, before the update, if they differ by more than
    # COMPILE_CHECK_TOL: the guard against graphs compiled wrongly like the one buffer_reuse
    # works around, whose cause is not known and whose results vary from run to run
    # (bench/RESULTS.md, session 15). Not done with dropout > 0, where the two forwards would
    # draw different masks. Each evaluation checks its first batch the same way; a wrong
    # validation graph is replaced by eager mode with a warning.
    check_compile: bool = True
    # DDP with torch.compile: "model" compiles the model, then wraps it in DDP (as nanoGPT does:
    # the compiled backward hands every gradient over at its end, so the all-reduce starts
    # after it); "ddp" wraps first and compiles the DDP module: Dynamo splits the graph at DDP's
    # gradient buckets so that each bucket's all-reduce overlaps the rest of the backward.
    # 2 H200s with "model": 124M 1.95x, 1558M 1.74x; "ddp" measured no faster at 1558M (1.744x
    # against 1.742x in the same session; bench/RESULTS.md section 6)
    ddp_compile: str = "model"
    seed: int = 1337


# TrainConfig fields that a preset sets, and all those that make up the GPTConfig
PRESET_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "padded_vocab_size")
MODEL_KEYS = PRESET_KEYS + ("dropout", "bias", "loss_impl", "low_precision_residual")
# how a layer is computed, not what: a run may resume with another value (e.g. "torch" where
# cuBLASLt is missing); every other model key must match the checkpoint's
IMPL_KEYS = ("mlp_impl",)
MODEL_KEYS += IMPL_KEYS
# what --resume reads from a checkpoint (main's checkpoint() writes these and more)
RESUME_KEYS = ("model", "model_config", "optimizer", "step", "loader", "rng")


BUFFER_REUSE = {  # buffer_reuse -> torch._inductor.config patch
    "all": {},
    "no_inplace": dict(inplace_buffers=False),
    "none": dict(inplace_buffers=False, allow_buffer_reuse=False),
}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# nats. Measured on the H200 at the first step: compiled graphs that are right are within 6e-5 of
# eager mode's loss (124M to 1558M); the wrong ones seen were 5e-3 to 4.6e-2 off
COMPILE_CHECK_TOL = 2e-3


class ConfigError(ValueError):
    pass


# errors the user can fix: one line on the command line (errors.py; GPT2_DEBUG=1 for a traceback)
USER_ERRORS = {
    ConfigError: "config error",
    DataError: "data error",
    CheckpointError: "checkpoint error",
}


# ----------------------------------------------------------------------------------------------
# configuration


def _check_type(key, value, typ):
    """Return value as the field's type (int -> float is the only conversion), else raise."""
    allowed = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
    for t in allowed:
        if t is type(None) and value is None:
            return value
        if t is float and type(value) is int:
            return float(value)
        if type(value) is t:  # exact: a bool is not accepted as an int
            return value
    names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"config key {key!r} expects {names}, got {value!r} ({type(value).__name__})")


def _parse_arg(key, text, typ):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if typ is not str:
            raise ConfigError(f"config key {key!r}: cannot parse {text!r} as a value") from None
        value = text  # a bare word for a str field: --device=cuda
    if typ is str and not isinstance(value, str):
        value = text  # --out_dir=2024 means the string "2024"
    return value


def run_config_file(path):
    """The names a config file defines. It is Python, run with runpy (hence arithmetic and
    helpers); a syntax error, or a name that is not defined (text without quotes), is a
    ConfigError saying file:line."""
    try:
        return runpy.run_path(path)
    except SyntaxError as e:
        text = f": {e.text.strip()}" if e.text and e.text.strip() else ""
        raise ConfigError(f"{e.filename or path}:{e.lineno}: {e.msg}{text}") from e
    except NameError as e:
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        where = f"{path}:{lines[-1]}" if lines else path
        raise ConfigError(f"{where}: {e} (a config file is Python: text needs quotes)") from e


def load_config(argv):
    """argv: [config.py ...] [--key=value | --flag ...] -> TrainConfig."""
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    overrides = {}
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if key not in fields:
                raise ConfigError(f"unknown config key {key!r} (from {arg!r})")
            if not eq:
                if fields[key] not in (bool, bool | None):
                    raise ConfigError(f"config key {key!r} needs a value: --{key}=...")
                overrides[key] = True
            else:
                overrides[key] = _check_type(key, _parse_arg(key, text, fields[key]), fields[key])
        elif arg.endswith(".py"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} not found")
            for key, value in run_config_file(arg).items():
                # modules, functions and _private helpers are not settings
                if key.startswith("_") or callable(value) or isinstance(value, types.ModuleType):
                    continue
                if key not in fields:
                    raise ConfigError(f"unknown config key {key!r} in {arg}")
                overrides[key] = _check_type(key, value, fields[key])
        else:
            raise ConfigError(f"unexpected argument {arg!r}: expected a config .py or --key=value")
    values = {}
    if overrides.get("model"):
        try:
            preset = asdict(GPTConfig.from_preset(overrides["model"]))
        except ValueError as e:
            raise ConfigError(f"config key 'model': {e}") from None
        values.update({k: preset[k] for k in PRESET_KEYS})
    values.update(overrides)
    cfg = TrainConfig(**values)
    _check_ranges(cfg)
    return cfg


def _check_ranges(cfg):
    positive = ("batch_size", "block_size", "total_batch_size", "learning_rate", "val_tokens")
    non_negative = (
        "max_steps",
        "warmup_steps",
        "weight_decay",
        "grad_clip",
        "eval_interval",
        "sample_interval",
        "sample_tokens",
        "ckpt_interval",
        "keep_last",
        "seed",  # the data order's generators take no negative seeds
    )
    for key in positive + non_negative:
        value = getattr(cfg, key)
        if value < 0 or (value == 0 and key in positive):
            need = "> 0" if key in positive else ">= 0"
            raise ConfigError(f"config key {key!r} must be {need}, got {value!r}")
    if not 0.0 <= cfg.final_lr_frac <= 1.0:
        raise ConfigError(f"config key 'final_lr_frac' must be in [0, 1], got {cfg.final_lr_frac}")
    if cfg.dtype not in ("auto", "bfloat16", "float32"):
        raise ConfigError(f"config key 'dtype': auto, bfloat16 or float32, not {cfg.dtype!r}")
    if not 0.0 < cfg.activation_memory_budget <= 1.0:
        raise ConfigError(
            "config key 'activation_memory_budget' must be in (0, 1], "
            f"got {cfg.activation_memory_budget!r}"
        )
    if cfg.activation_memory_budget < 1.0 and cfg.dropout > 0.0:
        raise ConfigError(
            "activation_memory_budget < 1 with dropout > 0: the compiled backward may recompute "
            "dropout with a fresh mask and silently get wrong gradients (pytorch issue #190758); "
            "use one or the other"
        )
    if cfg.buffer_reuse not in BUFFER_REUSE:
        raise ConfigError(
            f"config key 'buffer_reuse': one of {tuple(BUFFER_REUSE)}, not {cfg.buffer_reuse!r}"
        )
    if cfg.adamw_impl not in ("triton", "torch"):
        raise ConfigError(f"config key 'adamw_impl': 'triton' or 'torch', not {cfg.adamw_impl!r}")
    if cfg.ddp_compile not in ("model", "ddp"):
        raise ConfigError(f"config key 'ddp_compile': 'model' or 'ddp', not {cfg.ddp_compile!r}")
    if cfg.compile_mode not in COMPILE_MODES:
        raise ConfigError(
            f"config key 'compile_mode': one of {COMPILE_MODES}, not {cfg.compile_mode!r}"
        )


class CompileMismatch(RuntimeError):
    pass


def compiled_loss_mismatch(compiled, eager, ddp, what):
    """None if every rank's compiled loss (0-dim tensor) is within COMPILE_CHECK_TOL of its eager
    loss on the same batch, else the message saying how far off (the same on every rank)."""
    pair = torch.stack([compiled.detach().float(), eager.detach().float()])
    gap = (pair[0] - pair[1]).abs().reshape(1)
    if ddp:
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    if gap.item() <= COMPILE_CHECK_TOL:  # NaN is a mismatch too
        return None
    compiled, eager = pair.tolist()
    return (
        f"the compiled model's loss on the {what} differs from eager mode's by "
        f"{gap.item():.2e} nats (here: compiled {compiled:.6f}, eager {eager:.6f}; allowed "
        f"{COMPILE_CHECK_TOL:g}): torch.compile has produced a wrong graph for this model"
    )


@contextlib.contextmanager
def compiler_settings(cfg):
    """torch.compile's global settings from cfg, for as long as the context lasts."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor = dict(coordinate_descent_tuning=cfg.coordinate_descent_tuning)
    inductor.update(BUFFER_REUSE[cfg.buffer_reuse])
    budget = dict(activation_memory_budget=cfg.activation_memory_budget)
    with functorch_config.patch(**budget), inductor_config.patch(**inductor):
        yield


def grad_accum_steps(total_batch_size, batch_size, seq_len, world_size):
    per_micro = batch_size * seq_len * world_size
    if total_batch_size <= 0 or total_batch_size % per_micro:
        raise ConfigError(
            f"total_batch_size={total_batch_size} must be a positive multiple of batch_size * T * "
            f"world_size = {batch_size} * {seq_len} * {world_size} = {per_micro}"
        )
    return total_batch_size // per_micro


def get_lr(step, cfg):
    """Linear warmup over warmup_steps, then cosine down to learning_rate * final_lr_frac."""
    max_lr, min_lr = cfg.learning_rate, cfg.learning_rate * cfg.final_lr_frac
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return min_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


# ----------------------------------------------------------------------------------------------
# RNG state, saved in checkpoints


def rng_state(device):
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state, rank, device):
    """state: {"torch": [per-rank CPU RNG state], "cuda": [per-rank CUDA RNG state or None]}."""
    torch.set_rng_state(state["torch"][rank])
    if device.type == "cuda" and state["cuda"][rank] is not None:
        torch.cuda.set_rng_state(state["cuda"][rank], device)


# ----------------------------------------------------------------------------------------------
# logging and hardware facts

# Dense bf16 tensor-core peak FLOP/s by substring of torch.cuda.get_device_name(), most specific
# first (vendor spec sheets, no sparsity).
PEAK_BF16_FLOPS = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h200 nvl", 835e12),
    ("h100", 989e12),  # SXM
    ("h200", 989e12),  # SXM, and GH200
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l40", 181e12),
    ("l4", 121e12),
    ("rtx 4090", 165e12),
    ("mi300x", 1307e12),
)


def peak_flops(device_name):
    """bf16 dense peak FLOP/s for a GPU name, or None when unknown (MFU is then not reported)."""
    name = (device_name or "").lower()
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def every(step, interval):
    return interval > 0 and step % interval == 0


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


def format_step(rec, max_steps):
    line = (
        f"step {rec['step']:6d}/{max_steps} | loss {rec['loss']:.6f} | lr {rec['lr']:.2e} | "
        f"norm {rec['grad_norm']:.4f} | {rec['ms']:.1f} ms | {rec['tok_per_s']:,.0f} tok/s"
    )
    if rec.get("mfu") is not None:
        line += f" | MFU {100 * rec['mfu']:.1f}%"
    return line


class _StopFlag:
    """SIGTERM/SIGINT set a flag: the loop finishes its step, saves and exits (under DDP after one
    or two more steps, see main). A second Ctrl-C kills at once; repeated SIGTERMs (a launcher
    forwarding one) only set the flag again."""

    def __init__(self):
        self.requested = False
        self.seen = set()

    def __call__(self, signum, frame):
        if signum == signal.SIGINT and signum in self.seen:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = True
        self.seen.add(signum)
        msg = f"signal {signum}: finishing this step, saving a checkpoint, exiting\n"
        try:  # os.write, not print: the handler may have interrupted a print (not re-entrant)
            os.write(sys.stdout.fileno(), msg.encode())
        except OSError:  # a closed stdout: the stop goes on without the message
            pass


def say(*args):
    """print(*args), flushed. Output that cannot be written (stdout a pipe whose reader has gone,
    as when the Ctrl-C that stops a run also ends its `| tee`) is dropped: stdout then goes to
    /dev/null, so that the run, its checkpoint and the flush at exit go on; log.jsonl still gets
    every record."""
    try:
        print(*args, flush=True)
    except OSError:
        try:
            fd = sys.stdout.fileno()
        except (OSError, ValueError):  # not a file (a capture): nothing to redirect
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


class _StepStats:
    """One step's (loss, grad norm, stop flag), read back one step late.

    Reading them at once (.item()) makes the host wait for the GPU at the end of every step, and
    the GPU then idles while the host launches the next one (~3 ms of a 63 ms step at 124M on an
    H200). Instead the numbers go to pinned host memory behind an event, and the loop reads them
    after it has queued the next step. On CPU the same order is kept with wall-clock times.
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


# ----------------------------------------------------------------------------------------------


def trim_log(path, step):
    """Drop the records a run resumed at `step` writes again (train steps >= step, val > step)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    keep = [r for r in recs if r["step"] < step or ("val_loss" in r and r["step"] == step)]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(path + ".tmp", path)


def open_data(cfg, train_loader, rank, local_rank, world_size, ddp, device):
    """(train_loader(...), train_glob, val_glob) for cfg.dataset; a problem with the data raises
    DataError naming the file. Checked here: every shard's header, the token ids of the val
    shards and of the train shard read first (the loader checks each other one when it opens
    it), and that a step fits in each shard. One process per node goes first: "embedded" is
    prepared on first use."""
    B, T = cfg.batch_size, cfg.block_size
    try:
        if local_rank == 0:
            train_glob, val_glob = resolve_dataset(cfg.dataset)
        if ddp:
            dist.barrier()
        if local_rank != 0:
            train_glob, val_glob = resolve_dataset(cfg.dataset)
        order = dict(shuffle=cfg.shuffle, seed=cfg.seed)
        loader = train_loader(train_glob, B, T, rank, world_size, device=device, **order)
        for path in sorted(glob.glob(val_glob)):
            read_shard(path)
        next(iter_val_batches(val_glob, B, T, rank, world_size, cfg.val_tokens, device=device))
    except DataError:
        raise
    except (FileNotFoundError, ValueError) as e:  # resolve_dataset's and the loader's name the file
        raise DataError(str(e)) from e
    return loader, train_glob, val_glob


def keep_freed_memory():
    """Keep large freed blocks in this process's heap instead of returning them to the OS.

    glibc serves blocks over 32 MiB with mmap and unmaps them when freed, so on a CPU every step
    page-faults its (tokens x vocab) logits in anew: 20 steps of the default run took 19.2 s, 13.1
    of them in the kernel, and 12.3 s (1.2 s) with this, on this repo's 2-core CPU machine. Up to
    1 GiB of freed memory stays with the process. Returns whether glibc took the settings (False
    without glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    return bool(mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def build_optimizer(model, cfg, device):
    """AdamW; weight decay only on >= 2-D tensors (matmul weights, embeddings), not on biases or
    LayerNorm gains. On CUDA: MultiTensorAdamW (one Triton launch) for fp32 parameters unless
    adamw_impl="torch", else torch's fused kernel. Both keep the same state (checkpoints move)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kw = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    fp32 = all(p.dtype == torch.float32 for p in params)
    if device.type == "cuda" and cfg.adamw_impl == "triton" and fp32:
        return MultiTensorAdamW(groups, **kw)
    return torch.optim.AdamW(groups, **kw, fused=device.type == "cuda")


def load_optimizer_state(optimizer, state):
    """optimizer.load_state_dict(state), keeping the optimizer's own choice of kernel: a state
    saved by MultiTensorAdamW carries no "fused"/"foreach" flags, and torch's AdamW would
    otherwise take them from it (and drop to its slower per-tensor loop). A fused AdamW keeps
    its step counters on the parameters' device (torch moves them only for fused states)."""
    how = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, how, strict=True):
        group.update(flags)
        for p in group["params"] if group.get("fused") else []:
            if "step" in optimizer.state.get(p, {}):
                step = optimizer.state[p]["step"]
                optimizer.state[p]["step"] = step.to(dtype=torch.float32, device=p.device)


def clipped_step(optimizer, params, max_norm):
    """clip_grad_norm_(params, max_norm), then optimizer.step(); returns the total grad norm
    before clipping (a device scalar: no host sync). params: the optimizer's parameters, in the
    model's order (the norm's summation order, so the plain path is bitwise what it was).

    A fused AdamW divides each grad by `optimizer.grad_scale` (a device tensor; the hook
    GradScaler uses) as it reads it, so there the clip factor rides along: the grads are read
    once for the norm and once by the update, instead of also being scaled in place in between
    (4 of 40 bytes per parameter fewer; bench/bench_adamw.py times both). The grads left behind
    are the clipped ones (MultiTensorAdamW leaves them unclipped: 4 bytes fewer again).
    Non-fused optimizers (CPU) take the plain path."""
    params = list(params)
    if isinstance(optimizer, MultiTensorAdamW):  # the same, the norm in one launch too
        norm = optimizer.total_norm()
    elif all(group.get("fused") for group in optimizer.param_groups):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm
    # clip_grad_norm_ multiplies by min(max_norm / (norm + 1e-6), 1); the kernel divides by
    # the inverse (within an ulp of it; a non-finite norm poisons the step the same way)
    optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    optimizer.step()
    return norm


def main(argv=None, train_loader=DataLoader):
    """train_loader: the training batches' source, called like DataLoader (bench/parity.py
    passes a reference sampler)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        defaults = "\n".join(f"  --{k}={v!r}" for k, v in asdict(TrainConfig()).items())
        print(f"{__doc__}\nSettings and their defaults:\n{defaults}")
        return
    cfg = load_config(argv)

    # --- processes and devices
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # set by torchrun
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        device = pick_device(cfg.device)
    except ValueError as e:
        raise ConfigError(f"config key 'device': {e}") from None
    if device.type == "cuda":
        device = torch.device("cuda", local_rank if ddp else (device.index or 0))
        torch.cuda.set_device(device)
    elif device.type == "cpu":
        keep_freed_memory()
    if ddp:
        backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
        dist.init_process_group(backend=backend, device_id=device_id)
    master = rank == 0

    def print0(*args):
        if master:
            say(*args)

    log_file = run = None
    finished = False  # the run reached its end on this rank (not an exception)
    old_handlers = {}
    compile_settings = contextlib.ExitStack()  # Inductor's global settings, for this run only
    try:
        T = cfg.block_size
        grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.batch_size, T, world_size)
        dtype = cfg.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.type == "cuda" else "float32"
        use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
        # fp32 weights and optimizer state, bf16 matmuls under autocast: as fast as bf16 weights
        # with an fp32 master copy on an H200, and simpler (bench/notes_train.md)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
        torch.manual_seed(cfg.seed + rank)  # per rank, so dropout masks differ across ranks
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

        loader, train_glob, val_glob = open_data(
            cfg, train_loader, rank, local_rank, world_size, ddp, device
        )
        hs_path = cfg.hellaswag_path or str(hellaswag.DEFAULT_PATH)
        if cfg.hellaswag and not os.path.isfile(hs_path):
            raise ConfigError(
                f"hellaswag=True but {hs_path} is missing: run python -m data.hellaswag download"
            )

        # --- model, optimizer, and the newest checkpoint when resuming
        try:
            model_config = GPTConfig(**{k: getattr(cfg, k) for k in MODEL_KEYS})
        except ValueError as e:
            raise ConfigError(f"model settings: {e}") from None
        with torch.device(device):  # initialised where it runs: 1558M on a CPU takes seconds
            raw_model = GPT(model_config)
        optimizer = build_optimizer(raw_model, cfg, device)
        start_step, ckpts, notes = 0, list_checkpoints(cfg.out_dir), []
        if train_loader is not DataLoader:
            notes.append(f"train batches from {train_loader.__name__}, not data.loader.DataLoader")
        if ckpts and not cfg.resume:
            raise ConfigError(
                f"out_dir {cfg.out_dir!r} already holds checkpoints ({ckpts[-1]}); "
                "pass --resume to continue, or choose another out_dir"
            )
        path = ckpt = None
        if cfg.resume:  # the newest that loads; newer damaged ones are set aside with a warning
            path, ckpt = load_for_resume(cfg.out_dir, RESUME_KEYS, print0, ddp, rank)
        if ckpt is not None:
            mine, saved = asdict(model_config), checkpoint_settings(ckpt["model_config"])
            keys = sorted((set(mine) | set(saved)) - set(IMPL_KEYS))
            differ = [k for k in keys if mine.get(k) != saved.get(k)]
            if differ:
                fix = " ".join(f"--{k}={saved[k]!r}" for k in differ if k in mine and k in saved)
                raise ConfigError(
                    f"model config differs from {path}'s in {differ}"
                    + (f"; to resume it, pass {fix}" if fix else "")
                )
            raw_model.load_state_dict(ckpt["model"])
            load_optimizer_state(optimizer, ckpt["optimizer"])
            note = loader.load_state_dict(ckpt["loader"])  # one position for all ranks, any W
            start_step = ckpt["step"]
            if start_step >= cfg.max_steps:
                print0(
                    f"{path}: the run finished at step {start_step} (max_steps={cfg.max_steps}), "
                    "nothing to train; a larger --max_steps trains on (the learning-rate schedule "
                    "then follows the new max_steps)"
                )
                finished = True
                return
            notes.append(f"resumed from {path} at step {start_step}")
            if note:  # the checkpoint's data order is not the one cfg asks for; it continues
                notes.append(note)
            if len(ckpt["rng"]["torch"]) == world_size:
                set_rng_state(ckpt["rng"], rank, device)
            else:  # the data order still continues exactly; dropout masks cannot
                torch.manual_seed(cfg.seed + rank + world_size * start_step)
                notes.append(
                    f"it was written by {len(ckpt['rng']['torch'])} ranks, not "
                    f"{world_size}: RNG re-seeded, the run is not bit-identical"
                )
            del ckpt
        elif cfg.resume:
            notes.append(f"--resume: no checkpoint in {cfg.out_dir!r}, starting at step 0")
        if use_compile:  # compilation is lazy (first step, first eval): patched until the end
            compile_settings.enter_context(compiler_settings(cfg))
        # gradients as views into DDP's all-reduce buckets: one copy of them, not two
        wrap = functools.partial(
            DDP,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        if ddp and use_compile and cfg.ddp_compile == "ddp":  # one compiled module for all uses
            model = train_model = torch.compile(wrap(raw_model), mode=cfg.compile_mode)
        else:
            model = torch.compile(raw_model, mode=cfg.compile_mode) if use_compile else raw_model
            train_model = wrap(model) if ddp else model

        # --- start-up report: enough to reproduce the run
        tokens_per_step = cfg.batch_size * T * world_size * grad_accum
        flops_per_step = raw_model.flops_per_token() * tokens_per_step
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = peak_flops(device_name) if dtype == "bfloat16" else None
        if master:
            print0("config:\n" + "\n".join(f"  {k} = {v!r}" for k, v in asdict(cfg).items()))
            print0(
                f"git {git_sha()} | torch {torch.__version__} | triton {triton_version()} | "
                f"cuda {torch.version.cuda} | {device_name} x {world_size} | {dtype} | "
                f"compile {cfg.compile_mode if use_compile else False}"
            )
            print0(
                f"params {raw_model.num_params(non_embedding=False):,} | train {train_glob}"
                f" | val {val_glob}"
            )
            print0(
                f"tokens/step = batch_size {cfg.batch_size} x T {T} x world_size {world_size}"
                f" x grad_accum {grad_accum} = {tokens_per_step:,}; {cfg.max_steps} steps = "
                f"{tokens_per_step * cfg.max_steps:,} tokens"
            )
            for note in notes:
                print0(note)
            os.makedirs(cfg.out_dir, exist_ok=True)
            log_path = os.path.join(cfg.out_dir, "log.jsonl")
            trim_log(log_path, start_step)
            log_file = open(log_path, "a")  # closed in the finally below
            if cfg.wandb:
                try:
                    import wandb
                except ImportError as e:
                    raise ConfigError("wandb=True needs wandb: pip install wandb") from e
                name = cfg.wandb_run_name or None
                run = wandb.init(project=cfg.wandb_project, name=name, config=asdict(cfg))

        def log(rec):
            if master:
                log_file.write(json.dumps(rec) + "\n")
                log_file.flush()
                if run is not None:
                    run.log({k: v for k, v in rec.items() if v is not None}, step=rec["step"])

        # every evaluation of a compiled model checks its (no-grad) graph on its first batch; a
        # wrong one is replaced by raw_model for the rest of the run
        eval_model = [model]

        def evaluate():
            m = eval_model[0]
            check = cfg.check_compile and m is not raw_model
            m.eval()
            total, count, eager = torch.zeros((), device=device), 0, None
            batches = iter_val_batches(
                val_glob,
                cfg.batch_size,
                T,
                rank,
                world_size,
                max_tokens=cfg.val_tokens,
                device=device,
            )
            with torch.no_grad(), autocast:
                for x, y in batches:
                    loss = m(x, y)
                    if check and count == 0:  # raw_model is in eval mode with m
                        first, eager = loss.clone(), raw_model(x, y)  # clone: CUDA-graph outputs
                    total += loss
                    count += 1
            m.train()
            if eager is not None:
                wrong = compiled_loss_mismatch(first, eager, ddp, "first validation batch")
                if wrong:
                    print0(f"warning: {wrong}; validation runs in eager mode from now on")
                    eval_model[0] = raw_model
                    return evaluate()
            stats = torch.stack([total, torch.tensor(float(count), device=device)])
            if ddp:
                dist.all_reduce(stats)  # every rank has the same number of batches
            return (stats[0] / stats[1]).item()

        def checkpoint(step, val_loss):
            rngs = [rng_state(device)]
            if ddp:  # each rank's RNG (dropout masks differ by rank), so a resume restores all
                rngs = [None] * world_size
                dist.all_gather_object(rngs, rng_state(device))
            if master:
                ckpt = {
                    "model": raw_model.state_dict(),
                    "model_config": asdict(model_config),
                    "train_config": asdict(cfg),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "loader": loader.state_dict(),  # the same on every rank
                    "rng": {k: [r[k] for r in rngs] for k in rngs[0]},  # lists by rank
                    "val_loss": val_loss,
                }
                t0 = time.perf_counter()
                path = save_checkpoint(ckpt, cfg.out_dir, step, cfg.keep_last)
                mb, dt = os.path.getsize(path) / 1e6, time.perf_counter() - t0
                print0(f"saved {path} ({mb:,.1f} MB in {dt:.1f} s)")  # a stop's time is mostly this

        # --- the loop; eval, samples, checkpoints at the top so they also follow the last step
        stop = _StopFlag()
        old_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
        # stop after this step: one process reads its own flag at the top of each step, so the
        # step in flight finishes and then it saves; under DDP the ranks must agree on the step,
        # which they do through the flag in each step's all-reduce (below), read one step late
        # like the loss (reading it at once would make the GPU wait for the host every step)
        stop_all = False
        val_loss = None
        pending, prev_end = None, None  # the last step's _StepStats, read one step late
        check_training = use_compile and cfg.check_compile and cfg.dropout == 0.0
        check_pending = check_training  # the first step, then the step after each evaluation
        if use_compile and cfg.check_compile and not check_training:
            print0("check_compile: skipped, dropout > 0 makes eager and compiled losses differ")

        def report(st, since):
            """Log a finished step; stop on a non-finite loss or norm. Returns stop_all."""
            (loss_val, stop_val, norm_val), dt = st.read(since)
            loss_val /= world_size
            if not (math.isfinite(loss_val) and math.isfinite(norm_val)):
                raise SystemExit(
                    f"error: step {st.step}: loss {loss_val}, grad norm {norm_val}: not finite. "
                    f"Stopped without saving; {newest_note(cfg.out_dir)}. Try a lower "
                    "learning_rate or more warmup_steps."
                )
            mfu = flops_per_step / dt / (peak * world_size) if peak else None
            rec = {
                "step": st.step,
                "loss": loss_val,
                "lr": st.lr,
                "grad_norm": norm_val,
                "ms": 1000 * dt,
                "tok_per_s": tokens_per_step / dt,
                "mfu": mfu,
            }
            print0(format_step(rec, cfg.max_steps))
            log(rec)
            return stop_val > 0

        for step in range(start_step, cfg.max_steps + 1):
            last_step = step == cfg.max_steps
            stop_all = stop_all or (stop.requested and not ddp)
            fresh = step > start_step or start_step == 0  # a resumed run did its first top
            top_work = (
                last_step
                or stop_all
                or any(
                    every(step, k)
                    for k in (cfg.eval_interval, cfg.sample_interval, cfg.ckpt_interval)
                )
            )  # the same on every rank: all of them read the same steps at the same points
            if pending is not None and top_work:  # before any eval or checkpoint: it may stop us
                stop_all = report(pending, prev_end) or stop_all
                pending, prev_end = None, None
            if fresh and (last_step or every(step, cfg.eval_interval)):
                val_loss = evaluate()
                rec, msg = {"step": step, "val_loss": val_loss}, f"val loss {val_loss:.6f}"
                if (
                    cfg.hellaswag
                ):  # raw_model: its varying row lengths would recompile a compiled one
                    hs = hellaswag.evaluate(
                        raw_model,
                        hs_path,
                        device,
                        rank,
                        world_size,
                        autocast_dtype=torch.bfloat16 if dtype == "bfloat16" else None,
                    )
                    rec["hellaswag_acc_norm"] = hs["acc_norm"]
                    msg += f" | hellaswag acc_norm {hs['acc_norm']:.4f}"
                print0(f"step {step:6d}/{cfg.max_steps} | {msg}")
                log(rec)
                check_pending = check_training
            if master and fresh and step > 0 and every(step, cfg.sample_interval):
                print0(f"sample at step {step}: {sample_text(raw_model, autocast, cfg, step)!r}")
            if fresh and step > 0 and (last_step or stop_all or every(step, cfg.ckpt_interval)):
                checkpoint(step, val_loss)
            if last_step or stop_all:
                break

            lr = get_lr(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            st = _StepStats(device, step, lr)
            loss_sum = torch.zeros((), device=device)
            for micro in range(grad_accum):
                try:
                    x, y = loader.next_batch()
                except DataError as e:  # a later shard's token ids, checked as it is opened
                    note = f"stopped at step {step} without saving; {newest_note(cfg.out_dir)}"
                    raise DataError(f"{e}; {note}") from e
                sync = not ddp or micro == grad_accum - 1  # all-reduce grads once per step
                checking = check_pending and micro == 0
                if checking:  # eager first: no activations held yet
                    with torch.no_grad(), autocast:
                        eager_loss = raw_model(x, y)
                with contextlib.nullcontext() if sync else train_model.no_sync(), autocast:
                    loss = train_model(x, y) / grad_accum
                if checking:
                    first_loss = loss.detach() * grad_accum
                loss.backward()
                loss_sum += loss.detach()
            if check_pending:  # before the update: a wrong graph must not touch the weights
                check_pending = False
                what = f"first training batch of step {step}"
                wrong = compiled_loss_mismatch(first_loss, eager_loss, ddp, what)
                if wrong:
                    raise CompileMismatch(
                        f"{wrong}. Try --buffer_reuse=none, another --activation_memory_budget, "
                        "or --compile=False (bench/compile_check.py narrows it down); "
                        "--check_compile=False skips this check"
                    )
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
            norm = clipped_step(optimizer, raw_model.parameters(), max_norm)
            optimizer.zero_grad(set_to_none=True)
            # torch.full, not torch.tensor: a host-to-device copy of a Python number would sync
            stats = torch.stack([loss_sum, torch.full((), float(stop.requested), device=device)])
            if ddp:
                dist.all_reduce(stats)  # loss summed over ranks; a stop on any rank stops all
            st.finish(torch.cat([stats, norm.reshape(1).to(stats.dtype)]))
            if pending is not None:  # this step is queued: now read the previous one
                stop_all = report(pending, prev_end) or stop_all
                prev_end = pending.end
            pending = st
        if device.type == "cuda":
            gib = torch.cuda.max_memory_allocated(device) / 2**30
            print0(f"peak GPU memory allocated: {gib:.2f} GiB" + (" (rank 0)" if ddp else ""))
        if ddp:  # every rank done, rank 0's last checkpoint included, before the group goes
            dist.barrier()
        finished = True
    except torch.OutOfMemoryError as e:
        raise torch.OutOfMemoryError(
            f"{e}\nHint: lower the micro-batch, e.g. --batch_size={max(1, cfg.batch_size // 2)}; "
            f"total_batch_size stays {cfg.total_batch_size} through more gradient accumulation."
        ) from e
    finally:
        compile_settings.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if log_file is not None:
            log_file.close()
        if run is not None:
            run.finish()
        # NCCL only after a clean end: after an exception on one rank the others may be inside
        # a collective, where destroying NCCL communicators can hang; torchrun then ends them.
        # Gloo's destroy is local, and leaving its threads to interpreter exit can abort it
        if ddp and dist.is_initialized() and (finished or device.type != "cuda"):
            dist.destroy_process_group()


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


if __name__ == "__main__":
    run_main(main, USER_ERRORS)
