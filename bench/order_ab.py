"""The row kernels' launch options, with and without the padded columns masked: GPU time.

    python bench/order_ab.py [--repeats 3] [--knobs]

At the 124M shape (bench_fused_loss's inputs, targets within the real vocab) it times one fwd+bwd
of ours with bf16 x and w for order "forward" and "pass2_back" at vocab_size 50304 (nothing
masked) and 50257 (47 padded columns masked), and the fp32-master case (single-read kernel) at
both, interleaved --repeats times, with fused.CONFIGS as they are (register cap on). --knobs
adds the same rows with cap_regs=False, and the masked rows with mask="fill" (options in
fused.py). Times are medians of 10 calls in ms with the host's latency hidden
(bench_fused_loss.timed(hide_host=True)). This is the measurement behind fused.pass_order("auto")
and the one that should settle cap_regs and mask.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fused_loss import SHAPES, configured, make_inputs, master_weight, timed  # noqa: E402

from fused_loss import fused_linear_cross_entropy  # noqa: E402  (bench_fused_loss set the path)


def cases(knobs):
    """(label, CONFIGS overrides, vocab_size, fp32 master weight) in timing order."""
    settings = [("", {})]
    if knobs:
        settings += [("no cap_regs, ", dict(cap_regs=False)), ("mask fill, ", dict(mask="fill"))]
        settings += [("mask fill, no cap_regs, ", dict(mask="fill", cap_regs=False))]
    out = []
    for prefix, over in settings:
        for vocab in (50304, 50257):
            if over.get("mask") == "fill" and vocab == 50304:
                continue  # nothing to fill
            for order in ("forward", "pass2_back"):
                label = f"{prefix}bf16 w, {order}, vocab_size {vocab}"
                out.append((label, dict(over, order=order), vocab, False))
            label = f"{prefix}fp32 master w (single read), vocab_size {vocab}"
            out.append((label, over, vocab, True))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--knobs", action="store_true", help="also cap_regs and mask='fill'")
    args = ap.parse_args()
    x, w, t = make_inputs(*SHAPES["124M"])
    t = t.clamp(max=50256)  # valid under both vocab sizes
    w32 = w.float()

    def fwd_bwd(weight, vocab, master):
        xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()

        def fn(a, b, c):
            return fused_linear_cross_entropy(a, b, c, vocab_size=vocab)

        fn = master_weight(fn) if master else fn

        def run():
            xg.grad = wg.grad = None
            fn(xg, wg, t).backward()

        return run

    rows = {}
    for _ in range(args.repeats):
        for label, over, vocab, master in cases(args.knobs):
            with configured(**over):
                run = fwd_bwd(w32 if master else w, vocab, master)
                rows.setdefault(label, []).append(timed(run, 10, hide_host=True))
    print("| case | GPU ms per repeat |")
    print("|---|---|")
    for label, times in rows.items():
        print(f"| {label} | " + " / ".join(f"{ms:.2f}" for ms in times) + " |")


if __name__ == "__main__":
    main()
