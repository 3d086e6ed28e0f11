"""Where a run starts, and so which model it trains: from scratch, from pretrained weights
(--init_from), or from the newest checkpoint in out_dir (--resume).

A checkpoint in out_dir that loads wins over init_from, so that a fine-tune restarted with the
same command continues instead of starting over; with none, --resume starts as init_from says.
init_from's weights give a new run (step 0, a fresh optimizer and data order) its model.

The checkpoint or the weights give the model's settings; a model setting that a config file or
the command line gave (TrainConfig.given) must agree with them, except:
- the fast-path switches (IMPL_KEYS: how a layer is computed, not what) and dropout (a
  regulariser): a new run's own; a resumed run keeps the checkpoint's unless one is given;
- low_precision_residual (rounding, not weights): a new run's own; a resumed run keeps it;
- fp8 (how the blocks' GEMMs run; the weights load into any recipe): always the run's own;
- block_size under init_from: a smaller one keeps the first rows of the position embeddings
  (nanoGPT's crop_block_size).
"""

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gpt2_fused.training.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_for_resume,
    set_rng_state,
)
from gpt2_fused.training.config import PRESET_NAME, ConfigError, TrainConfig, tokens_per_step
from gpt2_fused.training.model_io import (
    HF_GPT2,
    cached_hf,
    checkpoint_settings,
    from_checkpoint,
    from_hf,
)
from model import IMPL_KEYS, IMPLS, GPTConfig

# what --resume reads from a checkpoint (train.save writes these and more)
RESUME_KEYS = ("model", "model_config", "optimizer", "step", "loader", "rng")

PRESET_SIZES = ("n_layer", "n_head", "n_embd")  # what a --model=NAME preset sets


@dataclass
class Start:
    cfg: TrainConfig  # the run's settings, the model's taken from the source
    ckpt: dict | None = None  # the checkpoint to resume (RESUME_KEYS), or None
    path: str | None = None  # where ckpt or weights come from
    weights: dict | None = None  # init_from's state dict for the new model, or None
    notes: list = field(default_factory=list)  # for the start-up report

    def load_weights(self, model):
        """Copy init_from's weights into the freshly built model (before FP8 conversion and
        sharding wrap its Linears); nothing for a run from scratch or one that resumes."""
        if self.weights is not None:
            model.load_state_dict(self.weights)  # onto the model's device; ties stay tied
            self.weights = None  # host memory back: 1558M is 6 GB


def find(cfg, procs, warn):
    """The run's Start: its config with the source's model settings, and the checkpoint or the
    weights to load. Every rank reads the same files (load_for_resume lets rank 0 choose)."""
    ckpts = list_checkpoints(cfg.out_dir)
    if ckpts and not cfg.resume:
        raise ConfigError(
            f"out_dir {cfg.out_dir!r} already holds checkpoints ({ckpts[-1]}); "
            "pass --resume to continue, or choose another out_dir"
        )
    notes = []
    if cfg.resume:  # the newest that loads; newer damaged ones are set aside with a warning
        path, ckpt = load_for_resume(cfg.out_dir, RESUME_KEYS, warn, procs.ddp, procs.rank)
        if ckpt is not None:
            model = settle(cfg, resumed_settings(ckpt["model_config"]), path, resuming=True)
            if cfg.init_from != "scratch":
                notes.append(f"init_from={cfg.init_from!r} not read: --resume continues {path}")
            return Start(with_model(cfg, model), ckpt, path, notes=notes)
        notes.append(f"--resume: no checkpoint in {cfg.out_dir!r}, starting at step 0")
    if cfg.init_from == "scratch":
        return Start(cfg, notes=notes)
    path, source = pretrained(cfg.init_from, warn)
    model = settle(cfg, asdict(source.config), path, resuming=False)
    weights = source.state_dict()
    wpe = "transformer.wpe.weight"
    crop = ""
    if model.block_size < source.config.block_size:
        weights[wpe] = weights[wpe][: model.block_size]  # (block_size, n_embd)
        crop = f", position embeddings cut to block_size={model.block_size}"
    n = sum(p.numel() for p in source.parameters())
    notes.append(f"init_from: {path}'s {n:,} weights{crop}; step 0, a fresh optimizer")
    return Start(with_model(cfg, model), path=path, weights=weights, notes=notes)


def pretrained(source, warn):
    """(path, CPU model) of init_from's source: a GPT-2 name, found in the local Hugging Face
    cache unless a path of that name exists; an HF GPT-2 directory (config.json + weights); or
    one of our checkpoints, a file or the newest of an out_dir that loads."""
    path = Path(source)
    if not path.exists() and source not in HF_GPT2:
        raise ConfigError(
            f"config key 'init_from': {source!r} is no file or directory, nor a GPT-2 name "
            f"({', '.join(HF_GPT2)}); 'scratch' trains from random weights"
        )
    try:
        if not path.exists():
            path = cached_hf(source)
        if (path / "config.json").is_file():
            return str(path), from_hf(path)
        if path.is_dir() and not list_checkpoints(path):
            raise FileNotFoundError(
                f"{path} holds neither config.json (an HF GPT-2 folder) nor ckpt_*.pt (an out_dir)"
            )
        return str(path), from_checkpoint(path, warn=warn)[0]
    except (OSError, ValueError) as e:  # CheckpointError is a ValueError
        raise CheckpointError(f"init_from={source!r}: {e}") from e


