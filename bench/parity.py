"""Training quality of train.py's data order against an independent sampler: val loss curves.

    python -m bench.parity DATASET [--model 124M] [--steps 500,1000] [--out out/parity] \
        [-- more train.py flags]

For each max_steps in --steps (each with its own warmup and cosine schedule) the same recipe and
seed train twice, each in a fresh process: "loader" is `python train.py` as shipped (the windows
of data/loader.py, shuffled by default), "random" is the same train.main with its batches from
RandomWindows, nanoGPT's get_batch: every row the window at an offset that torch.randint draws
uniformly, with replacement, from the concatenated train shards. RandomWindows shares no code with
data/loader.py; it reads the shards with data.shards.read_shard. Validation is train.py's own
(iter_val_batches: the same tokens for both) every --eval_interval steps and after the last.

Prints the val losses of both and the gap (loader - random) per evaluation as a markdown table,
and per schedule whether the final gap is within --tolerance (or below zero); writes
OUT/parity.json (updated after every run) and, with matplotlib installed, OUT/parity.png. Each
run's full output, log.jsonl and final checkpoint stay in OUT/<sampler>_<steps>/. --samplers
runs one of the two only (e.g. to split the work over two calls). For 124M at B=32, T=1024 on an
H200 (~590K tok/s) the four runs of --steps 500,1000 train for ~3 minutes, plus a compile each.
"""

import argparse
import glob
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from data.shards import read_shard
from gpt2_fused.training.jsonl import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAMPLERS = ("loader", "random")


