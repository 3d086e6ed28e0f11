"""GPT-2 (the 124M..1558M miniseries) with a padded, masked vocabulary.

The classifier shares its weight with the token embedding, shape (padded_vocab_size, n_embd).
Rows >= vocab_size exist only to make the matmul shapes tensor-core friendly (50304 = 786 * 64):
they start at 0, the embedding never reads them and the loss masks their columns, so their
gradient is exactly 0 and AdamW (decoupled decay) keeps them at 0. Logits are never returned
for them, so sampling can never emit an id >= vocab_size.

Training calls `GPT.forward(idx, targets)`, which computes the loss from the final hidden
states with `fused_loss` and never builds the (B, T, V) logits. Generation
(gpt2_fused/training/generate.py, which builds on this module; this one imports only the kernels)
runs the blocks through a KV cache on a separate path, `GPT.decode`, so the training forward is
plain nanoGPT.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fused_loss import fused_linear_cross_entropy, linear_cross_entropy_reference
from gpt2_fused.kernels import attention, cublaslt, gemv
from gpt2_fused.kernels.attn_fp8 import attn_fp8, attn_state
from gpt2_fused.kernels.fast_paths import compute_dtype, dtype_runs, gpu_runs
from gpt2_fused.kernels.mlp import mlp_cublaslt
from gpt2_fused.kernels.mlp_fp8 import mlp_fp8, mlp_state

# name -> (n_layer, n_head, n_embd); block size 1024, vocab 50257 for all of them.
_PRESETS = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
_ALIASES = {"124M": "gpt2", "350M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}

# The fast-path switches: "fast" or "torch" (the plain PyTorch path, the same math). They say how
# a layer is computed, not what: a run may resume, or a checkpoint load, with other values.
IMPLS = ("fast", "torch")
IMPL_KEYS = ("loss_impl", "mlp_impl", "attn_impl")
FP8_RECIPES = ("off", "tensorwise", "rowwise", "fused")


def setting(default, doc):
    """A config field with its one-line meaning (what `python train.py --help` prints)."""
    return field(default=default, metadata={"doc": doc})


@dataclass
class GPTConfig:
    """The model: GPT-2 124M by default. Every field is checked here, once."""

    n_layer: int = setting(12, "transformer blocks")
    n_head: int = setting(12, "attention heads")
    n_embd: int = setting(768, "width of the residual stream")
    block_size: int = setting(1024, "context length, also the training sequence length T")
    vocab_size: int = setting(50257, "real tokens; ids >= vocab_size are invalid")
    padded_vocab_size: int = setting(50304, "rows of wte / lm_head (a multiple of 64)")
    dropout: float = setting(0.0, "dropout probability")
    bias: bool = setting(True, "biases in Linears and LayerNorms, as GPT-2")
    # (Gemma 2, modded-nanogpt) in the loss and in the logits forward returns
    softcap: float = setting(0.0, "logits -> softcap * tanh(logits / softcap); 0: off")
    # Under autocast the residual stream (and so its gradient) stays in the autocast dtype, as
    # llm.c keeps it in bf16, instead of the fp32 that the fp32 embeddings make it (nanoGPT): half
    # the bytes in every residual add and LayerNorm read. Matmuls, LayerNorm statistics and the
    # loss are computed as before; no effect without autocast (bench/RESULTS.md#precision).
    low_precision_residual: bool = setting(True, "residual stream in bf16 under autocast (llm.c)")
    loss_impl: str = setting("fast", '"fast": fused linear+cross-entropy; "torch": full logits')
    # the GELU and its gradient in cuBLASLt GEMM epilogues where the matmuls run in bf16/fp16 on
    # CUDA, the torch path elsewhere (bench/RESULTS.md#mlp)
    mlp_impl: str = setting("fast", '"fast": the GELU in cuBLASLt epilogues; "torch": F.gelu')
    # c_attn and the attention as one op whose backward lays out and sums the qkv gradient in one
    # pass, on Hopper in bf16/fp16 without dropout; the torch path elsewhere
    # (bench/RESULTS.md#attention)
    attn_impl: str = setting("fast", '"fast": c_attn + cuDNN attention, one op; "torch": F.sdpa')
    # how the blocks' GEMMs run, not what: checkpoints load into any recipe (core/fp8.py: the GPU)
    fp8: str = setting("off", '"off", "tensorwise", "rowwise" (torchao) or "fused": FP8 GEMMs')

    def __post_init__(self):
        if min(self.block_size, self.vocab_size, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError(f"sizes must be positive: {self}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}"
            )
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        for key in IMPL_KEYS:
            if getattr(self, key) not in IMPLS:
                raise ValueError(f"{key} must be 'fast' or 'torch', got {getattr(self, key)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (math.isfinite(self.softcap) and self.softcap >= 0):
            raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {self.softcap}")
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {FP8_RECIPES}, got {self.fp8!r}")
        if self.fp8 != "off" and self.n_embd % 16:  # torch._scaled_mm: K and N multiples of 16
            raise ValueError(f"fp8={self.fp8!r} needs n_embd divisible by 16, got {self.n_embd}")
        hs = self.n_embd // self.n_head  # fused: cuDNN's attention, as the bf16 fast path's
        if self.fp8 == "fused" and (self.dropout or hs % 8 or hs > 128):
            raise ValueError("fp8='fused' needs dropout=0.0 and n_embd / n_head in 8, 16, ..., 128")

    @classmethod
    def from_preset(cls, name, **overrides):
        """GPT-2 sizes by name: gpt2|124M, gpt2-medium|350M, gpt2-large|774M, gpt2-xl|1558M."""
        key = _ALIASES.get(name, name)
        if key not in _PRESETS:
            names = sorted(_PRESETS) + sorted(_ALIASES)
            raise ValueError(f"unknown preset {name!r}; choose one of {names}")
        n_layer, n_head, n_embd = _PRESETS[key]
        return cls(**{"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # (weight, bias) in bf16 when the optimizer keeps their casts (training/weight_casts.py)
        self.c_attn.weight_casts = self.c_proj.weight_casts = (None, None)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # decided once, here (as MLP.use_cublaslt): no device probing inside the forward. Off
        # under torchao's recipes, whose Float8Linears only the torch path calls
        fast = config.attn_impl == "fast" and config.dropout == 0 and config.fp8 in ("off", "fused")
        self.use_fast = fast and attention.available()
        self.fp8_state = attn_state(self.c_attn.weight.device) if config.fp8 == "fused" else None

    def forward(self, x, cache=None, layer=0, residual=None):
        """The attention branch of x, plus residual when given (on the fast path, added in
        c_proj's epilogue)."""
        y = None
        if self.use_fast and cache is None:  # attention_fast: None where it does not apply
            c_attn, c_proj = self.c_attn, self.c_proj
            y = attention.attention_fast(
                x, c_attn.weight, c_attn.bias, self.n_head, c_attn.weight_casts
            )
            if y is not None and residual is not None:
                out = attention.proj_residual_fast(
                    y, c_proj.weight, c_proj.bias, residual, c_proj.weight_casts
                )
                if out is not None:
                    return out
        if y is None:
            y = self.attend(self.c_attn(x), cache, layer)
        out = self.resid_dropout(self.c_proj(y))
        return out if residual is None else residual + out

    def attend(self, qkv, cache=None, layer=0, stored=False):
        """Attention from c_attn's output qkv (B, T, 3C) to its output (B, T, C), before c_proj.
        stored: the step's keys and values are in the cache already (Block._decode_row)."""
        B, T, C = qkv.size(0), qkv.size(1), self.n_embd
        q, k, v = qkv.split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        mask = None
        if cache is not None:
            # the keys/values to attend to and a mask: a prefill gets its T new ones and None
            # (causal among them), a decoding step the whole static cache (B, nh, max_len, hs)
            # and its additive mask (1, 1, 1, max_len) (gpt2_fused/training/generate.py)
            k, v, mask = cache.read(layer) if stored else cache.update(layer, k, v)
        dropout_p = self.dropout if self.training else 0.0
        # without a cache always causal (T == 1 too: one query, one key), so that no SymBool
        # reaches is_causal when a compiled model meets a second shape (dynamic shapes)
        causal = cache is None or (mask is None and T > 1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal
        )
        return y.transpose(1, 2).contiguous().view(B, T, C)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_fc.weight_casts = self.c_proj.weight_casts = (None, None)  # as CausalSelfAttention's
        self.dropout = nn.Dropout(config.dropout)
        # Decided here, once: probing for libcublasLt (ctypes) inside the forward would break
        # torch.compile's graph (tests/test_model.py checks that the forward reaches no probe)
        self.use_cublaslt = (
            config.mlp_impl == "fast"
            and config.fp8 in ("off", "fused")  # its GEMMs would bypass torchao's Float8Linears
            and torch.cuda.is_available()
            and gpu_runs("mlp")
            and cublaslt.available()
        )
        self.fp8_state = mlp_state(self.c_fc.weight.device) if config.fp8 == "fused" else None

    def forward(self, x, decode=False, residual=None):
        """The MLP of x, plus residual when given (added in c_proj's epilogue where it can be)."""
        w = (self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias)
        # mlp_cublaslt: None where it does not apply (CPU, fp32 matmuls); decoding (a prefill,
        # or a step of several rows: model.decode) keeps torch's calls
        out = None
        if self.use_cublaslt and not decode:
            # dropout comes between c_proj and the residual add: with it on, the add stays here
            fused = residual if self.dropout.p == 0 or not self.training else None
            casts = (*self.c_fc.weight_casts, *self.c_proj.weight_casts)
            out = mlp_cublaslt(x, *w, residual=fused, weight_casts=casts)
            if out is not None and fused is not None:
                return out
        if out is None:  # the modules' own forwards: a Linear swapped for another (FP8) counts
            out = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        out = self.dropout(out)
        return out if residual is None else residual + out


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        # where the GPU runs the GEMV kernel (kernels/fast_paths.py); decided here, as MLP's
        self.use_gemv = not torch.cuda.is_available() or gpu_runs("gemv")

    def forward(self, x, cache=None, layer=0):
        step = cache is not None and cache.one_token  # a decoding step, not a prefill
        row = step and self.use_gemv and not self.training
        if row and gemv.applies(x, self.attn.c_attn.weight):
            return self._decode_row(x, cache, layer)
        if self.attn.fp8_state is not None and cache is None:  # fp8="fused"
            return self._fp8_halves(x)
        x = self.attn(self.ln_1(x), cache, layer, residual=x)
        return self.mlp(self.ln_2(x), decode=cache is not None, residual=x)

    def _decode_row(self, x, cache, layer):
        """forward for a decoding step of one sequence (x (1, 1, C), bf16/fp16 on CUDA, cache a
        cache.one_token): four GEMVs (gpt2_fused/kernels/gemv.py), the LayerNorms in the
        prologues of c_attn and c_fc, the key and value stores in c_attn's epilogue, the
        residual adds in the projections'. Same math, fewer kernels: at batch 1 the small ones
        cost as much as reading the weights (bench/RESULTS.md#sampling)."""
        attn, mlp = self.attn, self.mlp
        k, v = cache.k[layer], cache.v[layer]
        qkv = gemv.gemv(x, attn.c_attn.weight, attn.c_attn.bias, ln=_ln_args(self.ln_1),
                        kv=(k, v, cache.pos))  # fmt: skip
        y = attn.attend(qkv, cache, layer, stored=True)
        x = gemv.gemv(y, attn.c_proj.weight, attn.c_proj.bias, residual=x)
        h = gemv.gemv(x, mlp.c_fc.weight, mlp.c_fc.bias, gelu=True, ln=_ln_args(self.ln_2))
        return gemv.gemv(h, mlp.c_proj.weight, mlp.c_proj.bias, residual=x)

    # fp8="fused": the halves with FP8 GEMMs and the casts in our kernels. Left eager by
    # torch.compile: their Triton launches and FP8 state are nothing Inductor would fuse into
    @torch.compiler.disable
    def _fp8_halves(self, x):
        a, m = self.attn, self.mlp  # x + attn(ln_1(x)), then that + mlp(ln_2(that))
        x = attn_fp8(x, self.ln_1, a.c_attn.weight, a.c_attn.bias, a.c_proj.weight, a.c_proj.bias,
                     a.n_head, a.fp8_state.on(x.device))  # fmt: skip
        return mlp_fp8(x, self.ln_2, m.c_fc.weight, m.c_fc.bias, m.c_proj.weight, m.c_proj.bias,
                       m.fp8_state.on(x.device))  # fmt: skip


def _ln_args(ln):
    """A LayerNorm as gemv's ln argument: (weight, bias or None, eps)."""
    return ln.weight, ln.bias, ln.eps


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
        self.lm_head.weight_casts = (None, None)  # the fused loss reads weight's (weight_casts.py)
        # the fused loss where the GPU runs it (kernels/fast_paths.py; the dtype: at each call)
        self.fused_loss = config.loss_impl == "fast" and (
            not torch.cuda.is_available() or gpu_runs("loss")
        )
        # PaLM's z-loss coefficient of training-mode losses (train.py sets it from --z_loss). An
        # attribute, not a forward argument: a compiled graph takes it as a constant, where a
        # float argument that differs between validation (0) and training turns symbolic
        self.z_loss = 0.0
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled down so the residual stream does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        with torch.no_grad():
            self.transformer.wte.weight[config.vocab_size :].zero_()
        if config.fp8 in ("tensorwise", "rowwise"):  # torchao's Float8Linear, same Parameters
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            recipe = Float8LinearConfig.from_recipe_name(config.fp8)
            for block in self.transformer.h:  # torchao also patches Inductor's min/max codegen
                convert_to_float8_training(block, config=recipe)  # a Block's four Linears

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

    def check_idx(self, idx, name="idx", check_length=True):
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

        With targets (B, T): the fp32 mean cross-entropy (targets == -100 are ignored), plus
        self.z_loss * lse^2 per token in training mode (PaLM's z-loss; eval mode leaves it out).
        Without: logits (B, 1, vocab_size) of the last position, or (B, T, vocab_size) with
        all_positions=True; padded columns are sliced off. Logits are returned in fp32, capped
        as the loss caps them (config.softcap).
        """
        self.check_idx(idx)
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
            loss_fn, kw = linear_cross_entropy_reference, {}
            if self.fused_loss and dtype_runs("loss", compute_dtype(x)):
                loss_fn, cast = fused_linear_cross_entropy, self.lm_head.weight_casts[0]
                dev = x.device.type
                low = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
                if cast is not None and low == cast.dtype:
                    kw = dict(weight_cast=cast)
                if low == torch.float16:
                    # it forms the gradients in the forward, before fp16's loss scale reaches
                    # them: a mean's 1/(B*T) would leave dx (~1e-6) in fp16's subnormals, so
                    # they are the sum's (~1e-2), and the mean is taken after
                    kw["reduction"] = "sum"
            loss = loss_fn(
                x,
                self.lm_head.weight,
                targets,
                vocab_size=self.config.vocab_size,
                softcap=self.config.softcap or None,
                z_loss=self.z_loss if self.training else 0.0,
                **kw,
            )
            if kw.get("reduction") == "sum":  # over the counted targets, as "mean" is
                loss = loss / (targets != -100).sum().clamp(min=1)
            return loss
        if not all_positions:
            x = x[:, -1:, :]  # keeps the time dim; a list index would be copied to the device
        return self._logits(x)

    def _logits(self, x):
        """fp32 logits (..., vocab_size) of the final hidden states x (..., C): the padded
        columns sliced off, capped in fp32 as the loss caps them."""
        logits = self.lm_head(x)[..., : self.config.vocab_size].float()
        cap = self.config.softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def _residual(self, x):
        """The embeddings' sum as the residual stream starts: as it is (fp32), or in the autocast
        dtype with low_precision_residual under autocast. The blocks' outputs are in the autocast
        dtype already, so the stream stays in it."""
        if self.config.low_precision_residual and torch.is_autocast_enabled(x.device.type):
            return x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def decode(self, idx, pos, cache):
        """Run idx (B, T) at positions pos (a slice, or a (T,) int64 tensor) through the blocks,
        whose attention stores and reads keys and values through cache: cache.update(layer, k, v)
        and cache.read(layer) return (keys, values, additive mask or None), and cache.one_token
        says whether this is a decoding step of one token over a static cache
        (gpt2_fused/training/generate.py). Returns the fp32 logits (B, vocab_size) of the last
        position."""
        wpe = self.transformer.wpe.weight[pos]  # a slice is a view: no arange, no gather
        x = self._residual(self.transformer.drop(self.transformer.wte(idx) + wpe))
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i)
        x = self.transformer.ln_f(x[:, -1, :])
        # the classifier stays with cuBLAS: faster than a GEMV at 50304 rows
        # (bench/RESULTS.md#classifier-on-cublas)
        return self._logits(x)

    @classmethod
    def from_state_dict(cls, config, state_dict, map_location="cpu"):
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
