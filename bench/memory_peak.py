"""What is alive at the peak of one fused-loss fwd+bwd: the allocations behind the peak memory.

    python -m bench.memory_peak [--shapes 124M,1558M] [--master]

For each shape (bench.common's inputs; --master: an fp32 weight under bf16 autocast, as the
trainer runs it) it runs one fwd+bwd to warm up (compilation, cuBLAS workspaces), then records
the CUDA caching allocator's events for a second one (torch.cuda.memory._record_memory_history)
and replays them: the bytes allocated since the start, their maximum, and the allocations alive
at that moment with the Python line that made each. bench_fused_loss's peak column counts from
before the warm-up call, so it also holds what that call kept (workspaces); this one does not.
"""

import argparse
import os

import torch

from bench.common import LOSS_SHAPES, FwdBwd, MiB, make_inputs, master_weight
from fused_loss import fused_linear_cross_entropy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def where(frames):
    """The innermost frame in this repo (else the innermost at all) as file:line function."""
    ours = [f for f in frames if f["filename"].startswith(ROOT)]
    f = (ours or frames or [dict(filename="?", line=0, name="?")])[0]
    return f"{os.path.relpath(f['filename'], ROOT)}:{f['line']} {f['name']}"


def live_at_peak(events):
    """Replay alloc / free_requested events (memory_allocated drops at the request): returns the
    peak bytes above the start and {addr: (size, frames)} alive then."""
    live, cur, peak, at_peak = {}, 0, 0, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    return peak, at_peak


def report(name, master):
    """Print what is alive at the peak of one fwd+bwd at LOSS_SHAPES[name]."""
    N, D, V = LOSS_SHAPES[name]
    x, w, t = make_inputs(N, D, V)
    fn = master_weight(fused_linear_cross_entropy) if master else fused_linear_cross_entropy
    fwd_bwd = FwdBwd(fn, x, w.float() if master else w, t)
    xg, wg = fwd_bwd.x, fwd_bwd.w
    fwd_bwd()
    fwd_bwd.clear()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    fwd_bwd()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = (torch.cuda.max_memory_allocated() - start) / MiB
    peak, alive = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
    grads = (xg.numel() * xg.element_size() + wg.numel() * wg.element_size()) / MiB
    kind = "fp32 master w" if master else "bf16 w"
    print(f"\n{name} ({N}, {D}, {V}), {kind}: peak {peak / MiB:.1f} MiB above the start")
    print(f"(max_memory_allocated: {measured:.1f}; the gradients alone: {grads:.1f})")
    print("| MiB | allocated at |")
    print("|---|---|")
    for size, frames in sorted(alive.values(), key=lambda a: -a[0]):
        if size >= MiB:
            print(f"| {size / MiB:.1f} | {where(frames)} |")
    small = sum(size for size, _ in alive.values() if size < MiB) / MiB
    print(f"| {small:.1f} | (allocations under 1 MiB) |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="124M,1558M")
    ap.add_argument("--master", action="store_true", help="fp32 weight under bf16 autocast")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        report(name, args.master)


if __name__ == "__main__":
    main()
