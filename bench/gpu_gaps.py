"""Where a fwd+bwd's wall time goes beyond its kernels: the GPU timeline of one call.

    python -m bench.gpu_gaps [--variants two_reads,extra640] [--out DIR]

At the 124M classifier shape (bench.common's inputs) it profiles one fwd+bwd of ours (and of
each named variant of bench.common.VARIANTS) and of torch.compile, and reports: host time of
the call, time from the call's start to its first kernel, the GPU span (first kernel start to
last kernel end), the summed kernel time, and the idle gaps between consecutive kernels, split
into gaps where the next kernel's launch call returned only after the previous kernel had
finished (the host was late: launch overhead) and gaps the GPU made itself. Profiling adds host
time per launch, so host-late gaps are upper bounds.
"""

import argparse
import contextlib
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.common import LOSS_SHAPES, FwdBwd, make_inputs, methods, variant

GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def timeline(fn, label):
    """Profile fn() once (after a warm call); return the timeline summary (times in ms)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(label):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launch = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    mark = next(e for e in events if e.get("name") == label and e.get("cat") == "user_annotation")
    gaps, host_late, seq = [], 0.0, []
    for a, b in zip([None] + gpu, gpu, strict=False):
        a_end = mark["ts"] if a is None else a["ts"] + a["dur"]
        gap = b["ts"] - a_end
        call = launch.get(b.get("args", {}).get("correlation"))
        late = call is not None and call["ts"] + call["dur"] > a_end
        # (start after the call began, duration, idle before, host late, kernel), in ms
        seq.append(
            (
                round((b["ts"] - mark["ts"]) / 1e3, 3),
                round(b["dur"] / 1e3, 3),
                round(gap / 1e3, 3),
                late,
                b["name"][:50],
            )
        )
        if a is None or gap <= 0:
            continue
        host_late += gap if late else 0.0
        gaps.append((gap, late, a["name"][:40], b["name"][:40]))
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    gaps.sort(reverse=True)
    return dict(
        host_ms=mark["dur"] / 1e3,
        lead_ms=(gpu[0]["ts"] - mark["ts"]) / 1e3,
        span_ms=span / 1e3,
        busy_ms=sum(e["dur"] for e in gpu) / 1e3,
        kernels=len(gpu),
        gaps_ms=sum(g[0] for g in gaps) / 1e3,
        host_late_ms=host_late / 1e3,
        top_gaps=[(round(g / 1e3, 3), late, a, b) for g, late, a, b in gaps[:6]],
        first=seq[:12],
        last=seq[-12:],
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    x, w, t = make_inputs(*LOSS_SHAPES["124M"])
    meths = methods()
    rows = {}

    runs = [("torch.compile", None), ("ours", None)]
    runs += [("ours", v) for v in args.variants.split(",") if v]
    for name, v in runs:
        label = f"{name}[{v}]" if v else name
        try:
            with variant(v) if v else contextlib.nullcontext():
                rows[label] = timeline(FwdBwd(meths[name], x, w, t), label)
        except Exception as e:  # report and go on: one call holds several runs
            print(label, "failed:", repr(e)[:300])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_gaps.json"), "w") as f:
        json.dump(rows, f, indent=1)
    cols = ("host_ms", "lead_ms", "span_ms", "busy_ms", "kernels", "gaps_ms", "host_late_ms")
    print("| method | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in rows.items():
        cells = [str(r[c]) if c == "kernels" else f"{r[c]:.3f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, r in rows.items():
        print(name, "largest gaps (ms, host late, after, before):")
        for g in r["top_gaps"]:
            print("   ", g)
        print(name, "first and last kernels (start ms, dur ms, idle before ms, host late, name):")
        for k in r["first"] + [("...",)] + r["last"]:
            print("   ", k)


if __name__ == "__main__":
    main()