class RandomWindows:
    """nanoGPT's get_batch, called like data.loader.DataLoader (shuffle is ignored): each row of a
    batch is the T+1 tokens at an offset drawn uniformly, with replacement, from all train tokens,
    by rank r's own generator (seeded with seed + r). Resuming restores rank 0's generator."""

    def __init__(self, pattern, B, T, rank=0, world_size=1, device="cpu", shuffle=True, seed=0):
        files = sorted(glob.glob(pattern))
        if not files:
            raise FileNotFoundError(f"no shard files match {pattern}")
        self.data = np.concatenate([read_shard(f) for f in files])  # (N,) uint16, in memory
        self.B, self.T, self.device = B, T, torch.device(device)
        self.gen = torch.Generator().manual_seed(seed + rank)

    def next_batch(self):
        ix = torch.randint(len(self.data) - self.T, (self.B,), generator=self.gen).tolist()
        rows = [torch.from_numpy(self.data[i : i + self.T + 1].astype(np.int64)) for i in ix]
        x, y = torch.stack([r[:-1] for r in rows]), torch.stack([r[1:] for r in rows])
        if self.device.type == "cuda":  # as nanoGPT: pinned, non-blocking
            x, y = (t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
        return x, y

    def state_dict(self):
        return {"generator": self.gen.get_state()}

    def load_state_dict(self, state):
        self.gen.set_state(state["generator"])


def train_args(args, max_steps, out_dir):
    """train.py's arguments for one run; only max_steps and out_dir differ between runs."""
    return [
        f"--dataset={args.dataset}",
        f"--model={args.model}",
        f"--batch_size={args.batch_size}",
        f"--block_size={args.block_size}",
        f"--total_batch_size={args.total_batch_size}",
        f"--learning_rate={args.learning_rate}",
        f"--warmup_steps={args.warmup_steps}",
        f"--max_steps={max_steps}",
        f"--eval_interval={args.eval_interval}",
        f"--val_tokens={args.val_tokens}",
        f"--seed={args.seed}",
        "--sample_interval=0",
        "--ckpt_interval=0",  # one checkpoint, at the end
        "--keep_last=1",
        f"--out_dir={out_dir}",
        *args.train_args,
    ]


def run(name, cmd, out_dir, every):
    """Run one training in a child process; its output goes to out_dir/output.txt, and its val
    lines, errors and every `every`-th step line to stdout. Returns the wall time in s."""
    shutil.rmtree(out_dir, ignore_errors=True)  # train.py refuses an out_dir with checkpoints
    os.makedirs(out_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    t0 = time.time()
    with open(os.path.join(out_dir, "output.txt"), "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for line in proc.stdout:
            out.write(line)
            step = re.match(r"step +(\d+)/\d+ \| loss", line)
            if (step and int(step.group(1)) % every == 0) or re.search(
                r"val loss|warning|error|Error|Traceback|peak GPU", line
            ):
                print(f"[{name}] {line.rstrip()}", flush=True)
        rc = proc.wait()
    if rc:
        raise SystemExit(f"[{name}] failed with exit status {rc}; see {out_dir}/output.txt")
    return time.time() - t0


def read_run(out_dir):
    """({step: val_loss}, median tok/s after the first 10 steps) from out_dir/log.jsonl."""
    recs = read_jsonl(os.path.join(out_dir, "log.jsonl"))
    val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    rates = [r["tok_per_s"] for r in recs if "tok_per_s" in r and r["step"] >= 10]
    return val, statistics.median(rates) if rates else None


def report(runs, tolerance):
    """The markdown table of val losses and gaps, then one verdict line per schedule."""
    by = {(r["sampler"], r["max_steps"]): r["val"] for r in runs}
    lines = [
        "| schedule | step | loader | random | gap (loader - random) |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for steps in sorted({r["max_steps"] for r in runs}):
        a, b = by.get(("loader", steps), {}), by.get(("random", steps), {})
        for step in sorted(set(a) | set(b)):
            la, lb = a.get(step), b.get(step)
            gap = f"{la - lb:+.4f}" if la is not None and lb is not None else ""
            cells = [f"{v:.4f}" if v is not None else "" for v in (la, lb)]
            lines.append(f"| {steps} | {step} | {cells[0]} | {cells[1]} | {gap} |")
        if steps in a and steps in b:
            gap = a[steps] - b[steps]
            ok = "within" if gap <= tolerance else "NOT within"
            verdicts.append(
                f"{steps} steps: loader {a[steps]:.4f}, random {b[steps]:.4f}, gap {gap:+.4f}: "
                f"{ok} {tolerance} nats of the reference (or lower)"
            )
    return "\n".join(lines + [""] + verdicts)


def plot(runs, path):
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = {}
    for r in sorted(runs, key=lambda r: (r["max_steps"], r["sampler"])):
        color = colors.setdefault(r["max_steps"], f"C{len(colors)}")
        steps = sorted(r["val"])
        style = "o-" if r["sampler"] == "loader" else "s--"
        label = f"{r['sampler']}, {r['max_steps']}-step schedule"
        ax.plot(steps, [r["val"][s] for s in steps], style, ms=3, color=color, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title("train.py's loader (solid) vs random windows with replacement (dashed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--reference-run"]:  # the child of a "random" run
        import train

        train.main(argv[1:], train_loader=RandomWindows)
        return
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dataset", help="a folder of shards (python -m data.fineweb ...) or 'embedded'")
    p.add_argument("--model", default="124M", help="train.py's preset; '' for its shape keys")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--total_batch_size", type=int, default=32768)
    p.add_argument("--learning_rate", type=float, default=6e-4)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--steps", default="500,1000", help="max_steps of each schedule, comma list")
    p.add_argument("--eval_interval", type=int, default=250)
    p.add_argument("--val_tokens", type=int, default=10_485_760, help="clipped to the val shards")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--samplers", default=",".join(SAMPLERS))
    p.add_argument("--tolerance", type=float, default=0.03, help="nats, at each schedule's end")
    p.add_argument("--out", default="out/parity")
    args = p.parse_args(argv)
    args.train_args = extra
    samplers = [s for s in args.samplers.split(",") if s]
    if not set(samplers) <= set(SAMPLERS):
        p.error(f"--samplers: {SAMPLERS}, not {args.samplers!r}")
    schedules = [int(s) for s in args.steps.split(",") if s]
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = dict(
        date=time.strftime("%Y-%m-%d %H:%M"),
        host=platform.node(),
        device=device,
        command=shlex.join([sys.executable, *sys.argv]),
        train_args=train_args(args, "MAX_STEPS", "OUT_DIR"),
        tolerance=args.tolerance,
        runs=[],
    )
    every = max(1, args.eval_interval // 5)
    for steps in schedules:
        for sampler in samplers:
            name = f"{sampler}_{steps}"
            run_dir = os.path.join(out, name)
            cli = train_args(args, steps, run_dir)
            head = ["train.py"] if sampler == "loader" else [__file__, "--reference-run"]
            wall = run(name, [sys.executable, *head, *cli], run_dir, every)
            val, rate = read_run(run_dir)
            rec = dict(name=name, sampler=sampler, max_steps=steps, val=val, tok_per_s_median=rate)
            results["runs"].append(rec | dict(wall_s=round(wall, 1)))
            with open(os.path.join(out, "parity.json"), "w") as f:
                json.dump(results, f, indent=1)
    print()
    print(report(results["runs"], args.tolerance))
    plot(results["runs"], os.path.join(out, "parity.png"))
    print(f"wrote {os.path.join(out, 'parity.json')}")


if __name__ == "__main__":
    main()

# Expected output: per run its command and progress lines, then a table with one row per
# evaluation (steps 0, 250, ..., and each schedule's last), a verdict per schedule, and
# "wrote OUT/parity.json" (plus OUT/parity.png with matplotlib).
