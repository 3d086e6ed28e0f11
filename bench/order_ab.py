"""The two-read kernel's pass order, with and without the padded columns masked: GPU time.

    python bench/order_ab.py [--repeats 3]

At the 124M shape (bench_fused_loss's inputs, targets within the real vocab) it times one fwd+bwd
of ours with bf16 x and w for order "forward" and "pass2_back" at vocab_size 50304 (nothing
masked) and 50257 (47 padded columns masked), and the fp32-master case (single-read kernel) at
both, interleaved --repeats times. Times are medians of 10 calls in ms with the host's latency
hidden (bench_fused_loss.timed(hide_host=True)). This is the measurement behind
fused.pass_order("auto").
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fused_loss import SHAPES, make_inputs, master_weight, timed, variant  # noqa: E402

from fused_loss import fused_linear_cross_entropy  # noqa: E402  (bench_fused_loss set the path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    x, w, t = make_inputs(*SHAPES["124M"])
    t = t.clamp(max=50256)  # valid under both vocab sizes
    w32 = w.float()

    def fwd_bwd(weight, vocab, master=False):
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
        for order in ("forward", "pass2_back"):
            for vocab in (50304, 50257):
                with variant(order):
                    key = f"bf16 w, {order}, vocab_size {vocab}"
                    rows.setdefault(key, []).append(timed(fwd_bwd(w, vocab), 10, hide_host=True))
        for vocab in (50304, 50257):
            key = f"fp32 master w (single read), vocab_size {vocab}"
            rows.setdefault(key, []).append(timed(fwd_bwd(w32, vocab, True), 10, hide_host=True))
    print("| case | GPU ms per repeat |")
    print("|---|---|")
    for key, times in rows.items():
        print(f"| {key} | " + " / ".join(f"{ms:.2f}" for ms in times) + " |")


if __name__ == "__main__":
    main()
