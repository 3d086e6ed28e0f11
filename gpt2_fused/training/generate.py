"""Sampling from a GPT: the prompt fills a static KV cache in one forward, then one step per token.

    out = generate(model, idx, max_new_tokens, temperature=0.8, top_k=200)   # (B, T + new)

The step has static shapes, so that one CUDA graph replays it at every position: keys and values
live in preallocated (B, nh, max_len, hs) buffers, one pair per layer; the position is a (1,)
int64 tensor on the device; attention reads all max_len keys under an additive mask (0 up to the
position, the dtype's lowest value after it); sampling runs inside the step too. A token then
costs one graph launch and no host sync, where eager decoding is bound by ~15 kernel launches per
layer (bench/RESULTS.md#sampling).

decode=  "graph"      the eager step captured in one torch.cuda.CUDAGraph: no compiler, set up by
                      a few eager steps and one capture. The default on CUDA: sample.py makes one
                      call per process and train.py a short one per sample, which a compile's
                      tens of seconds would dominate.
         "compile"    torch.compile(mode="reduce-overhead", fullgraph=True) of the step: Inductor's
                      fused kernels replayed as CUDA graphs, for long decoding runs. Compiles once
                      per batch size, cache length and sampling setting.
         "eager"      the same step launched kernel by kernel; the default on CPU.
         "recompute"  no cache: every token re-runs the window (nanoGPT's loop, the reference).
Speed of each: bench/RESULTS.md#sampling.

Context: each token sees at most the last block_size tokens (nanoGPT's crop): longer prompts are
cropped. The cache holds max_len = min(block_size, prompt + new tokens rounded up to LEN_MULTIPLE)
positions, so it fills only past block_size; from there on the window slides, which shifts every
position, and each later token re-runs the whole window in one eager forward, as recompute does.

Sampling: logits of the vocab_size real tokens only (the padded classifier columns are sliced
off, so no id >= vocab_size can be drawn), divided by temperature, cut by top-k and top-p with
tensor ops; the draw is argmax(p / E) = argmax(logits - log E) with E ~ Exp(1) i.i.d., an exact
draw from p (the exponential race, i.e. Gumbel-max) that, unlike torch.multinomial, needs no
host sync and, without top-p, no softmax. E is drawn outside the graph from the caller's
generator, one (B, vocab_size) fp32 tensor per token in every mode: a generator state gives the
same tokens in every mode, up to the rounding of the logits.
"""

import contextlib
import functools
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt2_fused.training.compile_cache import use_keyed_cache

MODES = ("graph", "compile", "eager", "recompute")
LEN_MULTIPLE = 128  # cache lengths are rounded up to this: fewer distinct graphs to build

# cuDNN attention builds a plan per new key length (~50 ms each on an H200, torch 2.11), and
# prefill and recompute lengths vary; flash / mem-efficient kernels need no plan.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# A decoding step attends to all max_len keys of the static cache, one length per Decoder, so
# one plan: there cuDNN's kernel goes first (4x the mem-efficient one's speed at 1558M, batch 1:
# bench/RESULTS.md#sampling).
_STEP_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *_SDPA_BACKENDS]


@torch.no_grad()
def generate(
    model,
    idx,
    max_new_tokens,
    temperature=1.0,
    top_k=None,
    top_p=None,
    generator=None,
    *,
    decode="auto",
    on_token=None,
):
    """Extend idx (B, T) by max_new_tokens sampled ids; returns (B, T + max_new_tokens).

    temperature=0 is greedy; top_k keeps the k most likely ids; top_p keeps the smallest set whose
    probability is >= top_p. decode: "auto" ("graph" on CUDA, else "eager") or one of MODES
    (module docstring); every mode gives the same tokens up to rounding. on_token(ids), if given,
    is called with each new (B,) column as soon as it is queued (still on the device).
    Call model.eval() first to turn dropout off.
    """
    model.check_idx(idx, check_length=False)
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    mode = _mode(decode, idx.device, top_p)
    B, T0 = idx.shape
    out = idx.new_empty(B, T0 + max_new_tokens)
    out[:, :T0] = idx
    sampling = (temperature, top_k, top_p)
    run = _recompute if mode == "recompute" else functools.partial(_cached, mode=mode)
    # graphs are captured and replayed on the current device's streams: make it the model's
    on_device = torch.cuda.device(idx.device) if idx.is_cuda else contextlib.nullcontext()
    if max_new_tokens:
        with sdpa_kernel(_SDPA_BACKENDS), on_device:
            run(model, out, T0, sampling, generator, on_token or (lambda ids: None))
    return out


