"""Where a training step's wall time goes: the GPU's busy and idle time in train.py's own loop.

    python -m bench.step_timeline --run 124M:16 [--train-args "--compile_mode='default'"]
        [--steps 14] [--out DIR]            (--train-args=... when the value starts with --)

Runs train.main in this process on random tokens (bench.throughput's dataset and arguments),
profiles the last three steps (CPU and CUDA activities) and reports, over those steps: the wall
span, the GPU's busy time (the union of its kernels, copies and sets), its idle time, the kernel
time by kind, and the longest idle gaps with the kernels on either side and the host's
top-level op when the gap opened. The profiler adds host time to every op it records, so on a
host-bound path idle time is an upper bound; a replayed CUDA graph records one launch.
Writes DIR/timeline_<run>.json (the summary) and the Chrome trace beside it.
"""

import argparse
import bisect
import gzip
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from bench.common import for_benchmarks, write_json
from bench.throughput import random_dataset, train_args
from data.prepare import CACHE_DIR

GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def kind(name):
    """A kernel's family, for the per-kind table."""
    n = name.lower()
    for key, label in (("nvjet", "cuBLAS GEMM"), ("gemm", "cuBLAS GEMM"),
                       ("sm90_xmma", "cuBLAS GEMM"), ("cudnn", "cuDNN attention"),
                       ("fmha", "cuDNN attention"),
                       ("adamw", "AdamW"), ("sumsq", "AdamW"), ("triton", "Triton (Inductor)"),
                       ("memcpy", "copy"), ("memset", "set")):  # fmt: skip
        if key in n:
            return label
    return "other: " + name[:40]


def step_window(events):
    """(start, end) in µs of the profiled steps on the GPU: the profiler's ProfilerStep ranges
    as the GPU ran them; None where the trace has none. Kernels queued by the step before the
    window, or the host's next step, lie outside it and are not counted."""
    marks = [e for e in events if e.get("cat") == "gpu_user_annotation"
             and e.get("name", "").startswith("ProfilerStep")]  # fmt: skip
    if not marks:
        return None
    return min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)


def summarise(events, steps):
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    window = step_window(events)
    if window:
        gpu = [e for e in gpu if window[0] <= e["ts"] < window[1]]
    if not gpu:
        return {"error": "no GPU events"}
    top = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    top.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in top]
    t0, t1 = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy, gaps, end, prev = 0.0, [], t0, None
    for e in gpu:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > end:
            i = bisect.bisect_right(starts, end) - 1  # the host op that began last before it
            host = top[i]["name"][:60] if i >= 0 else ""
            gaps.append((s - end, prev["name"][:60] if prev else "", e["name"][:60], host))
        busy += max(0.0, f - max(s, end))
        end, prev = max(end, f), e
    by_kind, by_name = {}, {}
    for e in gpu:
        k = kind(e["name"])
        by_kind[k] = by_kind.get(k, 0.0) + e["dur"]
        n = by_name.setdefault(e["name"][:90], [0, 0.0])
        n[0], n[1] = n[0] + 1, n[1] + e["dur"]
    span = t1 - t0
    gaps.sort(reverse=True)
    return {
        "steps": steps,
        "span_ms_per_step": span / steps / 1e3,
        "busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": (span - busy) / steps / 1e3,
        "busy_fraction": busy / span,
        "kernels_per_step": len(gpu) / steps,
        "gaps_over_20us_ms_per_step": sum(g[0] for g in gaps if g[0] > 20) / steps / 1e3,
        "kind_ms_per_step": {
            k: round(v / steps / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [  # calls a step, ms a step
            {"name": k, "calls": c / steps, "ms": round(d / steps / 1e3, 3)}
            for k, (c, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
        ],
        "longest_gaps": [
            {"us": round(g[0], 1), "after": g[1], "before": g[2], "host": g[3]} for g in gaps[:12]
        ],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="124M:16", help="model:batch")
    ap.add_argument("--train-args", default="", help="extra train.py arguments, one string")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--out", default="out/step_timeline")
    args = ap.parse_args()
    model, batch = args.run.split(":")
    os.makedirs(args.out, exist_ok=True)
    dataset = random_dataset(os.path.join(CACHE_DIR, "random"), 1 << 24)
    run_dir = os.path.join(args.out, "run")
    targs = train_args(model, int(batch), "default", args.steps, dataset, run_dir)
    targs += args.train_args.split()

    import train  # the command, as bench.throughput's child imports it

    active = 3
    sched = schedule(wait=args.steps - active - 2, warmup=1, active=active, repeat=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=sched) as p:
        for_benchmarks(train, on_step=p.step)
        train.main(targs)
    tag = f"{model}_{batch}" + ("_" + "".join(c for c in args.train_args if c.isalnum())[:40])
    trace = os.path.join(args.out, f"trace_{tag}.json.gz")  # the profiler gzips a .gz path
    p.export_chrome_trace(trace)
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    res = summarise(events, active)
    res |= {"run": args.run, "train_args": args.train_args, "device": torch.cuda.get_device_name(0)}
    write_json(args.out, f"timeline_{tag}.json", res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
