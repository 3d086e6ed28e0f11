"""GPT-2 (the 124M..1558M miniseries) with a padded, masked vocabulary.

The classifier shares its weight with the token embedding, shape (padded_vocab_size, n_embd).
Rows >= vocab_size exist only to make the matmul shapes tensor-core friendly (50304 = 786 * 64):
they start at 0, the embedding never reads them and the loss masks their columns, so their
gradient is exactly 0 and AdamW (decoupled decay) keeps them at 0. Logits are never returned
for them, so sampling can never emit an id >= vocab_size.

Training calls `GPT.forward(idx, targets)`, which computes the loss from the final hidden
states with `fused_loss` and never builds the (B, T, V) logits. Generation (generate.py) runs
the blocks through a KV cache on a separate path (`_decode`), so the training forward is plain
nanoGPT.
"""

import json
import math
import struct
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import generate
from checkpoint import load_checkpoint
from fused_loss import cublaslt, fused_linear_cross_entropy, linear_cross_entropy_reference
from fused_loss.mlp import mlp_cublaslt, mlp_reference

# name -> (n_layer, n_head, n_embd); block size 1024, vocab 50257 for all of them.
_PRESETS = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
_ALIASES = {"124M": "gpt2", "350M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}


# Settings added after checkpoints were first written, with the value those older checkpoints
# were trained with (where it is not the current default); checkpoint_settings applies them.
PREDATED = {"low_precision_residual": False}


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257  # real tokens; ids >= vocab_size are invalid
    padded_vocab_size: int = 50304  # rows of wte / lm_head, a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, as GPT-2
    loss_impl: str = "fused"  # "fused" -> fused_linear_cross_entropy, "torch" -> the reference
    # Under autocast, keep the residual stream (and so its gradient) in the autocast dtype, as
    # llm.c keeps it in bf16, instead of the fp32 that the fp32 embeddings make it (nanoGPT):
    # half the bytes in every residual add and LayerNorm read. Matmuls, LayerNorm statistics and
    # the loss are computed as before; no effect without autocast. On by default since session
    # 17 (bench/RESULTS.md runs 41-42: +4 % tok/s at 124M, -4.8 GiB at 1558M, val loss within
    # the seed-to-seed spread of the fp32 stream's over 1000 steps).
    low_precision_residual: bool = True
    # "cublaslt": the MLP's GELU and its gradient run in cuBLASLt GEMM epilogues
    # (fused_loss/mlp.py) where the matmuls run in bf16/fp16 on CUDA, the torch path elsewhere;
    # "torch": F.linear + F.gelu everywhere. Same math; H200: +4.0 % tok/s at 124M, +0.9 % at
    # 1558M (bench/RESULTS.md, session 20).
    mlp_impl: str = "cublaslt"

    def __post_init__(self):
        if min(self.block_size, self.vocab_size, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError(f"sizes must be positive: {self}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}"
            )
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.loss_impl not in ("fused", "torch"):
            raise ValueError(f"loss_impl must be 'fused' or 'torch', got {self.loss_impl!r}")
        if self.mlp_impl not in ("torch", "cublaslt"):
            raise ValueError(f"mlp_impl must be 'torch' or 'cublaslt', got {self.mlp_impl!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_preset(cls, name, **overrides):
        """GPT-2 sizes by name: gpt2|124M, gpt2-medium|350M, gpt2-large|774M, gpt2-xl|1558M."""
        key = _ALIASES.get(name, name)
        if key not in _PRESETS:
            names = sorted(_PRESETS) + sorted(_ALIASES)
            raise ValueError(f"unknown preset {name!r}; choose one of {names}")
        n_layer, n_head, n_embd = _PRESETS[key]
        return cls(**{"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, **overrides})


def checkpoint_settings(saved):
    """A checkpoint's model_config completed: a key it predates takes the value it was trained
    with (PREDATED), else the default. Keys GPTConfig does not know are kept for the caller to
    name."""
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    return defaults | PREDATED | saved


def pick_device(name="auto"):
    """ "auto" -> cuda if available else cpu; also "cpu", "cuda", "cuda:N"."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"bad device {name!r}: use auto, cpu, cuda or cuda:N") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"unsupported device {name!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x, cache=None, layer=0):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        mask = None
        if cache is not None:
            # the keys/values to attend to and a mask: a prefill gets its T new ones and None
            # (causal among them), a decoding step the whole static cache (B, nh, max_len, hs)
            # and its additive mask (1, 1, 1, max_len) (generate.py)
            k, v, mask = cache.update(layer, k, v)
        dropout_p = self.dropout if self.training else 0.0
        # without a cache always causal (T == 1 too: one query, one key), so that no SymBool
        # reaches is_causal when a compiled model meets a second shape (dynamic shapes)
        causal = cache is None or (mask is None and T > 1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        # Decided here, once: probing for libcublasLt (ctypes) inside the forward would break
        # torch.compile's graph (tests/test_model.py checks that the forward reaches no probe)
        self.use_cublaslt = (
            config.mlp_impl == "cublaslt" and torch.cuda.is_available() and cublaslt.available()
        )

    def forward(self, x):
        w = (self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias)
        # mlp_cublaslt: None where it does not apply (CPU, fp32 matmuls)
        out = mlp_cublaslt(x, *w) if self.use_cublaslt else None
        return self.dropout(mlp_reference(x, *w) if out is None else out)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.padded_vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled down so the residual stream does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        with torch.no_grad():
            self.transformer.wte.weight[config.vocab_size :].zero_()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameters without the padded vocab rows; non_embedding also drops wpe (as nanoGPT).

        wte stays counted either way: it is also the classifier.
        """
        n = sum(p.numel() for p in self.parameters())
        n -= (self.config.padded_vocab_size - self.config.vocab_size) * self.config.n_embd
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self):
        """Training FLOPs per token, PaLM appendix B: 6N + 12 * n_layer * n_embd * block_size."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size

    def _check_idx(self, idx, name="idx", check_length=True):
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            got = idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise TypeError(f"{name} must be an int64 (or int32) tensor, got {got}")
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"{name} must be (B, T) with T >= 1, got shape {tuple(idx.shape)}")
        if check_length and idx.size(1) > self.config.block_size:
            raise ValueError(
                f"sequence length {idx.size(1)} exceeds block_size={self.config.block_size}"
            )
        # CPU and eager only: on CUDA this check would synchronise the host with the GPU every
        # step, and under torch.compile its data-dependent branch would break the graph
        if idx.device.type == "cpu" and idx.numel() and not torch.compiler.is_compiling():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"{name} contains token id {bad}, outside [0, {self.config.vocab_size})"
                )

    def forward(self, idx, targets=None, *, all_positions=False):
        """idx (B, T) int64 token ids.

        With targets (B, T): the fp32 mean cross-entropy (targets == -100 are ignored).
        Without: logits (B, 1, vocab_size) of the last position, or (B, T, vocab_size) with
        all_positions=True; padded columns are sliced off. Logits are returned in fp32.
        """
        self._check_idx(idx)
        B, T = idx.size()
        if targets is not None and tuple(targets.shape) != (B, T):
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {(B, T)}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self._residual(
            self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        )
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            loss_fn = (
                fused_linear_cross_entropy
                if self.config.loss_impl == "fused"
                else linear_cross_entropy_reference
            )
            return loss_fn(x, self.lm_head.weight, targets, vocab_size=self.config.vocab_size)
        if not all_positions:
            x = x[:, -1:, :]  # keeps the time dim; a list index would be copied to the device
        return self.lm_head(x)[..., : self.config.vocab_size].float()

    def _residual(self, x):
        """The embeddings' sum as the residual stream starts: as it is (fp32), or in the autocast
        dtype with low_precision_residual under autocast. The blocks' outputs are in the autocast
        dtype already, so the stream stays in it."""
        if self.config.low_precision_residual and torch.is_autocast_enabled(x.device.type):
            return x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def _decode(self, idx, pos, cache):
        """Run idx (B, T) at positions pos (a slice, or a (T,) int64 tensor) through the blocks,
        whose attention stores and reads keys/values through cache.update (generate.py); return
        the fp32 logits (B, vocab_size) of the last position."""
        wpe = self.transformer.wpe.weight[pos]  # a slice is a view: no arange, no gather
        x = self._residual(self.transformer.drop(self.transformer.wte(idx) + wpe))
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i)
        x = self.transformer.ln_f(x[:, -1, :])
        return self.lm_head(x)[:, : self.config.vocab_size].float()

    def generate(
        self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None, **kw
    ):
        """Extend idx (B, T) by max_new_tokens sampled ids: generate.generate (a static KV cache,
        CUDA graphs, the context cropped to block_size as nanoGPT). Call model.eval() first."""
        return generate.generate(
            self, idx, max_new_tokens, temperature, top_k, top_p, generator, **kw
        )

    @classmethod
    def _from_state_dict(cls, config, state_dict, map_location="cpu"):
        """Build a model from a state dict without a throwaway random init (meta device)."""
        with torch.device("meta"):
            model = cls(config)
        expected = set(model.state_dict())
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(
                f"state dict does not match GPT({config}): missing keys {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''}"
            )
        for name, t in model.state_dict().items():
            if tuple(state_dict[name].shape) != tuple(t.shape):
                raise ValueError(
                    f"{name}: shape {tuple(state_dict[name].shape)} in the weights, "
                    f"{tuple(t.shape)} expected for {config}"
                )
        state_dict = {k: v.to(map_location) for k, v in state_dict.items()}
        model.load_state_dict(state_dict, assign=True)
        model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced the tied pair
        return model

    @classmethod
    def from_checkpoint(cls, path, map_location="cpu"):
        """Load (model, ckpt) from a checkpoint file, or the newest ckpt_*.pt of a directory."""
        path = Path(path)
        if path.is_dir():
            ckpts = sorted(path.glob("ckpt_*.pt"))
            if not ckpts:
                raise FileNotFoundError(f"no ckpt_*.pt checkpoint in directory {path}")
            path = ckpts[-1]  # names carry a zero-padded step, so the last is the newest
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        ckpt = load_checkpoint(path, map_location)  # CheckpointError naming it if damaged
        if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
            keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
            raise ValueError(
                f"{path} is not a checkpoint: needs 'model' and 'model_config', has {keys}"
            )
        known = {f.name for f in fields(GPTConfig)}
        unknown = sorted(set(ckpt["model_config"]) - known)
        if unknown:
            raise ValueError(f"{path}: unknown model_config keys {unknown}; known: {sorted(known)}")
        config = GPTConfig(**checkpoint_settings(ckpt["model_config"]))
        return cls._from_state_dict(config, ckpt["model"], map_location), ckpt

    @classmethod
    def from_hf(cls, directory):
        """Import an HF GPT-2 directory (config.json + model.safetensors or pytorch_model.bin).

        HF's Conv1D weights are stored (in, out) and are transposed; the vocab is padded to a
        multiple of 64 with zero rows. Returns a CPU fp32 model.
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
            weights = torch.load(
                directory / "pytorch_model.bin", map_location="cpu", weights_only=True
            )
        else:
            raise FileNotFoundError(
                f"{directory} has neither model.safetensors nor pytorch_model.bin"
            )
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
        return cls._from_state_dict(config, sd)

    def save_hf(self, directory):
        """Export to HF GPT-2's layout: config.json + model.safetensors (fp32, padding dropped)."""
        cfg = self.config
        if not cfg.bias:
            raise ValueError("HF GPT-2 has biases everywhere; cannot export a bias=False model")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for k, v in self.state_dict().items():
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


__all__ = ["GPT", "GPTConfig", "checkpoint_settings", "pick_device"]
