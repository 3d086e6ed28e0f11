"""GPT-2's MLP, fwd+bwd: torch (eager, compiled) against the cuBLASLt-epilogue op, on the GPU.

    python -m bench.bench_mlp [--shapes 124M,1558M] [--reps 10]

For each shape (tokens M, width D; F = 4 D) with fp32 master weights and bf16 activations, as
train.py runs it: the errors of the output, dx, dW/db of c_fc and c_proj against an fp64
reference (torch's bf16 autocast path next to ours), then GPU ms of one fwd+bwd (host hidden,
median) and peak memory above the inputs, for torch eager, torch.compile and ours (eager and
inside torch.compile). Writes $OUT/bench_mlp.json.
"""

import argparse
import functools
import json
import os

import torch

from bench.common import timed
from gpt2_fused.kernels.mlp import mlp_cublaslt, mlp_reference

SHAPES = {"124M": (32768, 768), "1558M": (16384, 1600)}


def make(M, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s, scale=1.0, dtype=torch.float32):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)

    x = rnd(M, D, dtype=torch.bfloat16)
    params = [
        rnd(4 * D, D, scale=0.02),
        rnd(4 * D, scale=0.02),
        rnd(D, 4 * D, scale=0.02),
        rnd(D, scale=0.02),
    ]
    dout = rnd(M, D, scale=1e-3, dtype=torch.bfloat16)
    return x, params, dout


def run(fn, x, params, dout, autocast=True):
    x = x.detach().requires_grad_()
    ps = [p.detach().requires_grad_() for p in params]
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        out = fn(x, *ps)
    out.backward(dout)
    return [out.detach(), x.grad] + [p.grad for p in ps]


def errors(x, params, dout, fns):
    ref = run(mlp_reference, x.double(), [p.double() for p in params], dout.double(), False)
    names = ("out", "dx", "dW_fc", "db_fc", "dW_proj", "db_proj")
    table = {}
    for label, fn in fns.items():
        got = run(fn, x, params, dout)
        table[label] = {
            n: ((g.double() - r).norm() / r.norm()).item()
            for n, g, r in zip(names, got, ref, strict=True)
        }
    return table


def profile(label, fn):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    fn()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(
        ((e.device_time_total, e.count, e.key) for e in prof.key_averages()),
        reverse=True,
    )
    print(f"  profile {label}: {sum(r[0] for r in rows) / 1000:.3f} ms of kernels")
    for us, n, k in rows[:10]:
        if us > 0:
            print(f"    {us / 1000:7.3f} ms  x{n:<3d} {k[:100]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="124M,1558M")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="top kernels of one fwd+bwd each")
    args = ap.parse_args()
    fns = {
        "torch eager": mlp_reference,
        "torch.compile": torch.compile(mlp_reference),
        "cublaslt": mlp_cublaslt,
        "cublaslt compiled": torch.compile(mlp_cublaslt),
    }
    report = {}
    for name in args.shapes.split(","):
        M, D = SHAPES[name]
        x, params, dout = make(M, D)
        errs = errors(x, params, dout, fns)
        rows = {}
        for label, fn in fns.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = timed(functools.partial(run, fn, x, params, dout), args.reps, hide_host=True)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            rows[label] = dict(ms=ms, peak_mib=peak, **errs[label])
        report[name] = rows
        print(f"\n{name}: M={M} D={D} (fp32 weights, bf16 activations)")
        print(f"{'':18s} {'ms':>7s} {'MiB':>7s} " + " ".join(f"{n:>8s}" for n in errs["cublaslt"]))
        for label, r in rows.items():
            e = " ".join(f"{r[n]:8.1e}" for n in errs[label])
            print(f"{label:18s} {r['ms']:7.3f} {r['peak_mib']:7.0f} {e}")
        if args.profile:
            for label in ("torch.compile", "cublaslt compiled"):
                profile(label, functools.partial(run, fns[label], x, params, dout))
        base = rows["torch.compile"]["ms"]
        print(f"cublaslt compiled / torch.compile: {rows['cublaslt compiled']['ms'] / base:.3f}")
    from gpt2_fused.kernels import cublaslt

    for key, times in cublaslt.TUNING.items():
        print("tuning", key, " ".join(f"{t:.3f}" for t in times))
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_mlp.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
