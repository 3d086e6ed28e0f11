"""What each recipe trains with on a smaller card, and what the cap costs: for every recipe in
configs/ and each card size, train.py under GPT2_FUSED_GPU_GB=card picks its micro-batch
(batch_size="auto", gpt2_fused/training/memory.py) or stops at start-up naming what would fit, and
trains a few steps; the same micro-batch then trains uncapped in the same process, and the row
gives both tok/s and their ratio.

    python -m bench.memory_fit [--recipes 124m,350m,774m,1558m,tinystories]
        [--cards 12,16,24,40,80] [--steps 16] [--warmup 6] [--out DIR] [--compile] [--cpu]

Every cell is eager (--compile=False): compiling each of the ~40 runs would take about a minute
apiece, past the ~8 minutes this table may take on one H100, and the probe that picks the
micro-batch is eager too, so the peak column checks the probe against a run it predicts (a
compiled step keeps no more activations). Random tokens (bench.throughput's shard), one
micro-batch a step (--total_batch_size=0: the recipes' 2**19-2**20 tokens would be hundreds of
micro-steps at micro-batch 1; on one GPU every rung divides them, so the pick is the same),
no checkpoints or samples, one evaluation after the last step (64K tokens, at the picked
micro-batch: within the headroom). configs/wikipedia.py is 124M again: not run. One process per
recipe runs its cells (each train.main applies its cap anew): imports and CUDA set-up once.
tok/s is the median over the steps after --warmup; peak GiB is torch.cuda.max_memory_allocated
over the run (probe included).

--compile compiles every cell instead (a minute or more each): to check the picks against
compiled steps and CUDA graphs on a few cells (--recipes 124m --cards 12,24).
--cpu rehearses the table's code on a CPU with a 2-layer model in each recipe's place (no cap
applies there: auto is 8); tests/test_bench.py runs it.
"""

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {
    "124m": "configs/gpt2_124m_fineweb.py",
    "350m": "configs/gpt2_350m_fineweb.py",
    "774m": "configs/gpt2_774m_fineweb.py",
    "1558m": "configs/gpt2_1558m_fineweb_edu.py",
    "tinystories": "configs/tinystories.py",
}
# --cpu: the recipe's model replaced by one that trains in milliseconds on a CPU
TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=64",
    "--block_size=64",
    "--loss_impl='torch'",
    "--vocab_size=512",
    "--padded_vocab_size=512",
    "--device='cpu'",
    "--dtype='float32'",
]
TINY_VOCAB = 512
PICKED = re.compile(r"micro-batch (\d+) \(auto")


def train_once(args, cap, steps, warmup, out_dir):
    """train.main(args) in this process under GPT2_FUSED_GPU_GB=cap (None: the whole card):
    {"batch": picked, "tok_per_s", "peak_gib"}, or {"error": the one line it stopped with}."""
    import torch

    import train
    from bench.common import for_benchmarks
    from gpt2_fused.training.memory import CAP_ENV
    from gpt2_fused.training.runlog import read_jsonl

    save = train.save_checkpoint  # restored after the run: a test calls this in its own process
    for_benchmarks(train)  # checkpoints are empty files
    cuda = torch.cuda.is_available() and "--device='cpu'" not in args
    if cuda and cap is not None and cap >= torch.cuda.get_device_properties(0).total_memory / 2**30:
        cap = None  # an "80 GB" card on an 80 GB H100 (79.6 GiB): the whole card, no cap
    if cap is None:
        os.environ.pop(CAP_ENV, None)
    else:
        os.environ[CAP_ENV] = str(cap)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            train.main([*args, f"--out_dir={out_dir}", f"--max_steps={steps}"])
    except (SystemExit, ValueError) as e:  # ConfigError: the start-up refusal; SystemExit: OOM
        return {"error": " ".join(str(e.code if isinstance(e, SystemExit) else e).split())}
    finally:
        os.environ.pop(CAP_ENV, None)
        train.save_checkpoint = save
    recs = [r for r in read_jsonl(os.path.join(out_dir, "log.jsonl")) if "tok_per_s" in r]
    picked = PICKED.search(text.getvalue())
    return {
        "batch": int(picked.group(1)) if picked else None,
        "tok_per_s": statistics.median(r["tok_per_s"] for r in recs if r["step"] >= warmup),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
    }


