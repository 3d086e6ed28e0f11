"""Models outside training: loading a training checkpoint (older ones included), and HF GPT-2
directories (config.json + model.safetensors) in both directions, without extra packages."""

import json
import os
import struct
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from gpt2_fused.training.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from model import GPT, IMPL_KEYS, GPTConfig

# Settings added after checkpoints were first written, with the value those older checkpoints
# were trained with (where it is not the current default); checkpoint_settings applies them.
PREDATED = {"low_precision_residual": False}


def checkpoint_settings(saved):
    """A checkpoint's model_config completed: a key it predates takes the value it was trained
    with (PREDATED), else the default. The fast-path switches (IMPL_KEYS) and fp8 say how the run
    that wrote it computed, not what the model is: they take today's defaults (an FP8 run's
    weights load into a plain model). Keys GPTConfig does not know are kept for the caller to
    name."""
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    how = (*IMPL_KEYS, "fp8")
    return defaults | PREDATED | {k: v for k, v in saved.items() if k not in how}


def from_checkpoint(path, map_location="cpu", warn=None, say=None):
    """Load (model, ckpt) from a checkpoint file, or from the newest ckpt_*.pt of a directory
    that loads: as --resume does, a newer one that does not is skipped with a line through `warn`
    (default: stderr) naming it; unlike --resume, nothing is renamed, as reading a run's
    directory should not change it. A missing path is a FileNotFoundError naming it. say: called
    with "loaded FILE (step N)" once one has loaded."""
    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        return _loaded(path, _from_file(path, map_location), say)
    ckpts = list_checkpoints(path)
    if not ckpts:
        raise FileNotFoundError(f"no ckpt_*.pt checkpoint in directory {path}")
    failed = []
    for newest in reversed(ckpts):
        try:
            loaded = _from_file(Path(newest), map_location)
        except CheckpointError as e:
            failed.append(e)
            continue
        for e in failed:
            (warn or _stderr)(f"warning: {e}; skipped it and loaded {newest}")
        return _loaded(newest, loaded, say)
    if len(failed) == 1:
        raise failed[0]
    raise CheckpointError(f"no checkpoint in {path} loads: " + "; ".join(map(str, failed)))


def _loaded(path, loaded, say):
    if say is not None:
        say(f"loaded {path} (step {loaded[1].get('step')})")
    return loaded


def _stderr(line):
    print(line, file=sys.stderr, flush=True)


def _from_file(path, map_location):
    ckpt = load_checkpoint(path, map_location)  # CheckpointError naming it if damaged
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(
            f"{path} is not a checkpoint: needs 'model' and 'model_config', has {keys}"
        )
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(ckpt["model_config"]) - known)
    if unknown:
        raise CheckpointError(
            f"{path}: unknown model_config keys {unknown}; known: {sorted(known)}"
        )
    try:  # settings out of range, missing or misshapen weights: named with the file
        config = GPTConfig(**checkpoint_settings(ckpt["model_config"]))
        return GPT.from_state_dict(config, ckpt["model"], map_location), ckpt
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def from_hf(directory):
    """Import an HF GPT-2 directory (config.json + model.safetensors or pytorch_model.bin).

    HF's Conv1D weights are stored (in, out) and are transposed; the vocab is padded to a
    multiple of 64 with zero rows. Returns a CPU fp32 model, softcap 0 (GPT-2 has none).
    """
    directory = Path(directory)
    hf = _read_hf_config(directory)
    vocab = hf["vocab_size"]
    config = GPTConfig(
        block_size=hf["n_positions"],
        vocab_size=vocab,
        padded_vocab_size=(vocab + 63) // 64 * 64,
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
    )
    if (directory / "model.safetensors").is_file():
        weights = _read_safetensors(directory / "model.safetensors")
    elif (directory / "pytorch_model.bin").is_file():
        weights = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor pytorch_model.bin")
    # Original OpenAI uploads have no "transformer." prefix and carry the causal-mask buffers.
    weights = {k.removeprefix("transformer."): v for k, v in weights.items()}
    weights = {
        k: v for k, v in weights.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))
    }
    head = weights.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, weights.get("wte.weight", head)):
        raise ValueError(f"{directory}: lm_head.weight differs from wte.weight (untied head)")
    sd = {}
    for k, v in weights.items():
        v = v.float()
        if k.endswith(_CONV1D):
            v = v.t()
        if k == "wte.weight" and v.size(0) == vocab:
            v = torch.cat([v, v.new_zeros(config.padded_vocab_size - vocab, v.size(1))])
        sd["transformer." + k] = v.contiguous()
    if "transformer.wte.weight" in sd:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return GPT.from_state_dict(config, sd)


# the GPT-2 names init_from takes -> their Hugging Face repos (the hub's older ids, "gpt2", ...,
# name the same weights and have cache folders of their own)
HF_GPT2 = {
    name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
}


