"""Generation speed: the static KV cache's decode modes against the old decoding, in the same run.

    python -m bench.bench_sample             # GPU: GPT-2 124M and 1558M, batch 1 and 16, bf16
    python -m bench.bench_sample --quick     # seconds on CPU with a tiny model: checks the script

--modes (default old,graph,compile):
    old        the KV cache that GPT.generate had before the static one, kept here as
               the baseline: eager, the keys grow by one per step (bench/RESULTS.md#sampling)
    recompute  nanoGPT's loop: no cache, every token re-runs the window
    eager, graph, compile   the static cache, as generate.py's decode modes

Random-init weights (speed does not depend on them); every row samples the same number of tokens
(temperature 0.8, top-k 200, as sample.py's defaults) from the same random prompt. A row is a
first call (which compiles or captures, for graph and compile), then a timed call:
    tok/s      batch * new_tokens / seconds of the timed call, its prefill included
    first ms   the timed call's time to its first token (the prefill and one draw)
    warm-up s  the first call's seconds minus the timed call's: compile or capture
    max rank   the worst rank of a sampled token among the eager full forward's logits of the
               same sequence: below ~200 (top-k) for a path that computes what eager mode
               computes, thousands for a wrong graph
One JSON line per row as it is measured, then a table (last); the table is appended to --log.
"""

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.nn.attention import sdpa_kernel

from gpt2_fused.training import generate
from gpt2_fused.training.hardware import pick_device, resolve_dtype
from model import GPT, GPTConfig

TEMPERATURE, TOP_K = 0.8, 200


class DynamicKVCache:
    """GPT.generate's KV cache before the static one: keys and values of positions [0, pos) in
    buffers of block_size allocated at first use; a step attends to the pos + 1 keys so far."""

    def __init__(self, n_layer, max_len):
        self.k, self.v = [None] * n_layer, [None] * n_layer
        self.max_len, self.pos = max_len, 0

    def update(self, layer, k, v):
        end = self.pos + k.size(2)
        if self.k[layer] is None:
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.k[layer], self.v[layer] = k.new_empty(shape), v.new_empty(shape)
        self.k[layer][:, :, self.pos : end] = k
        self.v[layer][:, :, self.pos : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end], None  # no mask: all keys


@torch.no_grad()
def old_generate(model, idx, new_tokens, generator, on_token):
    """nanoGPT-style generate(use_cache=True) before the static cache, as it was."""
    B, T0 = idx.shape
    bs = model.config.block_size
    out = idx.new_empty(B, T0 + new_tokens)
    out[:, :T0] = idx
    cache = DynamicKVCache(model.config.n_layer, bs)
    with sdpa_kernel(generate._SDPA_BACKENDS):
        for t in range(T0, T0 + new_tokens):
            if 0 < cache.pos < bs:  # the cache holds out[:, :t-1] at their own positions
                window = out[:, t - 1 : t]
            else:  # first step, or the window slid: (re)fill the cache from the window
                cache.pos = 0
                window = out[:, max(0, t - bs) : t]
            logits = model.decode(window, slice(cache.pos, cache.pos + window.size(1)), cache)
            cache.pos += window.size(1)
            noise = torch.empty_like(logits).exponential_(1.0, generator=generator)
            out[:, t] = generate.sample(logits, TEMPERATURE, TOP_K, None, noise)[:, 0]
            on_token(out[:, t])
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(model, idx, new_tokens, mode, seed):
    """(tokens, seconds, seconds to the first token) of one call."""
    device = idx.device
    g = torch.Generator(device=device).manual_seed(seed)
    first = []

    def on_token(col):
        if not first:
            sync(device)
            first.append(time.perf_counter())

    sync(device)
    t0 = time.perf_counter()
    if mode == "old":
        out = old_generate(model, idx, new_tokens, g, on_token)
    else:
        kw = dict(generator=g, decode=mode, on_token=on_token)
        out = generate.generate(model, idx, new_tokens, TEMPERATURE, TOP_K, **kw)
    sync(device)
    return out, time.perf_counter() - t0, first[0] - t0


@torch.no_grad()
def max_rank(model, out, prompt_len):
    """The worst rank of the sampled tokens among the eager full forward's logits; None when the
    sequence is longer than block_size (generation then saw a cropped context)."""
    if out.size(1) - 1 > model.config.block_size:
        return None
    logits = model(out[:, :-1], all_positions=True)[:, prompt_len - 1 :]  # (B, new, V)
    chosen = logits.gather(-1, out[:, prompt_len:, None])
    return int((logits > chosen).sum(-1).max())


