"""Generation throughput: KV cache vs full recompute (nanoGPT's loop), in the same run.

    python bench/bench_sample.py             # GPU: GPT-2 124M and 1558M, batch 1 and 16, bf16
    python bench/bench_sample.py --quick     # seconds on CPU with a tiny model: checks the script

Random-init weights (speed does not depend on them); every row samples the same number of tokens
(temperature 0.8, top-k 200, as sample.py's defaults) from a random prompt, after one warm-up call.
tokens/s counts generated tokens over all samples of the batch: batch * new_tokens / seconds.
Prints a table at the end and appends it, with the set-up, to --log.
"""

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from model import GPT, GPTConfig, pick_device  # noqa: E402
from sample import resolve_dtype  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generate(model, idx, new_tokens, use_cache, device):
    """Seconds for one generate call of new_tokens, after a short warm-up call."""
    g = torch.Generator(device=device)
    model.generate(
        idx, 4, temperature=0.8, top_k=200, generator=g.manual_seed(0), use_cache=use_cache
    )
    sync(device)
    t0 = time.perf_counter()
    model.generate(
        idx, new_tokens, temperature=0.8, top_k=200, generator=g.manual_seed(1), use_cache=use_cache
    )
    sync(device)
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="124M,1558M", help="comma-separated GPT-2 presets")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on a GPU, else float32")
    p.add_argument("--log", default="out/bench_sample.log")
    p.add_argument("--quick", action="store_true", help="tiny model, few tokens, on CPU")
    args = p.parse_args(argv)

    if args.quick:
        args.device, args.batch_sizes = "cpu", "1,4"
        args.prompt_len, args.new_tokens = 8, 24
    device = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.quick:
        configs = {"tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128)}
    else:
        configs = {name: GPTConfig.from_preset(name) for name in args.sizes.split(",")}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    gpu = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    setup = (
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} git {sha.stdout.strip() or '?'} torch "
        f"{torch.__version__} device {device} ({gpu}) dtype {dtype} prompt {args.prompt_len} "
        f"new {args.new_tokens}"
    )
    print(setup)
    rows = []
    for name, cfg in configs.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg)
        model = model.to(dtype).eval()
        for B in batch_sizes:
            idx = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), device=device)
            for use_cache in (True, False):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                sec = time_generate(model, idx, args.new_tokens, use_cache, device)
                peak = (
                    torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0
                )
                row = {
                    "model": name,
                    "batch": B,
                    "mode": "kv-cache" if use_cache else "recompute",
                    "tok_s": B * args.new_tokens / sec,
                    "ms_per_step": 1e3 * sec / args.new_tokens,
                    "peak_gib": peak,
                }
                rows.append(row)
                print(
                    json.dumps(
                        {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
                    )
                )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    lines = [
        "| model | batch | mode | tokens/s | ms/step | speed-up | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(
            x["tok_s"]
            for x in rows
            if (x["model"], x["batch"], x["mode"]) == (r["model"], r["batch"], "recompute")
        )
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['mode']} | {r['tok_s']:,.0f} | "
            f"{r['ms_per_step']:.2f} | {r['tok_s'] / base:.1f}x | {r['peak_gib']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    log = Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"{setup}\n{table}\n\n")
    print(f"appended to {log}")
    return rows


if __name__ == "__main__":
    main()

# Expected output (--quick, CPU, ~10 s): a setup line, 4 JSON rows (tiny x batch 1,4 x kv-cache /
# recompute), then a 6-line table. --quick checks the script only: CPU timings of a tiny model are
# dominated by the 50304-column classifier and sampling, so its speed-ups mean nothing.
