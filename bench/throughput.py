"""Training throughput of the real train.py on random tokens: the default configuration against
the plain one, or other loss implementations and train.py arguments.

    python -m bench.throughput [--runs 124M:32,124M:64,350M:32,1558M:16:20:8]
        [--impls default,plain] [--repeats 3] [--steps 30] [--warmup 10] [--out DIR]
        [--profile 124M:32] [--max-batch auto] [--time-budget 400]
        [--train-args= --train-args="--compile_mode='reduce-overhead'" ...] [--torchrun]

--impls names configurations (IMPLS): "default" (train.py's defaults), "plain" (every fast path off:
materialised logits, torch MLP, torch's fused AdamW, fp32 residual stream, compile mode "default";
the stand-in for nanoGPT's path), "no_graphs" (the defaults without CUDA graphs), "torch" (only the
loss switched to torch's), "fp8" / "fp8_rowwise" (the defaults with the blocks' GEMMs in FP8,
--fp8=tensorwise / rowwise), "fp8_fused" (--fp8=fused), "muon" (--optimizer=muon: against
"default", the optimizer's cost; --profile shows the Newton-Schulz GEMMs' share). --repeats runs
every (run, impl) that many times, interleaved, and the table gives the median, with each impl's
ratio to "plain" when both ran. A run is model:batch, or model:batch:steps:warmup to override
--steps / --warmup.

Each run is a fresh process calling train.main (compiled model, bf16 autocast, fused AdamW, one
micro-batch per step: total batch = B * 1024) on a shard of uniform random tokens. Reported per
run: median step time and tok/s over the steps after --warmup, the MFU train.py logs, the peak
GPU memory allocated, and the first and last step's loss. Runs of one model and batch share the
seed and the data, so their first losses agree to ~1e-4 whatever the loss or compile settings
(1558M: 11.1460 in eager mode); one that does not computed something else, and a warning says
so. --profile runs one more (fused) training per --train-args variant, profiles its steps
10-12 (torch profiler) and prints the top 25 kernels by CUDA time per step (60 in the JSON).
--max-batch auto tries the largest 124M micro-batch that the B = 32 and 64 runs predict to
fit, per impl (or the impl:B list given), and reports whether it did. Each --train-args value
(extra train.py arguments; an empty one is the plain run) makes a variant of every run,
compared within one call of the script. --torchrun runs each training under `torchrun
--standalone --nproc_per_node=1` (a world-size-1 process group: DDP, or --shard's modes;
bench/shard_overhead.sh). Writes DIR/throughput.json and copies each run's log.jsonl into DIR.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from data.prepare import CACHE_DIR
from data.shards import write_shard
from gpt2_fused.training.jsonl import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRESETS = {"124M": "gpt2", "350M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}
PLAIN = ["--loss_impl='torch'", "--mlp_impl='torch'", "--attn_impl='torch'", "--adamw_impl='torch'"]
PLAIN += ["--low_precision_residual=False", "--compile_mode='default'"]  # nanoGPT's compile
IMPLS = {"default": [], "plain": PLAIN, "torch": ["--loss_impl='torch'"]}
IMPLS["no_graphs"] = ["--compile_mode='default'"]  # the defaults without CUDA graphs
IMPLS |= {"fp8": ["--fp8='tensorwise'"], "fp8_rowwise": ["--fp8='rowwise'"]}
IMPLS["fp8_fused"] = ["--fp8='fused'"]  # our kernels' casts (gpt2_fused/kernels/mlp_fp8.py)
IMPLS["muon"] = ["--optimizer='muon'"]  # Muon for the blocks' matrices (training/muon.py)

# Runs inside the child: train, then report peak memory (and the profile when asked).
CHILD = r"""
import json, sys, torch, train
from bench.common import for_benchmarks
args, profile = json.loads(sys.argv[1]), sys.argv[2] == "1"
if profile:  # steps 10-12 only: past compilation and warm-up, before the final checkpoint
    from torch.profiler import ProfilerActivity, profile as prof_ctx, schedule
    sched = schedule(wait=9, warmup=1, active=3, repeat=1)
    with prof_ctx(activities=[ProfilerActivity.CUDA], schedule=sched) as prof:
        for_benchmarks(train, on_step=prof.step)
        train.main(args)
    rows = sorted(((e.device_time_total, e.count, e.key) for e in prof.key_averages()
                   if e.device_time_total > 0), reverse=True)
    print("PROFILE " + json.dumps([(us / 1000.0, n, k[:90]) for us, n, k in rows[:60]]))
    print(f"PROFILE_TOTAL_MS {sum(r[0] for r in rows) / 1000.0}")