def hf_cache():
    """The local Hugging Face hub cache, found as huggingface_hub finds it: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub:
        return Path(hub).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def cached_hf(name):
    """The folder of GPT-2 `name` (a key of HF_GPT2) in the local Hugging Face cache that holds
    config.json and weights: hub/models--{owner}--{repo}/snapshots/{revision}/, the one
    refs/main points at first. Never downloads: FileNotFoundError, naming the cache and the
    command that fills it, when no snapshot is complete."""
    cache, repo = hf_cache(), HF_GPT2[name]
    for repo_id in (repo, name):
        folder = cache / ("models--" + repo_id.replace("/", "--"))
        main = folder / "refs" / "main"
        revisions = [main.read_text().strip()] if main.is_file() else []
        snapshots = folder / "snapshots"
        if snapshots.is_dir():  # newest first after main's
            others = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            revisions += [p.name for p in others]
        for revision in revisions:
            snapshot = snapshots / revision
            weights = ("model.safetensors", "pytorch_model.bin")
            if (snapshot / "config.json").is_file() and any(
                (snapshot / w).is_file() for w in weights
            ):
                return snapshot
    raise FileNotFoundError(
        f"{name} is not in the Hugging Face cache {cache} (nothing is downloaded here); fill it "
        f"on a machine with network: hf download {repo} config.json model.safetensors (the "
        "huggingface_hub package's command; then copy the cache, or point $HF_HOME at it), or "
        "pass the path of an HF GPT-2 directory"
    )


def save_hf(model, directory):
    """Export to HF GPT-2's layout: config.json + model.safetensors (fp32, padding dropped)."""
    cfg = model.config
    if not cfg.bias:
        raise ValueError("HF GPT-2 has biases everywhere; cannot export a bias=False model")
    if cfg.softcap:
        raise ValueError(
            f"HF GPT-2 has no logit softcap; cannot export a softcap={cfg.softcap} model"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue  # tied to wte; HF re-ties it on load
        v = v.detach().float().cpu()
        k = k.removeprefix("transformer.")
        if k == "wte.weight":
            v = v[: cfg.vocab_size]
        if k.endswith(_CONV1D):
            v = v.t()
        tensors["transformer." + k] = v.contiguous()
    hf = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": 50256 if cfg.vocab_size > 50256 else None,  # GPT-2's <|endoftext|>
        "eos_token_id": 50256 if cfg.vocab_size > 50256 else None,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    _write_safetensors(directory / "model.safetensors", tensors)


# HF stores these as Conv1D, weight (in, out): the transpose of nn.Linear's (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _read_hf_config(directory):
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not an HF model directory")
    hf = json.loads(path.read_text())
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{path}: model_type {hf['model_type']!r} is not gpt2")
    unsupported = {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "reorder_and_upcast_attn": (False,),
        "tie_word_embeddings": (True,),
    }
    for key, ok in unsupported.items():
        if key in hf and hf[key] not in ok:
            raise ValueError(f"{path}: {key}={hf[key]!r} is not supported (need one of {ok})")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise ValueError(f"{path}: n_inner={hf['n_inner']} is not supported (need 4 * n_embd)")
    if abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        raise ValueError(f"{path}: layer_norm_epsilon={hf['layer_norm_epsilon']} (need 1e-5)")
    return hf


# safetensors: u64 little-endian header size, a JSON header {name: {dtype, shape, data_offsets}},
# then the raw little-endian tensor bytes. Read and written here so no extra package is needed.
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_safetensors(path):
    data = np.memmap(path, dtype=np.uint8, mode="r")  # tensors are copied out one at a time
    if len(data) < 8:
        raise ValueError(f"{path}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    if 8 + n > len(data):
        raise ValueError(f"{path}: header size {n} runs past the end of the file")
    header = json.loads(data[8 : 8 + n].tobytes())
    header.pop("__metadata__", None)
    body = data[8 + n :]
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= len(body):
            raise ValueError(f"{path}: tensor {name} has offsets outside the file")
        raw = torch.from_numpy(np.array(body[begin:end]))
        out[name] = raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def _write_safetensors(path, tensors):
    names = {v: k for k, v in _ST_DTYPES.items()}
    header, offset, chunks = {}, 0, []
    for name, t in tensors.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # keep the data 8-byte aligned
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in chunks:
            f.write(raw)
    tmp.replace(path)  # never leave a half-written file under the real name


# what sample.py and eval_hellaswag.py print as one line (gpt2_fused/training/errors.py)
USER_ERRORS = {CheckpointError: "checkpoint error", OSError: "error", ValueError: "error"}


def load_model(ckpt=None, hf_dir=None, device="cpu", dtype=torch.float32, say=None):
    """Our checkpoint (file or out_dir) or an HF GPT-2 directory -> eval-mode GPT on device.
    say: called with a line naming what was loaded (the checkpoint file and its step)."""
    if (ckpt is None) == (hf_dir is None):
        raise ValueError("give exactly one of ckpt or hf_dir")
    if ckpt is not None:
        model, _ = from_checkpoint(ckpt, map_location="cpu", say=say)
    else:
        model = from_hf(hf_dir)
        if say is not None:
            say(f"loaded {hf_dir} (HF GPT-2 weights)")
    # Whole-model cast, not autocast: decoding is latency-bound and the cast weights halve traffic.
    return model.to(device=device, dtype=dtype).eval()
