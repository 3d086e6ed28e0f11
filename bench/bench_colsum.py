"""Bias-gradient column sums (fused_loss/colsum.py) against torch.compile, at GPT-2's shapes.

    python bench/bench_colsum.py [--repeats 5]

GPU ms (CUDA events around 10 calls, median of --repeats rounds) and TB/s of the bytes a pass
must move, for qkv_grad (three (M, C) parts read, their concatenation written) against the
compiled cat + sum, and colsum of an (M, 4C) gradient against the compiled sum, each
colsum.LAUNCH variant in turn; M = B T of 124M:32 and 1558M:16. Prints a table last (§2i).
"""

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import time_ms  # noqa: E402

from fused_loss import colsum  # noqa: E402

SHAPES = {"124M:32": (32768, 768), "1558M:16": (16384, 1600)}
VARIANTS = [
    dict(tile=t, num_warps=w, per_sm=s)
    for t, w, s in itertools.product((8192, 16384), (4, 8), (4, 8))
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cat_sum = torch.compile(
        lambda *p: (lambda t: (t, t.sum(0, dtype=torch.float32)))(torch.cat(p, 1))
    )
    col = torch.compile(lambda t: t.sum(0, dtype=torch.float32))
    rows = []
    for shape, (M, C) in SHAPES.items():
        g = torch.Generator("cuda").manual_seed(0)
        parts = [torch.randn(M, C, device="cuda", generator=g).bfloat16() for _ in range(3)]
        dh = torch.randn(M, 4 * C, device="cuda", generator=g).bfloat16()
        qkv_bytes, dh_bytes = 2 * 3 * M * C * 2, M * 4 * C * 2
        cases = [("cat + sum, compiled", lambda parts=parts: cat_sum(*parts), qkv_bytes, None)]
        cases += [("(M, 4C) sum, compiled", lambda dh=dh: col(dh), dh_bytes, None)]
        for v in VARIANTS:
            name = " ".join(f"{k}={val}" for k, val in v.items())
            cases += [
                (f"qkv_grad {name}", lambda parts=parts: colsum.qkv_grad(*parts), qkv_bytes, v)
            ]
            cases += [(f"colsum {name}", lambda dh=dh: colsum.colsum(dh), dh_bytes, v)]
        saved = dict(colsum.LAUNCH["cuda"])
        for name, fn, nbytes, v in cases:
            colsum.LAUNCH["cuda"].update(v or {})
            t = time_ms(fn, args.repeats)
            colsum.LAUNCH["cuda"].update(saved)
            rows.append((shape, name, t, nbytes / t / 1e9))
    print("| shape | case | ms | TB/s |\n|---|---|---|---|")
    for shape, name, t, bw in rows:
        print(f"| {shape} | {name} | {t:.4f} | {bw:.2f} |")


if __name__ == "__main__":
    main()
