"""The row kernels' launch options and the chunk size, with and without padded columns: GPU time.

    python bench/order_ab.py [--repeats 3] [--knobs] [--chunks] [--compile] [--gemm]

At the 124M shape (bench_fused_loss's inputs, targets within the real vocab) it times one fwd+bwd
of ours with bf16 x and w for each pass order ("forward", "pass1_back", "pass2_back") at
vocab_size 50304 (nothing masked) and 50257 (47 padded columns masked), and the fp32-master case
(single-read kernel) at both, interleaved --repeats times, with LAUNCH as it is.
--knobs adds the masked rows with mask="kernel" and with cap_regs=False (LAUNCH options).
--compile adds torch.compile of the reference (all 50304 columns, bf16 and fp32 master weight)
as the baseline in the same repeats. --chunks adds rows at other buffer budgets
(fused.EXTRA_BYTES): bf16 w at 18 chunks instead of 19, the fp32 master weight at 13 and 12
chunks instead of 10. --gemm times instead the chunk GEMMs' settings (LAUNCH gemm, lt_candidates,
lt_workspace) at vocab_size 50257, bf16 and fp32 master weights. Times are medians of 10 calls
in ms with the host's latency hidden (bench_fused_loss.timed(hide_host=True)). This is the
measurement behind the LAUNCH defaults (order, mask, cap_regs, gemm).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fused_loss import (  # noqa: E402
    SHAPES,
    FwdBwd,
    MiB,
    configured,
    make_inputs,
    master_weight,
    timed,
)

from fused_loss import fused_linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402
from fused_loss import linear_cross_entropy as fl  # noqa: E402  (bench_fused_loss set the path)


def cases(knobs, chunks, gemm=False):
    """(label, LAUNCH overrides, EXTRA_BYTES or None, vocab_size, fp32 master) in timing order."""
    if gemm:  # the chunk GEMMs: torch's, and cuBLASLt with more candidates / workspace
        out = []
        for prefix, over in (
            ("", {}),
            ("gemm torch, ", dict(gemm="torch")),
            ("lt 8 candidates, ", dict(lt_candidates=8)),
            ("lt 32 MiB workspace, ", dict(lt_workspace=32 * MiB)),
        ):
            out.append((f"{prefix}bf16 w, vocab_size 50257", over, None, 50257, False))
            out.append((f"{prefix}fp32 master w, vocab_size 50257", over, None, 50257, True))
        return out
    settings = [("", {})]
    if knobs:
        settings += [("mask kernel, ", dict(mask="kernel"))]
        settings += [("no cap_regs, ", dict(cap_regs=False))]
    out = []
    for prefix, over in settings:
        for vocab in (50304, 50257) if not over else (50257,):
            for order in fl.ORDERS:
                label = f"{prefix}bf16 w, {order}, vocab_size {vocab}"
                out.append((label, dict(over, order=order), None, vocab, False))
            label = f"{prefix}fp32 master w (single read), vocab_size {vocab}"
            out.append((label, over, None, vocab, True))
    if chunks:  # budgets that give 18 chunks (bf16 w), 13 and 12 (fp32 w) at this shape
        for order in fl.ORDERS[1:]:
            label = f"bf16 w, {order}, 18 chunks, vocab_size 50257"
            out.append((label, dict(order=order), 332 * MiB, 50257, False))
        for mib, k in ((256, 13), (288, 12)):
            label = f"fp32 master w, {k} chunks, vocab_size 50257"
            out.append((label, {}, mib * MiB, 50257, True))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--knobs", action="store_true", help="also mask='kernel' and cap_regs=False")
    ap.add_argument("--chunks", action="store_true", help="also other buffer budgets")
    ap.add_argument("--compile", action="store_true", help="also torch.compile of the reference")
    ap.add_argument("--gemm", action="store_true", help="only the chunk GEMM settings")
    args = ap.parse_args()
    x, w, t = make_inputs(*SHAPES["124M"])
    t = t.clamp(max=50256)  # valid under both vocab sizes
    w32 = w.float()

    def fwd_bwd(weight, vocab, master):
        def fn(a, b, c):
            return fused_linear_cross_entropy(a, b, c, vocab_size=vocab)

        return FwdBwd(master_weight(fn) if master else fn, x, weight, t)

    ref_compiled = torch.compile(linear_cross_entropy_reference)

    def compiled(weight, master):
        return FwdBwd(master_weight(ref_compiled) if master else ref_compiled, x, weight, t)

    todo = cases(args.knobs, args.chunks, args.gemm)
    if args.compile:  # the nanoGPT-style baseline, same inputs, in the same repeats (over=None)
        todo = [
            (f"torch.compile, {m}", None, None, 50304, m == "fp32 master w")
            for m in ("bf16 w", "fp32 master w")
        ] + todo
    rows, peaks = {}, {}
    for _ in range(args.repeats):
        for label, over, extra, vocab, master in todo:
            with configured(extra, **(over or {})):
                if over is None:
                    run = compiled(w32 if master else w, master)
                else:
                    run = fwd_bwd(w32 if master else w, vocab, master)
                if label not in peaks:  # peak above the inputs, as bench_fused_loss measures it
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    run()
                    run.clear()
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    run()
                    torch.cuda.synchronize()
                    peaks[label] = (torch.cuda.max_memory_allocated() - base) / MiB
                rows.setdefault(label, []).append(timed(run, 10, hide_host=True))
    print("| case | GPU ms per repeat | peak MiB |")
    print("|---|---|---|")
    for label, times in rows.items():
        ms = " / ".join(f"{t:.2f}" for t in times)
        print(f"| {label} | {ms} | {peaks[label]:.0f} |")


if __name__ == "__main__":
    main()
