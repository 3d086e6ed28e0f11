"""Delayed FP8 scales under stress: tests/test_fp8.py's 20-step run (4 layers x 768, B 8 x T 256,
learning rate 1e-3 after 5 warm-up steps, the embedded data) in bf16 and with --fp8=fused from
the same seed, for several seeds; per seed the largest per-step loss gap and its step. The GPU
test allows 0.1; an activation that outgrows its delayed scale within one step shows as a
one-step spike (bench/RESULTS.md#fp8-fused-end-to-end). --no-recast turns fp8_scale's checking
launch off, to see what it saves.

    python -m bench.fp8_stress --seeds 1337 7 42 [--no-recast] [--out DIR]
"""

import argparse
import json
import os
import tempfile

import train
from bench.common import write_json
from gpt2_fused.kernels import fp8_scale

ARGS = [  # also tests/test_fp8.py's (STRESS_ARGS): one list
    "--n_layer=4",
    "--n_head=12",
    "--n_embd=768",
    "--block_size=256",
    "--batch_size=8",
    "--total_batch_size=2048",
    "--max_steps=20",
    "--warmup_steps=5",
    "--learning_rate=1e-3",
    "--eval_interval=0",
    "--sample_interval=0",
    "--device=cuda",
    "--dtype=auto",
]


def losses(out_dir):
    """{step: train loss} of a run's log.jsonl."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "val_loss" not in r}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 7, 42])
    ap.add_argument("--no-recast", action="store_true", help="fp8_scale.RECAST_ON_OVERFLOW off")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/fp8_stress"))
    args = ap.parse_args()
    fp8_scale.RECAST_ON_OVERFLOW = not args.no_recast
    tmp, rows = tempfile.mkdtemp(), {}
    for seed in args.seeds:
        runs = {}
        for fp8 in ("off", "fused"):
            out_dir = f"{tmp}/{fp8}_{seed}"
            train.main(ARGS + [f"--out_dir={out_dir}", f"--fp8={fp8}", f"--seed={seed}"])
            runs[fp8] = losses(out_dir)
        gaps = [abs(runs["fused"][s] - runs["off"][s]) for s in sorted(runs["off"])]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        rows[seed] = {"max_gap": gaps[worst], "step": worst, "gaps": gaps}
    recast = "on" if fp8_scale.RECAST_ON_OVERFLOW else "off"
    write_json(args.out, f"fp8_stress_recast_{recast}.json", rows)
    print(f"\n| seed | largest gap, re-cast {recast} | at step | steps over 0.02 |")
    print("|---|---|---|---|")
    for seed, r in rows.items():
        over = sum(g > 0.02 for g in r["gaps"])
        print(f"| {seed} | {r['max_gap']:.4f} | {r['step']} | {over} |")


if __name__ == "__main__":
    main()