def measure(model, idx, new_tokens, mode):
    device = idx.device
    # the first call: compile / capture for graph and compile (the same shapes as the timed
    # call, so that it builds what the timed call uses); a few tokens for the others
    warm_tokens = new_tokens if mode in ("eager", "graph", "compile") else 4
    skips = counters["inductor"]["cudagraph_skips"]
    _, warm_s, _ = timed_call(model, idx, warm_tokens, mode, seed=0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out, sec, first = timed_call(model, idx, new_tokens, mode, seed=1)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    generate.release(model)  # free this mode's cache before the next one
    return {
        "batch": idx.size(0),
        "mode": mode,
        "tok_s": idx.size(0) * new_tokens / sec,
        "ms_per_token": 1e3 * sec / new_tokens,
        "first_ms": 1e3 * first,
        "warmup_s": warm_s - sec if warm_tokens == new_tokens else None,
        "max_rank": max_rank(model, out, idx.size(1)),
        "peak_gib": peak,
        # compile: graphs Inductor ran without CUDA graphs (TORCH_LOGS=perf_hints says why)
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
    }


def table(rows):
    lines = [
        "| model | batch | mode | tok/s | ms/token | first token ms | warm-up s | vs old "
        "| max rank | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    old = {(r["model"], r["batch"]): r["tok_s"] for r in rows if r["mode"] == "old"}
    for r in rows:
        base = old.get((r["model"], r["batch"]))
        ratio = "-" if base is None else f"{r['tok_s'] / base:.1f}x"
        warm = "-" if r["warmup_s"] is None else f"{r['warmup_s']:.1f}"
        rank = "-" if r["max_rank"] is None else str(r["max_rank"])
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['mode']} | {r['tok_s']:,.0f} | "
            f"{r['ms_per_token']:.2f} | {r['first_ms']:.1f} | {warm} | {ratio} | {rank} | "
            f"{r['peak_gib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="124M,1558M", help="comma-separated GPT-2 presets")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--modes", default="old,graph,compile", help="see above")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on a GPU, else float32")
    p.add_argument("--log", default="out/bench_sample.log")
    p.add_argument("--quick", action="store_true", help="tiny model, few tokens, on CPU")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - {"old", *generate.MODES})
    if unknown:
        p.error(f"unknown modes {unknown}; choose from old,{','.join(generate.MODES)}")

    if args.quick:
        args.device, args.batch_sizes = "cpu", "1,4"
        args.prompt_len, args.new_tokens = 8, 24
        if args.modes == p.get_default("modes"):
            modes = ["old", "recompute", "eager"]
    device = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.quick:
        configs = {"tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128)}
    else:
        configs = {name: GPTConfig.from_preset(name) for name in args.sizes.split(",")}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if device.type == "cuda":
        gpu = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    else:
        gpu = platform.processor() or platform.machine()
    import triton

    setup = (
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} git {sha.stdout.strip() or '?'} torch "
        f"{torch.__version__} triton {triton.__version__} device {device} ({gpu}) dtype {dtype} "
        f"prompt {args.prompt_len} new {args.new_tokens} temperature {TEMPERATURE} top-k {TOP_K}"
    )
    print(setup)
    start = time.perf_counter()
    rows = []
    for name, cfg in configs.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg)
        model = model.to(dtype).eval()
        for B in batch_sizes:
            idx = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), device=device)
            for mode in modes:
                row = {"model": name, **measure(model, idx, args.new_tokens, mode)}
                rows.append(row)
                print(
                    json.dumps(
                        {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
                    )
                )
        del model
        torch._dynamo.reset()  # drop the compiled steps (and their CUDA graphs) of this model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    log = Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    out = table(rows)
    with open(log, "a") as f:
        f.write(f"{setup}\n{out}\n\n")
    print(f"{time.perf_counter() - start:.0f} s; the table is appended to {log}")
    print(out)
    return rows


if __name__ == "__main__":
    main()

# Expected output (--quick, CPU, seconds): a setup line, 6 JSON rows (tiny x batch 1,4 x old /
# recompute / eager), a line with the seconds and the log, then an 8-line table. --quick checks
# the script only: CPU timings of a tiny model are dominated by the 50304-column classifier and
# sampling, so its ratios mean nothing. On an H200 the default run should take ~2-3 min, most of
# it compiling the step 4 times (2 sizes x 2 batch sizes) for the compile rows.