def _recompute(model, out, T0, sampling, generator, on_token):
    """Fill out[:, T0:]: each token re-runs the window of the last block_size tokens."""
    bs = model.config.block_size
    for t in range(T0, out.size(1)):
        logits = model(out[:, max(0, t - bs) : t])[:, -1, :]
        noise = None
        if sampling[0] != 0:
            noise = torch.empty_like(logits).exponential_(1.0, generator=generator)
        out[:, t] = sample(logits, *sampling, noise)[:, 0]
        on_token(out[:, t])


def _cached(model, out, T0, sampling, generator, on_token, mode):
    """Fill out[:, T0:]: a prefill, then one step per token over the static cache."""
    bs = model.config.block_size
    new = out.size(1) - T0
    max_len = min(bs, -(-(min(T0, bs) + new) // LEN_MULTIPLE) * LEN_MULTIPLE)
    dec = _decoder(model, out.size(0), max_len, mode, sampling)
    cached = 0  # positions in the cache, as the device's dec.cache.pos has it (no sync)
    for t in range(T0, out.size(1)):
        if dec.noise is not None:
            dec.noise.exponential_(1.0, generator=generator)
        if t == T0 or cached == max_len:  # the first token, or the window slid
            window = out[:, max(0, t - bs) : t]
            dec.prefill(model, window)
            cached = window.size(1)
        else:
            dec.step(model)
            cached += 1
        out[:, t] = dec.tok[:, 0]
        on_token(out[:, t])


def check_sampling(max_new_tokens, temperature, top_k, top_p):
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def sample(logits, temperature, top_k, top_p, noise):
    """logits (B, V) fp32 -> next ids (B, 1) int64; noise (B, V) ~ Exp(1) i.i.d., None if greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        # the k-th largest logit: the minimum of an unsorted top-k (sorting the k ids would
        # cost as much again on a GPU)
        kth = torch.topk(logits, top_k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        # drop an id once the mass of the more likely ids already reaches top_p (never the first)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    # argmax(p / E), E ~ Exp(1): an exact draw from p (the exponential race); in logs,
    # argmax(logits - log E) (Gumbel-max), which needs no softmax. The clamp keeps a removed id
    # at -inf where E == 0 (-inf - log 0 would be NaN, and argmax takes NaN for the maximum).
    gumbel = -noise.log().clamp_min(torch.finfo(noise.dtype).min)
    return (logits + gumbel).argmax(dim=-1, keepdim=True)


def _mode(decode, device, top_p=None):
    if decode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if decode not in MODES:
        raise ValueError(f"decode must be 'auto' or one of {MODES}, got {decode!r}")
    if decode == "graph" and device.type != "cuda":
        raise ValueError(f"decode='graph' captures a CUDA graph; the model is on {device}")
    if decode == "compile" and device.type == "cuda" and top_p is not None and top_p < 1.0:
        # Inductor (torch 2.11, H200) fails to generate top-p's cumsum over the vocabulary (a
        # split scan: InductorError in codegen, bench/RESULTS.md#sampling); the graph mode gives the
        # same tokens
        warnings.warn("decode='compile' with top_p: decoding with decode='graph'", stacklevel=3)
        return "graph"
    return decode


class StaticKVCache:
    """Keys and values of every layer for max_len positions, preallocated, with the position that
    the next step decodes (pos, a (1,) tensor) and the additive attention mask that goes with it
    (0 for positions < pos, the dtype's lowest value after: not -inf, so that a kernel that
    splits the keys never meets a block of -inf alone; the step opens pos before attending).

    The attention layers call update(layer, k, v), or read(layer) once their GEMV has stored
    them (model.py); a prefill goes through Prefill.
    """

    one_token = True  # model.decode: a decoding step (one token a sequence), not a prefill

    def __init__(self, n_layer, batch_size, n_head, head_size, max_len, dtype, device):
        shape = (batch_size, n_head, max_len, head_size)
        # zeros, not empty: a masked key gets weight 0, and 0 * a NaN left in memory is NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.closed = torch.finfo(dtype).min
        self.mask = torch.full((1, 1, 1, max_len), self.closed, dtype=dtype, device=device)

    def tensors(self):
        return [*self.k, *self.v, self.pos, self.mask]

    def update(self, layer, k, v):
        """Store k, v (B, nh, 1, hs) at pos; return every key and value (B, nh, max_len, hs) and
        the mask (1, 1, 1, max_len)."""
        self.k[layer].index_copy_(2, self.pos, k)
        self.v[layer].index_copy_(2, self.pos, v)
        return self.read(layer)

    def read(self, layer):
        """Every key and value of a layer (B, nh, max_len, hs) and the mask (1, 1, 1, max_len),
        for a step that stored its own (model.Block._decode_row: in c_attn's GEMV)."""
        return self.k[layer], self.v[layer], self.mask


class Prefill:
    """The cache as a prefill of positions [0, T) sees it: store the keys and values, and attend
    causally among the T new ones (the same attention as without a cache)."""

    one_token = False

    def __init__(self, cache):
        self.cache = cache

    def update(self, layer, k, v):
        self.cache.k[layer][:, :, : k.size(2)] = k
        self.cache.v[layer][:, :, : v.size(2)] = v
        return k, v, None


def _step(model, cache, tok, noise, temperature, top_k, top_p):
    """Decode tok (B, 1) at cache.pos and replace it with the next token; the cache advances.
    Reads and writes only these buffers (and the weights): the unit that is graphed."""
    cache.mask.index_fill_(-1, cache.pos, 0.0)  # the new token's key becomes visible
    with sdpa_kernel(_STEP_BACKENDS, set_priority=True):
        logits = model.decode(tok, cache.pos, cache)
    cache.pos.add_(1)
    tok.copy_(sample(logits, temperature, top_k, top_p, noise))


@functools.cache
def _compiled_step():
    # one wrapper for the process: Dynamo's compiled code is kept per wrapper (backend)
    use_keyed_cache()  # not another version's custom-op graphs (GEMV ops)
    return torch.compile(_step, mode="reduce-overhead", fullgraph=True, dynamic=False)


class Decoder:
    """A static KV cache, the last token (B, 1) and the step that advances them, for one model,
    batch size, cache length, mode, sampling setting and dtype (key). generate keeps the last one
    per model (_decoder): compiled and captured graphs point into these buffers."""

    def __init__(self, model, key):
        batch_size, max_len, mode, sampling, dtype, _ = key
        cfg, device = model.config, model.lm_head.weight.device
        self.key, self.max_len, self.sampling = key, max_len, sampling
        head_size = cfg.n_embd // cfg.n_head
        self.cache = StaticKVCache(
            cfg.n_layer, batch_size, cfg.n_head, head_size, max_len, dtype, device
        )
        self.tok = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        # the draw's Exp(1) noise (B, vocab_size), refilled before every token; none when greedy
        self.noise = (
            None if sampling[0] == 0 else torch.ones(batch_size, cfg.vocab_size, device=device)
        )
        static = [*self.cache.tensors(), self.tok] + ([] if self.noise is None else [self.noise])
        for t in static:  # for cudagraphs: inputs at fixed addresses, not copied in at each call
            torch._dynamo.mark_static_address(t, guard=False)
        args = (self.cache, self.tok, self.noise, *sampling)
        if mode != "eager":  # lazy set-up (cuBLAS(Lt) handles, workspace, plans) outside graphs
            _step(model, *args)
        if mode == "eager":
            self._run = lambda model: _step(model, *args)
        elif mode == "compile":
            self._run = functools.partial(_run_compiled, args=args)
            for _ in range(3):  # cudagraph trees: a warm-up run, the recording, a replay
                self._run(model)
        else:
            self._run = _capture(functools.partial(_step, model, *args))
        # the warm-up steps above wrote garbage at positions the prefill resets or masks

    def prefill(self, model, idx):
        """Fill positions [0, T) of the cache from idx (B, T <= max_len) in one eager forward;
        tok becomes the next token."""
        T = idx.size(1)
        logits = model.decode(idx, slice(0, T), Prefill(self.cache))
        self.cache.pos.fill_(T)
        self.cache.mask.fill_(self.cache.closed)
        self.cache.mask[..., :T] = 0.0
        self.tok.copy_(sample(logits, *self.sampling, self.noise))

    def step(self, model):
        """One token: tok is decoded at cache.pos and replaced by the next one."""
        self._run(model)


def _run_compiled(model, args):
    torch.compiler.cudagraph_mark_step_begin()  # the previous replay's buffers may be reused
    _compiled_step()(model, *args)


def _capture(step):
    """step() captured in a CUDA graph; returns a function that replays it (ignoring its args)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS(Lt) plans, lazy inits
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return lambda model: graph.replay()


# model -> its last Decoder. Weak keys: a dropped model takes its cache along; the Decoder holds
# no reference to the model (its methods take it).
_DECODERS = weakref.WeakKeyDictionary()


def _decoder(model, batch_size, max_len, mode, sampling):
    device = model.lm_head.weight.device
    autocast = torch.is_autocast_enabled(device.type)
    # the dtype of the keys: the autocast dtype, else the weights'
    dtype = torch.get_autocast_dtype(device.type) if autocast else model.lm_head.weight.dtype
    key = (batch_size, max_len, mode, sampling, dtype, autocast)
    dec = _DECODERS.get(model)
    if dec is None or dec.key != key:
        _DECODERS.pop(model, None)  # free the old buffers before allocating new ones
        dec = _DECODERS[model] = Decoder(model, key)
    return dec


def release(model):
    """Drop model's decoder (its KV cache and CUDA graphs), so that their memory is free before
    the next generate() call builds another, e.g. in another mode (bench/bench_sample.py)."""
    _DECODERS.pop(model, None)