else:
    for_benchmarks(train)
    train.main(args)
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
print(f"PEAK_GIB {peak / 2**30:.3f}")
"""


def random_dataset(folder, tokens):
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", tokens), ("val", 1 << 20)):
        path = os.path.join(folder, f"random_{split}_000000.bin")
        if not os.path.exists(path):
            write_shard(path, rng.integers(0, 50257, n, dtype=np.int64))
    return folder


def train_args(model, batch, impl, steps, dataset, out_dir):
    return [
        f"--model='{PRESETS[model]}'",
        f"--dataset='{dataset}'",
        f"--batch_size={batch}",
        f"--total_batch_size={batch * 1024}",
        f"--max_steps={steps}",
        "--warmup_steps=5",
        "--eval_interval=0",
        f"--val_tokens={batch * 1024}",
        "--sample_interval=0",
        "--ckpt_interval=0",
        "--keep_last=1",
        f"--out_dir='{out_dir}'",
        *IMPLS[impl],
    ]


def run_child(args, profile=False, timeout=900, torchrun=False):
    t0 = time.time()
    # `python -c` puts the working directory (cwd=ROOT below) first on sys.path: the child
    # imports train and the packages from the repo root as `python -m bench.throughput` does
    cmd, env = [sys.executable, "-c", CHILD], None
    if torchrun:  # torchrun runs files: CHILD as one, whose own folder (out/throughput) heads
        # sys.path instead, so the root comes through PYTHONPATH
        script = os.path.join(ROOT, "out", "throughput", "child.py")
        os.makedirs(os.path.dirname(script), exist_ok=True)
        with open(script, "w") as f:
            f.write(CHILD)
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        cmd = [sys.executable, *launcher, script]
        path = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + path if path else ""))
    p = subprocess.run(
        [*cmd, json.dumps(args), "1" if profile else "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = p.stdout + p.stderr
    res = dict(rc=p.returncode, wall_s=round(time.time() - t0, 1))
    for line in out.splitlines():
        if line.startswith("PEAK_GIB"):
            res["peak_gib"] = float(line.split()[1])
        if line.startswith("PROFILE_TOTAL_MS"):
            res["profile_total_ms"] = float(line.split()[1])
        if line.startswith("PROFILE "):
            res["profile"] = json.loads(line[len("PROFILE ") :])
        if line.startswith("optimizer state by rank (bytes): "):  # train.py's, measured
            res["state_bytes"] = [int(n.replace(",", "")) for n in line.split(":")[1].split("|")]
    if p.returncode != 0:
        res["error"] = "\n".join(out.strip().splitlines()[-4:])[-600:]
        # torch.OutOfMemoryError, or train.py's one line about it; else something to look at
        res["oom"] = "OutOfMemoryError" in out or "error: out of memory" in out
        if res["oom"]:
            res["oom_detail"] = oom_detail(out)
    return res


def oom_detail(out):
    """The allocator's own account of an out-of-memory error: what the failing allocation asked
    for and what was in use ("Tried to allocate ... this process has ... in use ..."), or ""."""
    m = re.search(r"Tried to allocate [^\n]*", out)
    return m.group(0).split(" If reserved")[0][:400] if m else ""  # without the advice


def step_stats(log_path, warmup):
    recs = read_jsonl(log_path)
    steps = [r for r in recs if "ms" in r and r["step"] >= warmup]
    ms = statistics.median(r["ms"] for r in steps)
    mfu = statistics.median(r["mfu"] for r in steps) if steps[0].get("mfu") else None
    losses = [r["loss"] for r in recs if "loss" in r]  # a wrong or diverging run shows here
    tok_per_s = statistics.median(r["tok_per_s"] for r in steps)
    startup = [r["startup_s"] for r in recs if "startup_s" in r]  # launch to step 1's end
    return dict(ms=ms, tok_per_s=tok_per_s, mfu=mfu, loss_first=losses[0], loss_last=losses[-1],
                startup_s=startup[0] if startup else float("nan"))  # fmt: skip


def first_loss_outliers(runs, tol=1e-3):
    """Runs whose step-0 loss is more than tol from the median of the runs with the same model and
    micro-batch (same seed, same tokens: any loss or compile setting should agree to ~1e-4; the
    wrongly compiled 1558M graph was 0.03 off, bench/RESULTS.md#compile)."""
    groups = {}
    for r in runs:
        if r.get("rc") == 0 and "loss_first" in r:
            groups.setdefault((r["model"], r["batch"]), []).append(r)
    out = []
    for group in (g for g in groups.values() if len(g) > 1):
        mid = statistics.median(r["loss_first"] for r in group)
        out += [r for r in group if abs(r["loss_first"] - mid) > tol]
    return out


def max_batch_candidates(runs, impl, capacity_gib=None):
    """124M micro-batches to try, largest first: peak memory is linear in the batch, so the
    B = 32 and 64 runs predict where it runs out; try 95 % and 85 % of that, multiples of 8."""
    import torch

    pts = {
        r["batch"]: r["peak_gib"]
        for r in runs
        if r["model"] == "124M" and r["impl"] == impl and r["rc"] == 0
    }
    if 32 not in pts or 64 not in pts:
        return []
    cap = capacity_gib or torch.cuda.get_device_properties(0).total_memory / 2**30
    per_b = (pts[64] - pts[32]) / 32
    pred = 32 + (cap - 2 - pts[32]) / per_b  # keep 2 GiB for the CUDA context and fragmentation
    return [int(pred * f) // 8 * 8 for f in (0.95, 0.85)]


def past_budget(runs, model, start, budget, impls=None):
    """Whether runs of model, one per impl in impls (a name, a list, or None for "any"), started
    now would end more than budget seconds after start. A run's length: the last finished run of
    the same model and impl (a repeat finds Inductor's caches warm, so the cold first run would
    overstate it by ~2x), else the longest of that model, else 0 s."""
    longest = max([r.get("wall_s", 0) for r in runs if r["model"] == model], default=0)
    need = 0.0
    for impl in [impls] if impls is None or isinstance(impls, str) else impls:
        same = [r.get("wall_s", 0) for r in runs if r["model"] == model and r.get("impl") == impl]
        need += same[-1] if same else longest
    return time.time() - start + need > budget


def summarise(runs):
    """One row per (model, batch, impl, train args): the median over its repeats, and the ratio
    of its median tok/s to the "plain" impl's of the same model, batch and train args."""
    groups = {}
    for r in runs:
        groups.setdefault((r["model"], r["batch"], r["impl"], r.get("train_args", "")), []).append(
            r
        )
    rows = []
    for (model, batch, impl, extra), rs in groups.items():
        ok = [r for r in rs if r["rc"] == 0]
        row = dict(model=model, batch=batch, impl=impl, train_args=extra, n=len(ok), of=len(rs))
        if ok:
            for k in ("ms", "tok_per_s", "peak_gib", "loss_first", "loss_last", "startup_s"):
                row[k] = statistics.median(r[k] for r in ok)
            row["tok_per_s_all"] = [round(r["tok_per_s"]) for r in ok]
            row["mfu"] = statistics.median(r["mfu"] for r in ok) if ok[0].get("mfu") else None
        else:
            row["error"] = rs[-1].get("error", "")
        rows.append(row)
    for row in rows:
        base = [b for b in rows if b["impl"] == "plain" and "tok_per_s" in b]
        base = [b for b in base if (b["model"], b["batch"], b["train_args"]) == (
            row["model"], row["batch"], row["train_args"])]  # fmt: skip
        if base and "tok_per_s" in row:
            row["vs_plain"] = row["tok_per_s"] / base[0]["tok_per_s"]
            row["peak_vs_plain"] = row["peak_gib"] / base[0]["peak_gib"]
            row["startup_vs_plain"] = row["startup_s"] / base[0]["startup_s"]
    return rows


def print_table(runs):
    cols = "model | batch | impl | train args | runs | ms/step | tok/s (median; each) | vs plain"
    print(f"\n| {cols} | MFU | peak GiB | loss 1st, last | start-up s (vs plain) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in summarise(runs):
        row = f"| {r['model']} | {r['batch']} | {r['impl']} | {r['train_args']} |"
        row += f" {r['n']}/{r['of']} |"
        if not r["n"]:
            print(f"{row} error: {r['error'][-120:]} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        each = ", ".join(f"{t / 1000:.1f}K" for t in r["tok_per_s_all"])
        ratio = f"{r['vs_plain']:.3f}x" if "vs_plain" in r else ""
        print(
            f"{row} {r['ms']:.1f} | {r['tok_per_s']:,.0f} ({each}) | {ratio} | {mfu} | "
            f"{r['peak_gib']:.2f} | {r['loss_first']:.4f}, {r['loss_last']:.4f} | "
            f"{r['startup_s']:.1f}" + (f" ({r['startup_vs_plain']:.2f}x) |" if ratio else " |")
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="124M:32,124M:64,350M:32,1558M:16")
    ap.add_argument("--impls", default="default,plain", help=f"of {sorted(IMPLS)}")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each, interleaved; median")
    ap.add_argument(
        "--train-args",
        action="append",
        help="extra train.py arguments; each use adds a variant of every run (default: none). "
        "Give it with '=' since the value starts with '--': "
        "--train-args=\"--compile_mode='reduce-overhead'\" (and --train-args= for the plain run)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0,
        help="seconds: start no repeat (every impl of one model:batch) that finished runs of the "
        "same model say would end past this, counted from the start (0: no limit); a started "
        "repeat runs whole; the table reports the runs that ran",
    )
    ap.add_argument("--torchrun", action="store_true", help="each run under torchrun, 1 process")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/throughput"))
    ap.add_argument("--profile", default="", help="model:batch to profile (fused loss)")
    ap.add_argument(
        "--max-batch",
        default="",
        help="'auto' (predict from the 124M B=32/64 runs) or impl:B,... 124M batches to try",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(ROOT, "out", "throughput")
    dataset = random_dataset(str(CACHE_DIR / "random"), 1 << 24)
    results = dict(date=time.strftime("%Y-%m-%d"), runs=[], profiles=[], max_batch=[])
    path = os.path.join(args.out, "throughput.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    start, skipped, budget = time.time(), [], args.time_budget
    specs = [s for s in args.runs.split(",") if s]
    for spec, rep in [(s, r) for s in specs for r in range(args.repeats)]:
        model, batch, steps, warmup = (spec.split(":") + [args.steps, args.warmup])[:4]
        variants = [(impl, extra, f"{model}_b{batch}_{impl}" + (f"_v{k}" if extra else "") +
                     f"_r{rep}") for impl in args.impls.split(",")
                    for k, extra in enumerate(args.train_args or [""])]  # fmt: skip
        # a repeat runs whole or not at all: a default without its plain is no comparison
        if budget and past_budget(results["runs"], model, start, budget, [v[0] for v in variants]):
            skipped += [v[2] for v in variants]
            continue
        for impl, extra, name in variants:
            out_dir = os.path.join(work, name)
            subprocess.run(["rm", "-rf", out_dir])
            cli = train_args(model, int(batch), impl, int(steps), dataset, out_dir)
            cli += shlex.split(extra)
            res = run_child(cli, torchrun=args.torchrun)
            res = dict(model=model, batch=int(batch), impl=impl, **res)
            res["train_args"], res["repeat"] = extra, rep
            log = os.path.join(out_dir, "log.jsonl")
            if res["rc"] == 0:
                res.update(step_stats(log, int(warmup)))
                shutil.copy(log, os.path.join(args.out, f"log_{name}.jsonl"))
            results["runs"].append(res)
            print(json.dumps(res), flush=True)
            save()
    for extra in (args.train_args or [""]) if args.profile else []:  # a profile per variant
        model, batch = args.profile.split(":")
        out_dir = os.path.join(work, "profile")
        subprocess.run(["rm", "-rf", out_dir])
        cli = train_args(model, int(batch), "default", 16, dataset, out_dir) + shlex.split(extra)
        res = run_child(cli, profile=True)
        results["profiles"].append(
            dict(model=model, batch=int(batch), steps=3, train_args=extra, **res)
        )
        save()
    explicit = {}
    for item in args.max_batch.split(",") if args.max_batch not in ("", "auto") else []:
        impl, b = item.split(":")
        explicit.setdefault(impl, []).append(int(b))
    for impl in args.impls.split(",") if args.max_batch else []:
        tries = explicit.get(impl, []) if explicit else max_batch_candidates(results["runs"], impl)
        for b in tries:
            out_dir = os.path.join(work, f"max_b{b}_{impl}")
            subprocess.run(["rm", "-rf", out_dir])
            res = run_child(train_args("124M", b, impl, 4, dataset, out_dir))
            res = dict(impl=impl, batch=b, fits=res["rc"] == 0, **res)
            results["max_batch"].append({k: v for k, v in res.items() if k != "error"})
            print(json.dumps(results["max_batch"][-1]), flush=True)
            if not res["fits"]:  # where it failed: the last lines of the child's output
                print(res.get("error", ""), flush=True)
            save()
            if res["fits"]:
                break

    print_table(results["runs"])
    if skipped:
        print(f"WARNING: {len(skipped)} runs not started, past --time-budget: {', '.join(skipped)}")
    for r in first_loss_outliers(results["runs"]):
        print(
            f"WARNING: {r['model']} b{r['batch']} {r['impl']} {r.get('train_args', '')!r}: first "
            f"loss {r['loss_first']:.4f} differs from the other runs': it computed something else"
        )
    for prof in [p for p in results["profiles"] if p.get("profile")]:
        total = prof["profile_total_ms"]
        print(f"all kernels: {total / 3:.1f} ms of GPU time per step")
        where = f"{prof['model']} b{prof['batch']}, fused, {prof['train_args']!r}, steps 10-12"
        print(f"top kernels, CUDA ms per step ({where})")
        for ms, n, name in prof["profile"][:25]:  # the JSON keeps the top 60
            print(f"  {ms / 3:7.2f} ms  {100 * ms / total:5.1f}%  x{n // 3:<5d} {name}")
    for r in results["max_batch"]:
        why = f"peak={r.get('peak_gib')}" if r["fits"] else f"oom={r.get('oom')}"
        print(f"max batch: {r['impl']} b{r['batch']} fits={r['fits']} {why}")


if __name__ == "__main__":
    main()
