"""The run's settings: `TrainConfig`, its parser (config files and --key=value) and its checks.

TrainConfig nests the model's own config (model.GPTConfig) as `cfg.model`; each field is declared
and checked once, in its dataclass. A config file is Python run with runpy (`name = value` lines);
`--name=value` arguments override it and are parsed as Python literals. Both name the fields of
either dataclass without a prefix (`n_layer = 12`, `--learning_rate=6e-4`), and `model` takes a
GPT-2 preset name (`--model=gpt2`). The command line's other forms (`--name value`, hyphens) are
cli.py's. Unknown keys and wrong types fail loudly (ConfigError, a usage error: exit status 2).
Each field's one-line meaning lives in its metadata and is what `python train.py --help` prints.
"""

import ast
import dataclasses
import math
import os
import runpy
import traceback
import types
import typing
from dataclasses import asdict, dataclass, field, replace

from gpt2_fused.training import cli
from gpt2_fused.training.compile_settings import BUFFER_REUSE, COMPILE_MODES
from gpt2_fused.training.errors import UsageError
from model import IMPLS, GPTConfig, setting


class ConfigError(UsageError):
    """A setting that is unknown, malformed, out of range or at odds with another."""


def small_model():
    """The default run's model: 4 layers, 128 wide, 128 tokens of context (7.2M parameters)."""
    return GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128)


