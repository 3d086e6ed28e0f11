"""Data pipeline throughput: prepare (tokenisation) and loader, in tokens per second.

    python -m bench.bench_data                      # embedded Wikipedia text
    python -m bench.bench_data --input TEXT.txt.xz --workers 1 2  # a local text file

prepare: `python -m data.fineweb --from-text INPUT` end to end (interpreter start, read +
decompress, [EOT] + encode_ordinary in a process pool, pack into shards, write), per worker count;
"tiktoken alone" is single-process encode_ordinary on documents already in memory.
loader: DataLoader.next_batch() at B=32, T=1024 on two 50M-token shards (synthetic ids: the loader
never looks at values), so shard switches and their id check are included, shuffled (the default:
B windows gathered from random places) and in order; on CUDA also the pinned, non-blocking copy to
the GPU (synchronised at the end). Target: >= 12M tokens/s (20x the 124M training rate on an
H200), so data loading is never the bottleneck.
"""

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from data.embedded import TRAIN_FILE
from data.loader import DataLoader
from data.prepare import iter_file_docs
from data.shards import write_shard
from data.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def bench_prepare(path, workers, tmp):
    t0 = time.perf_counter()
    docs = list(iter_file_docs([path], "auto"))
    t_read = time.perf_counter() - t0
    enc = get_tokenizer()
    t0 = time.perf_counter()
    ntok = sum(len(enc.encode_ordinary(d)) + 1 for d in docs)
    t_tok = time.perf_counter() - t0
    print(f"input {path}: {len(docs):,} docs, {ntok:,} tokens")
    print(f"  read + decompress only:   {t_read:6.2f} s")
    print(f"  tiktoken alone, 1 proc:   {t_tok:6.2f} s  {ntok / t_tok / 1e6:6.2f} M tok/s")
    for w in workers:
        cmd = [sys.executable, "-m", "data.fineweb", "--from-text", str(path), "--val-tokens", "1"]
        cmd += ["--out-dir", str(Path(tmp) / f"prep_w{w}"), "--workers", str(w), "--no-progress"]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        dt = time.perf_counter() - t0
        print(f"  prepare, workers={w}:      {dt:6.2f} s  {ntok / dt / 1e6:6.2f} M tok/s")


def bench_loader(tmp, B, T, steps, device, shuffle):
    rng = np.random.default_rng(0)
    for i in range(2):
        path = Path(tmp) / f"bench_train_{i + 1:06d}.bin"
        if not path.exists():
            write_shard(path, rng.integers(0, 50257, 50_000_000, dtype=np.uint16))
    loader = DataLoader(str(Path(tmp) / "bench_train_*.bin"), B, T, device=device, shuffle=shuffle)
    for _ in range(20):  # warm the page cache and the allocator
        loader.next_batch()
    loader.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = loader.next_batch()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    rate = steps * B * T / dt
    order = "shuffled" if shuffle else "in order"
    print(
        f"loader {device.type}, {order}: B={B} T={T} {steps} steps "
        f"({steps * B * T / 1e6:.0f}M tokens, epoch {loader.epoch}) in {dt:.2f} s: "
        f"{rate / 1e6:8.1f} M tok/s, "
        f"{dt / steps * 1e6:7.1f} us/batch  [{'OK' if rate >= 12e6 else 'BELOW'} vs 12M tok/s]"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", default=str(TRAIN_FILE), help="text file (.xz ok)")
    p.add_argument("--workers", type=int, nargs="+", default=sorted({1, os.cpu_count()}))
    p.add_argument("--steps", type=int, default=3000, help="loader batches to time")
    p.add_argument("--skip-prepare", action="store_true")
    args = p.parse_args()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} cores, "
        f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_prepare:
            bench_prepare(args.input, args.workers, tmp)
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for device in devices:
            for shuffle in (True, False):
                bench_loader(tmp, 32, 1024, args.steps, torch.device(device), shuffle)


if __name__ == "__main__":
    main()