def settle(cfg, source, where, resuming):
    """The GPTConfig to train: `source` (a dict of its settings) with the run's own values where
    they may differ (the module's docstring); ConfigError naming the given model flags that
    contradict it."""
    own = asdict(cfg.model)
    unknown = sorted(set(source) - set(own))
    if unknown:
        raise ConfigError(f"{where} has model settings this version does not know: {unknown}")
    given = given_model_flags(cfg)
    if resuming:
        free = (set(given) & {*IMPL_KEYS, "dropout"}) | {"fp8"}
    else:
        free = {*IMPL_KEYS, "dropout", "low_precision_residual", "fp8"}
        if "block_size" in given and own["block_size"] <= source["block_size"]:
            free.add("block_size")
    differ = [k for k in given if k not in free and own[k] != source[k]]
    if differ:
        flags = {}  # flag -> the settings it gives that differ
        for k in differ:
            flags.setdefault(given[k], []).append(k)
        named = [
            f if f.startswith(f"--{ks[0]}=") else f"{f} ({', '.join(ks)})"
            for f, ks in flags.items()
        ]
        theirs = ", ".join(f"{k}={source[k]!r}" for k in differ)
        how = "--resume continues" if resuming else "--init_from starts from"
        crop = "; a smaller block_size cuts it" if "block_size" in differ and not resuming else ""
        raise ConfigError(
            f"{', '.join(named)} contradict{'s' * (len(named) == 1)} {where} ({theirs}): "
            f"{how} its model, drop the flag{crop}"
        )
    try:
        return GPTConfig(**{k: own[k] if k in free else source[k] for k in own})
    except ValueError as e:  # GPTConfig's own checks, of the checkpoint's values
        raise CheckpointError(f"{where}: {e}") from e


def resumed_settings(saved):
    """A checkpoint's model_config completed (model_io.checkpoint_settings), with the fast-path
    switches the run computed with: a resume with no flags continues that very computation."""
    impls = {k: saved[k] for k in IMPL_KEYS if saved.get(k) in IMPLS}
    return checkpoint_settings(saved) | impls


def given_model_flags(cfg):
    """{model setting: the flag that gave it} for those a config file or the command line gave,
    a preset's sizes included (--model=gpt2 gives n_layer, n_head and n_embd)."""
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    flags = {k: f"--{k}={v!r}" for k, v in cfg.given.items() if k in names}
    preset = cfg.given.get(PRESET_NAME)
    for k in PRESET_SIZES if preset else ():
        flags.setdefault(k, f"--{PRESET_NAME}={preset!r}")
    return flags


def with_model(cfg, model):
    """cfg with another model, checked again (batch_size * block_size under FP8, dropout with
    the activation budget)."""
    new = dataclasses.replace(cfg, model=model)
    new.given = cfg.given
    return new


def resume(run, start, notes):
    """Load the checkpoint's weights, optimizer, data position and RNG; returns its step."""
    cfg, procs, ckpt = run.cfg, run.procs, start.ckpt
    run.shard.load_state(run.raw_model, run.optimizer, ckpt)  # each rank keeps its part
    run.scaler.resume(ckpt, notes)  # fp16's loss scale (notes say what a dtype change does)
    note = run.loader.load_state_dict(ckpt["loader"])  # one position for all ranks, any W
    step = ckpt["step"]
    notes.append(f"resumed from {start.path} at step {step}")
    if note:  # the checkpoint's data order is not the one cfg asks for; it continues
        notes.append(note)
    written_by = len(ckpt["rng"]["torch"])
    if written_by == procs.world_size:
        set_rng_state(ckpt["rng"], procs.rank, procs.device)
    else:  # the data order still continues exactly; dropout masks cannot
        torch.manual_seed(cfg.seed + procs.rank + procs.world_size * step)
        notes.append(world_size_note(cfg, ckpt.get("train_config", {}), written_by, procs))
    start.ckpt = None  # host memory back
    return step


def world_size_note(cfg, saved, written_by, procs):
    """What resuming on another number of processes does: to the RNG and to tokens a step.
    saved: the checkpoint's train_config."""
    T, W = cfg.model.block_size, procs.world_size
    before = (
        saved.get("total_batch_size") or saved.get("batch_size", cfg.batch_size) * T * written_by
    )
    now = tokens_per_step(cfg, W)[0]
    if before == now:
        tokens = f"tokens/step stay {now:,}"
        if cfg.total_batch_size:
            tokens += " (total_batch_size: gradient accumulation makes up)"
    else:
        tokens = f"tokens/step {before:,} -> {now:,}"
        if not cfg.total_batch_size:
            tokens += f" (one micro-batch a process; --total_batch_size={before} keeps them)"
    return (
        f"written by {written_by} processes, resumed on {W}: RNG re-seeded, the run is not "
        f"bit-identical; {tokens}"
    )