@dataclass
class TrainConfig:
    """Every setting of a run. The defaults train a 4-layer GPT on the embedded text in about
    2 minutes on a 2-core CPU; configs/ holds the real recipes."""

    # not a field: {name: value} of the settings a config file or the command line gave
    # (load_config), which a checkpoint or init_from's weights must agree with; {} when built
    # directly
    given = types.MappingProxyType({})

    # data
    dataset: str = setting("embedded", '"embedded" (small text in the repo) or a dir of shards')
    shuffle: bool = setting(True, "new order of training windows each epoch, from seed")
    # the model (model.GPTConfig); "model = NAME" in a config file or --model=NAME starts it from a
    # GPT-2 preset, and its other fields (n_layer, softcap, loss_impl, ...) override that
    model: GPTConfig = field(default_factory=small_model)
    adamw_impl: str = setting("fast", '"fast": one Triton launch (CUDA fp32); "torch": torch.optim')
    # batch: total_batch_size tokens per optimizer step = batch_size * T * world_size * grad_accum
    # "auto": the largest of 64, 32, ..., 1 that fits the GPU (8 on a CPU; training/memory.py)
    batch_size: int | str = setting("auto", 'micro-batch per process (sequences), or "auto"')
    total_batch_size: int = setting(0, "tokens a step over all processes (0: one micro-batch each)")
    max_steps: int = setting(300, "optimizer steps")
    # optimizer: AdamW; linear warmup, then cosine to learning_rate * final_lr_frac
    learning_rate: float = setting(2e-3, "peak learning rate")
    final_lr_frac: float = setting(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = setting(50, "steps of linear warmup")
    weight_decay: float = setting(0.1, "AdamW weight decay (>= 2-D tensors only)")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "max global grad norm (0: no clipping)")
    # "muon" (gpt2_fused/training/muon.py): the blocks' matrices take Muon at muon_lr (the same
    # warmup and cosine); wte, wpe, gains and biases keep AdamW at learning_rate, on torch's
    # AdamW whatever adamw_impl says. Defaults as nanochat's and modded-nanogpt's, for 124M-1558M
    optimizer: str = setting("adamw", '"adamw" or "muon" (Muon for the blocks\' matrices)')
    muon_lr: float = setting(0.02, "Muon peak learning rate (its update has RMS ~ 1/sqrt(width))")
    muon_momentum: float = setting(0.95, "Muon Nesterov momentum")
    muon_weight_decay: float = setting(0.0, "Muon decoupled weight decay (W *= 1 - lr * wd)")
    # a training setting, not the model's: validation losses stay plain cross-entropy
    z_loss: float = setting(0.0, "PaLM's z_loss * lse^2 per token, in the logged train loss too")
    # evaluation and samples (0 disables the interval; val still runs after the last step)
    eval_interval: int = setting(50, "steps between validation passes")
    val_tokens: int = setting(8192, "tokens per validation pass, split over ranks")
    sample_interval: int = setting(150, "steps between printed samples")
    sample_tokens: int = setting(48, "tokens per printed sample")
    hellaswag: bool = setting(False, "HellaSwag acc_norm with each val loss")
    hellaswag_path: str = setting(
        "", '"" -> hellaswag/hellaswag_val.jsonl in data/cache (or $GPT2_FUSED_CACHE)'
    )
    # checkpoints and logs
    out_dir: str = setting("out", "checkpoints and log.jsonl go here")
    ckpt_interval: int = setting(100, "steps between checkpoints (0: only at the end)")
    keep_last: int = setting(2, "checkpoints kept, the newest (0: all; 1: no fallback)")
    resume: bool = setting(False, "continue from the newest checkpoint in out_dir")
    # the weights (and so the model's shape) a run that does not resume starts from
    # (gpt2_fused/training/start.py)
    init_from: str = setting(
        "scratch", '"scratch", "gpt2"..."gpt2-xl" (HF cache), an HF dir, a checkpoint or out_dir'
    )
    wandb: bool = setting(False, "log to Weights & Biases")
    wandb_project: str = setting("gpt2", "W&B project")
    wandb_run_name: str = setting("", "W&B run name")
    # system
    device: str = setting("auto", '"auto", "cpu", "cuda", "cuda:N"')
    dtype: str = setting(
        "auto",
        '"auto" (bf16 on CUDA, fp16 with a loss scale on GPUs without bf16, fp32 on CPU), '
        '"bfloat16", "float16", "float32"',
    )
    compile: bool | None = setting(None, "torch.compile the model (None: on for CUDA)")
    # "auto" is replaced by its pick at start-up (compile_settings.pick_mode): the printed config
    # and the checkpoint's show the mode that ran
    compile_mode: str = setting(
        "auto", 'torch.compile mode: "auto" (printed as its pick), "default", ...'
    )
    # 1 saves what the partitioner chooses; below 1 the backward recomputes cheap pointwise
    # activations instead of keeping them, trading a little time for memory
    activation_memory_budget: float = setting(1.0, "torch.compile activation memory budget")
    coordinate_descent_tuning: bool = setting(False, "Inductor block-size tuning while compiling")
    # Inductor's own limit is 1024: wider LayerNorms (774M, 1558M) would read their rows twice
    persistent_rows: int = setting(2048, "Inductor reduces rows up to this wide in registers")
    # Inductor leaves each LayerNorm's dw and db as partial sums of this many rows, then sums
    # them (compile_settings.layernorm_split): -1 picks 1024 up to 1024 wide, else 256
    layernorm_partial_rows: int = setting(
        -1, "LayerNorm dw/db partial sums (-1 auto, 0 Inductor's)"
    )
    # ...and finishes them with ATen's column sum (a memset and a kernel each) unless this swaps
    # in one Triton launch (compile_settings.triton_partial_sums)
    triton_partial_sums: bool = setting(True, "LayerNorm dw/db partial sums finished by Triton")
    # the tied wte's two gradients: the embedding's rows scattered into the classifier's, not
    # into zeros then added (compile_settings.scatter_tied_grad)
    tied_grad_scatter: bool = setting(True, "embedding rows scattered into the classifier's dW")
    # "no_inplace": with in-place buffers torch.compile has produced wrong losses and gradients
    # at 774M and 1558M (bench/RESULTS.md#compile); no cost measured
    buffer_reuse: str = setting("no_inplace", "Inductor buffer reuse: all, no_inplace or none")
    # the guard against wrongly compiled graphs (compile_guard.py); skipped with dropout > 0,
    # where the two forwards draw different masks
    check_compile: bool = setting(True, "check compiled loss against eager at step 0/after eval")
    # "model": compile, then wrap in DDP (nanoGPT); "ddp": compile the DDP module, so Dynamo
    # splits the graph at gradient buckets and each all-reduce overlaps the backward
    ddp_compile: str = setting("model", '"model" or "ddp": which of DDP and compile wraps')
    # under torchrun, how the ranks' grads are summed: "ddp" in DDP's buckets (after the compiled
    # backward, or overlapping it with ddp_compile="ddp"); "step" by one all-reduce of a flat
    # buffer after the step's last backward, which CUDA graphs allow (data_parallel.py); "auto":
    # "step" when the step runs as CUDA graphs, else "ddp"
    grad_sync: str = setting("auto", '"auto", "ddp" or "step": how ranks sum their grads')
    # under torchrun (data_parallel.py): "optimizer" is ZeRO-1, "full" is FSDP2 over the blocks
    shard: str = setting("none", '"none" (DDP), "optimizer" (AdamW state) or "full" (FSDP2)')
    seed: int = setting(1337, "seed of the init, dropout and data order")

    def __post_init__(self):
        """Every value in range, each error one line naming its key (ConfigError); the model's
        own fields are checked by GPTConfig.__post_init__."""
        cfg = self
        positive = ("learning_rate", "val_tokens", "muon_lr")
        non_negative = (
            "total_batch_size",
            "max_steps",
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "muon_weight_decay",
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
        if cfg.batch_size != "auto" and not (type(cfg.batch_size) is int and cfg.batch_size > 0):
            raise ConfigError(
                f"config key 'batch_size' must be > 0 or 'auto', got {cfg.batch_size!r}"
            )
        if not 0.0 <= cfg.final_lr_frac <= 1.0:
            raise ConfigError(
                f"config key 'final_lr_frac' must be in [0, 1], got {cfg.final_lr_frac}"
            )
        if not (math.isfinite(cfg.z_loss) and cfg.z_loss >= 0):
            raise ConfigError(
                f"config key 'z_loss' must be a finite number >= 0, got {cfg.z_loss!r}"
            )
        if cfg.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"config key 'optimizer': 'adamw' or 'muon', not {cfg.optimizer!r}")
        if not 0.0 <= cfg.muon_momentum < 1.0:
            raise ConfigError(
                f"config key 'muon_momentum' must be in [0, 1), got {cfg.muon_momentum!r}"
            )
        if cfg.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(
                f"config key 'dtype': auto, bfloat16, float16 or float32, not {cfg.dtype!r}"
            )
        if not 0.0 < cfg.activation_memory_budget <= 1.0:
            raise ConfigError(
                "config key 'activation_memory_budget' must be in (0, 1], "
                f"got {cfg.activation_memory_budget!r}"
            )
        # the tokens dW sums over in each FP8 GEMM ("auto" picks only rungs where this holds)
        rows = cfg.model.block_size * (16 if cfg.batch_size == "auto" else cfg.batch_size)
        if cfg.model.fp8 != "off" and rows % 16:
            raise ConfigError(
                f"fp8={cfg.model.fp8!r}: batch_size * block_size = {rows} must be a multiple of 16 "
                "(torch._scaled_mm's dimensions)"
            )
        if cfg.adamw_impl not in IMPLS:
            raise ConfigError(f"config key 'adamw_impl': 'fast' or 'torch', not {cfg.adamw_impl!r}")
        if cfg.activation_memory_budget < 1.0 and cfg.model.dropout > 0.0:
            raise ConfigError(
                "activation_memory_budget < 1 with dropout > 0: the compiled backward may "
                "recompute dropout with a fresh mask and silently get wrong gradients (pytorch "
                "issue #190758); use one or the other"
            )
        if cfg.persistent_rows < 1:
            raise ConfigError(
                f"config key 'persistent_rows' must be >= 1, got {cfg.persistent_rows}"
            )
        if cfg.layernorm_partial_rows < -1:
            raise ConfigError(
                "config key 'layernorm_partial_rows' must be -1 (auto), 0 (Inductor's) or a row "
                f"count, got {cfg.layernorm_partial_rows}"
            )
        if cfg.buffer_reuse not in BUFFER_REUSE:
            raise ConfigError(
                f"config key 'buffer_reuse': one of {tuple(BUFFER_REUSE)}, not {cfg.buffer_reuse!r}"
            )
        if cfg.ddp_compile not in ("model", "ddp"):
            raise ConfigError(
                f"config key 'ddp_compile': 'model' or 'ddp', not {cfg.ddp_compile!r}"
            )
        if cfg.grad_sync not in ("auto", "ddp", "step"):
            raise ConfigError(
                f"config key 'grad_sync': 'auto', 'ddp' or 'step', not {cfg.grad_sync!r}"
            )
        if cfg.grad_sync == "step" and (cfg.ddp_compile == "ddp" or cfg.shard == "full"):
            other = "shard='full'" if cfg.shard == "full" else "ddp_compile='ddp'"
            raise ConfigError(
                f"grad_sync='step' sums the grads without DDP or FSDP2: not with {other}"
            )
        if cfg.compile_mode not in COMPILE_MODES:
            raise ConfigError(
                f"config key 'compile_mode': one of {COMPILE_MODES}, not {cfg.compile_mode!r}"
            )
        if cfg.shard not in SHARD_MODES:
            raise ConfigError(f"config key 'shard': one of {SHARD_MODES}, not {cfg.shard!r}")
        if not cfg.init_from or cfg.init_from == "resume":
            raise ConfigError(
                f"config key 'init_from': {cfg.init_from!r} names no weights; to continue the "
                "newest checkpoint in out_dir pass --resume, else 'scratch', a GPT-2 name or a path"
            )
        # FSDP2's sharded weights: not measured
        if cfg.model.fp8 == "fused" and cfg.shard == "full":
            raise ConfigError(
                "fp8='fused' with shard='full': the fused FP8 kernels take whole weights and are "
                "untested under FSDP2; use --shard=optimizer or --fp8=tensorwise"
            )


