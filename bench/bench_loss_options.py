"""The cost of fused_linear_cross_entropy's options (softcap, z_loss, bias, label smoothing).

    python -m bench.bench_loss_options [--shapes 124M,1558M] [--repeats 5] [--reps 10]
        [--cases default,softcap+z_loss,...] [--out DIR]

At each shape (bench.common's inputs), in the trainer's case (fp32 master weight under
bf16 autocast) and with bf16 weights: fwd+bwd time of ours with each case of options against
ours with none, and against torch.compile of the torch reference with the same options, the
cases interleaved `repeats` times (each repeat: median of `reps` calls, common.timed).
Prints one table: medians over the repeats, wall (host latency included) and GPU time, the
ratio to ours without options, and the loss's relative error against an fp32 reference.
`--cases default` runs on any version of the code (the same-run check that the default path's
speed did not change: run it from both trees, alternating).
"""

import argparse
import json
import os
import statistics

import torch

from bench.common import LOSS_SHAPES, make_inputs, timed
from fused_loss import fused_linear_cross_entropy, linear_cross_entropy_reference

CASES = {
    "default": {},
    "softcap+z_loss": dict(softcap=30.0, z_loss=1e-4),
    "all": dict(bias=True, softcap=30.0, z_loss=1e-4, label_smoothing=0.1),
}


def step(fn, x, w, b, t, opts, master):
    """One fwd+bwd closure on leaf copies (gradients cleared each call)."""
    x = x.detach().requires_grad_()
    w = (w.float() if master else w).detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()

    def run():
        x.grad = w.grad = None
        if b is not None:
            b.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=master):
            loss = fn(x, w, t, vocab_size=50257, **opts) if opts else fn(x, w, t, vocab_size=50257)
        loss.backward()

    return run


def loss_error(fn, x, w, t, opts, master):
    """Relative error of the loss against the fp32 reference with the same options."""
    with torch.no_grad():
        ref = linear_cross_entropy_reference(x.float(), w.float(), t, vocab_size=50257, **opts)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=master):
            wx = w.float() if master else w
            ours = (
                fn(x, wx, t, vocab_size=50257, **opts) if opts else fn(x, wx, t, vocab_size=50257)
            )
    return abs(ours.item() - ref.item()) / abs(ref.item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="124M,1558M")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no_compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    compiled = torch.compile(linear_cross_entropy_reference)
    rows = []
    for shape in args.shapes.split(","):
        N, D, V = LOSS_SHAPES[shape]
        x, w, t = make_inputs(N, D, V)
        t = t.clamp(max=50256)
        b = torch.randn(V, device="cuda") * 0.1
        for master in (True, False):
            runs = {}
            for case in args.cases.split(","):
                opts = dict(CASES[case])
                bias = b if opts.pop("bias", False) else None
                if bias is not None:
                    opts["bias"] = bias
                runs[f"ours {case}"] = (step(fused_linear_cross_entropy, x, w, bias, t, opts,
                                             master), opts)  # fmt: skip
                if not args.no_compile and case != "default":
                    runs[f"torch.compile {case}"] = (step(compiled, x, w, bias, t, opts, master),
                                                     opts)  # fmt: skip
            times = {k: ([], []) for k in runs}
            for _ in range(args.repeats):  # interleaved: drift hits every case alike
                for k, (run, _) in runs.items():
                    times[k][0].append(timed(run, args.reps))
                    times[k][1].append(timed(run, args.reps, hide_host=True))
            base = times.get("ours default")
            for k, (wall, gpu) in times.items():
                fn = fused_linear_cross_entropy if k.startswith("ours") else compiled
                opts = runs[k][1]
                row = dict(shape=shape, weight="fp32 master" if master else "bf16", case=k,
                           wall_ms=statistics.median(wall), gpu_ms=statistics.median(gpu),
                           wall_all=wall, gpu_all=gpu)  # fmt: skip
                if base:
                    row["wall_ratio"] = row["wall_ms"] / statistics.median(base[0])
                    row["gpu_ratio"] = row["gpu_ms"] / statistics.median(base[1])
                row["err_loss"] = loss_error(fn, x, w, t, opts, master)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del runs
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_loss_options.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| shape | weight | case | wall ms | GPU ms | wall / default | GPU / default | err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratios = (f"{r['wall_ratio']:.3f} | {r['gpu_ratio']:.3f}" if "wall_ratio" in r
                  else " | ")  # fmt: skip
        print(
            f"| {r['shape']} | {r['weight']} | {r['case']} | {r['wall_ms']:.2f} | "
            f"{r['gpu_ms']:.2f} | {ratios} | {r['err_loss']:.1e} |"
        )


if __name__ == "__main__":
    main()
