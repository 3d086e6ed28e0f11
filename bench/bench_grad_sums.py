"""Bias-gradient column sums (gpt2_fused/kernels/grad_sums.py) against torch, at GPT-2's shapes.

    python -m bench.bench_grad_sums [--repeats 7]

GPU ms per call and TB/s of the bytes a pass must move, for qkv_grad (three (M, C) parts read,
their concatenation written) against torch.cat alone and the compiled cat + sum, and colsum of an
(M, 4C) gradient against the compiled sum, each pass-1 launch variant of grad_sums.LAUNCH in turn;
M = B T of 124M:32 and 1558M:16. Each case is timed as a CUDA graph of 20 calls (median of
--repeats replays), so the host's time per call does not count: events around eager calls of
these ~0.1 ms passes measure the host instead (bench/RESULTS.md#attention). The results are
checked against torch (the concatenation bit for bit). Prints a table last.
"""

import argparse
import itertools

import torch

from bench.common import graph_us
from gpt2_fused.kernels import grad_sums
from gpt2_fused.kernels.launch import launch_overrides

SHAPES = {"124M:32": (32768, 768), "1558M:16": (16384, 1600)}
VARIANTS = [
    dict(tile=t, num_warps=w, per_sm=s)
    for t, w, s in itertools.product((4096, 8192), (4, 8), (2, 3, 6))
]


def graph_ms(fn, repeats, calls=20):
    """ms a call of fn, from a CUDA graph of `calls` calls (common.graph_us; median of
    `repeats` replays)."""
    return graph_us(lambda i: fn(), range(calls), repeats) / 1e3


def measure(shape, M, C, repeats, cat_sum, col):
    """Rows (shape, case, ms, TB/s, flag) of one shape: the torch cases, then the launches."""
    g = torch.Generator("cuda").manual_seed(0)
    parts = [torch.randn(M, C, device="cuda", generator=g).bfloat16() for _ in range(3)]
    dh = torch.randn(M, 4 * C, device="cuda", generator=g).bfloat16()
    want_cat = torch.cat(parts, 1)
    want_q, want_c = want_cat.double().sum(0), dh.double().sum(0)
    qkv_bytes, dh_bytes = 2 * 3 * M * C * 2, M * 4 * C * 2
    cases = [
        ("torch.cat alone", lambda: torch.cat(parts, 1), qkv_bytes, ""),
        ("cat + sum, compiled", lambda: cat_sum(*parts), qkv_bytes, ""),
        ("(M, 4C) sum, compiled", lambda: col(dh), dh_bytes, ""),
    ]
    rows = [(shape, name, *_timed(fn, nbytes, repeats), flag) for name, fn, nbytes, flag in cases]
    default = dict(grad_sums.LAUNCH["cuda"])
    for v in [default] + VARIANTS:
        name = " ".join(f"{k}={val}" for k, val in v.items())
        name += " (LAUNCH)" if v is default else ""
        with launch_overrides(grad_sums.LAUNCH["cuda"], **v):
            cat, sums = grad_sums.qkv_grad(*parts)
            ok = torch.equal(cat, want_cat) and (sums.double() - want_q).abs().max() < 1e-2
            ok = ok and (grad_sums.colsum(dh).double() - want_c).abs().max() < 1e-2
            flag = "" if ok else "WRONG"
            t = _timed(lambda: grad_sums.qkv_grad(*parts), qkv_bytes, repeats)
            rows.append((shape, f"qkv_grad {name}", *t, flag))
            t = _timed(lambda: grad_sums.colsum(dh), dh_bytes, repeats)
            rows.append((shape, f"colsum {name}", *t, flag))
    return rows


def _timed(fn, nbytes, repeats):
    t = graph_ms(fn, repeats)
    return t, nbytes / t / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    cat_sum = torch.compile(
        lambda *p: (lambda t: (t, t.sum(0, dtype=torch.float32)))(torch.cat(p, 1))
    )
    col = torch.compile(lambda t: t.sum(0, dtype=torch.float32))
    rows = []
    for shape, (M, C) in SHAPES.items():
        rows += measure(shape, M, C, args.repeats, cat_sum, col)
    print("| shape | case | ms | TB/s | |\n|---|---|---|---|---|")
    for shape, name, t, bw, bad in rows:
        print(f"| {shape} | {name} | {t:.4f} | {bw:.2f} | {bad} |")


if __name__ == "__main__":
    main()