SHARD_MODES = ("none", "optimizer", "full")  # gpt2_fused/training/data_parallel.py's classes
PRESET_NAME = "model"  # the key that names a preset instead of a field


def setting_types():
    """{name: type} of every setting: TrainConfig's, the model's in place of `model`, and `model`
    itself as a preset name."""
    own = {f.name: f.type for f in dataclasses.fields(TrainConfig) if f.name != PRESET_NAME}
    return own | {f.name: f.type for f in dataclasses.fields(GPTConfig)} | {PRESET_NAME: str}


def flat(cfg):
    """cfg as one {name: value} dict, the model's fields in place of `model` (for printing and
    logging; checkpoints keep the nested asdict)."""
    values = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        values.update(asdict(value) if f.name == PRESET_NAME else {f.name: value})
    return values


def help_text(doc, argv=()):
    """`doc` (the script's docstring) and one line per setting: --name=value  meaning, the value
    that of the config file and flags in `argv` (the defaults without any)."""
    cfg = load_config(argv)
    rows = []
    for f in dataclasses.fields(TrainConfig):
        if f.name != PRESET_NAME:
            rows.append((f"--{f.name}={getattr(cfg, f.name)!r}", f.metadata["doc"]))
            continue
        rows.append((f"--{f.name}=NAME", 'a GPT-2 preset ("gpt2"/"124M" ... "gpt2-xl"), or:'))
        for g in dataclasses.fields(GPTConfig):
            rows.append((f"  --{g.name}={getattr(cfg.model, g.name)!r}", g.metadata["doc"]))
    width = max(len(flag) for flag, _ in rows)
    lines = "\n".join(f"  {flag:<{width}}  {meaning}" for flag, meaning in rows)
    values = f"value with {' '.join(argv)}" if argv else "default"
    return f"{doc}\nSettings (--name={values}  meaning):\n{lines}"


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
        if str not in (typing.get_args(typ) or (typ,)):
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
    """argv: [config.py ...] [--key=value | --key value | --flag ...] -> TrainConfig."""
    fields = setting_types()
    switches = {k for k, typ in fields.items() if typ in (bool, bool | None)}
    overrides = {}
    for arg in cli.config_argv(argv, fields, switches, ConfigError):  # unknown keys stop there
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
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
                    near = cli.closest(key, fields)
                    raise ConfigError(f"unknown config key {key!r} in {arg}; did you mean {near}?")
                overrides[key] = _check_type(key, value, fields[key])
        else:
            raise ConfigError(f"unexpected argument {arg!r}: expected a config .py or --key=value")
    model_keys = {f.name for f in dataclasses.fields(GPTConfig)}
    model = {k: v for k, v in overrides.items() if k in model_keys}
    train = {k: v for k, v in overrides.items() if k not in model_keys and k != PRESET_NAME}
    try:  # the model's own checks
        preset = overrides.get(PRESET_NAME)
        base = GPTConfig.from_preset(preset) if preset else small_model()
        model = replace(base, **model)
    except ValueError as e:
        raise ConfigError(f"model settings: {e}") from None
    cfg = TrainConfig(model=model, **train)  # its __post_init__ checks the values
    cfg.given = types.MappingProxyType(overrides)
    return cfg