def recipe_cells(recipe, cards, steps, warmup, work, cpu=False, data=None, compile_=False):
    """The rows of one recipe: per card, the capped auto run and the uncapped run of its pick
    (one per micro-batch, shared by the cards that pick it). data: a dataset folder (None:
    bench.throughput's random tokens); compile_: train.py's --compile."""
    from bench.throughput import random_dataset
    from data.prepare import CACHE_DIR

    if data is None and cpu:
        data = tiny_dataset(os.path.join(work, "tiny_data"))
    data = data or random_dataset(str(CACHE_DIR / "random"), 1 << 24)
    args = [os.path.join(ROOT, RECIPES[recipe]), f"--dataset='{data}'", "--total_batch_size=0",
            "--eval_interval=0", "--sample_interval=0", "--ckpt_interval=0", "--keep_last=1",
            "--warmup_steps=2", f"--compile={compile_}"]  # fmt: skip
    args += [*TINY, "--val_tokens=512"] if cpu else ["--val_tokens=65536"]
    rows, uncapped = [], {}
    for gb in cards:
        out = os.path.join(work, f"{recipe}_{gb}")
        row = dict(recipe=recipe, card_gb=gb, **train_once(args, gb, steps, warmup, out))
        B = row.get("batch")
        if B is not None and B not in uncapped:
            explicit = [*args, f"--batch_size={B}"]
            uncapped[B] = train_once(explicit, None, steps, warmup, out + "_uncapped")
        if B is not None:
            base = uncapped[B]
            row["uncapped_tok_per_s"] = base.get("tok_per_s")
            row["uncapped_error"] = base.get("error")
            if base.get("tok_per_s"):
                row["ratio"] = row["tok_per_s"] / base["tok_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def tiny_dataset(folder):
    """Uniform random token ids below TINY_VOCAB: a train and a val shard (the --cpu model's)."""
    import numpy as np

    from data.shards import write_shard

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        write_shard(
            os.path.join(folder, f"tiny_{split}_000000.bin"), rng.integers(0, TINY_VOCAB, 1 << 15)
        )
    return folder


def table(rows, caption):
    """The markdown table of rows (recipe_cells'), under caption."""
    cols = "recipe | card GB | micro-batch | tok/s | peak GiB | uncapped tok/s (same micro-batch)"
    lines = [caption, "", f"| {cols} | capped / uncapped |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['recipe']} | {r['card_gb']} |"
        if "error" in r:
            lines.append(f"{head} stops: {r['error']} | | | | |")
            continue
        base = f"{r['uncapped_tok_per_s']:,.0f}" if r.get("uncapped_tok_per_s") else "error"
        ratio = f"{r['ratio']:.3f}x" if "ratio" in r else (r.get("uncapped_error") or "")
        lines.append(
            f"{head} {r['batch']} | {r['tok_per_s']:,.0f} | {r['peak_gib']:.1f} | {base} | "
            f"{ratio} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"of {list(RECIPES)}")
    ap.add_argument("--cards", default="12,16,24,40,80", help="GiB caps (GPT2_FUSED_GPU_GB)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=6, help="steps left out of the tok/s median")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/memory_fit"))
    ap.add_argument("--cpu", action="store_true", help="a tiny model on the CPU: a rehearsal")
    ap.add_argument(
        "--compile", action="store_true", help="compiled cells (minutes each): check a few"
    )
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # one recipe, in a process
    args = ap.parse_args(argv)
    cards = [int(c) if float(c).is_integer() else float(c) for c in args.cards.split(",")]
    work = os.path.join(os.path.abspath(args.out), "runs")  # each cell's out_dir
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        recipe_cells(args.child, cards, args.steps, args.warmup, work, compile_=args.compile)
        return
    rows, t0 = [], time.time()
    for recipe in args.recipes.split(","):
        if args.cpu:  # in this process: the rehearsal is about the table, not isolation
            rows += recipe_cells(recipe, cards, args.steps, args.warmup, work, cpu=True)
            continue
        cmd = [
            sys.executable,
            "-m",
            "bench.memory_fit",
            f"--child={recipe}",
            f"--cards={args.cards}",
            f"--steps={args.steps}",
            f"--warmup={args.warmup}",
        ]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        got = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        if p.returncode:
            tail = " ".join(p.stderr.strip().splitlines()[-1:])[-300:]
            got.append(dict(recipe=recipe, card_gb="-", error=f"process failed: {tail}"))
        rows += got
    caption = caption_line(args, time.time() - t0)
    with open(os.path.join(args.out, "memory_fit.json"), "w") as f:
        json.dump(dict(caption=caption, rows=rows), f, indent=1)
    print("\n" + table(rows, caption))


def caption_line(args, seconds):
    import torch

    where = "cpu" if args.cpu else torch.cuda.get_device_name()
    how = "compiled" if args.compile else "eager (--compile=False)"
    return (
        f"{where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: {how}, random "
        f"tokens, one micro-batch a step, {args.steps} steps (tok/s: median after "
        f"{args.warmup}); capped and uncapped in the same process per recipe; "
        f"{seconds / 60:.1f} min"
    )


if __name__ == "__main__":
    main()

# Prints one JSON line per cell as it ends, then the table: 25 rows (5 recipes x 5 cards); a
# recipe whose weights, grads and AdamW state outgrow a card stops there naming --shard.