def tokens_per_step(cfg, world_size):
    """(tokens an optimizer step trains on over all processes, micro-batches a process takes for
    them): batch_size * block_size * world_size * grad_accum, which is total_batch_size, or one
    micro-batch a process where that is 0. The start-up report, the step lines and a resume's
    note all read it here; a ConfigError where the micro-batches cannot make it up."""
    T = cfg.model.block_size
    grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.batch_size, T, world_size)
    return cfg.batch_size * T * world_size * grad_accum, grad_accum


def grad_accum_steps(total_batch_size, batch_size, seq_len, world_size):
    """Micro-steps per optimizer step. total_batch_size 0 (the default) is one micro-batch per
    process: batch_size * seq_len * world_size tokens a step, whatever the number of processes."""
    per_micro = batch_size * seq_len * world_size
    if total_batch_size == 0:
        return 1
    if total_batch_size % per_micro:
        lower = total_batch_size // per_micro * per_micro
        fits = [f"total_batch_size={t}" for t in (lower, lower + per_micro) if t > 0]
        rows = total_batch_size // (seq_len * world_size)  # sequences a process takes a step
        batches = [b for b in range(min(batch_size, rows), 0, -1) if rows % b == 0][:1]
        if total_batch_size % (seq_len * world_size) == 0 and batches:
            fits.append(f"batch_size={batches[0]}")
        raise ConfigError(
            f"total_batch_size={total_batch_size} must be a multiple of batch_size * T * "
            f"world_size = {batch_size} * {seq_len} * {world_size} = {per_micro}: pass "
            f"{' or '.join(fits)}, or total_batch_size=0 (one micro-batch a process)"
        )
    return total_batch_size // per_micro
