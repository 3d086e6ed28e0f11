#!/usr/bin/env bash
# --shard's cost against DDP on one GPU: the real train.py under `torchrun
# --nproc_per_node=1` (bench/throughput.py --torchrun; compiled, bf16 autocast, random tokens,
# one micro-batch a step), each mode against the DDP run with the same AdamW:
#   ZeRO-1 (--shard=optimizer, the Triton AdamW)   against DDP (the Triton AdamW)
#   FSDP2  (--shard=full, torch's fused AdamW)     against DDP with --adamw_impl=torch
# At world size 1 nothing is split: this measures what the engines add (ZeRO's per-parameter
# broadcasts, FSDP2's gathers, reduce-scatters and hooks as copies and graph breaks), not the
# memory they save on several GPUs. Per run: tok/s, peak GiB and the optimizer-state bytes that
# train.py measured; throughput.py warns when a run's first loss differs from the others'.
#
#   bash bench/shard_overhead.sh [OUT_DIR]      # OUT_DIR defaults to $OUT, else out/shard_overhead
#
# Environment: RUNS (model:batch[:steps:warmup], default 124M:32:30:10; 1558M:16:16:6 takes
# about 8 minutes more, so a call of its own), REPEATS (1), PYTHON (python3).
# About 3-4 minutes at 124M:32 on an H200 (four compiled runs of ~45 s). It prints
# throughput.py's table, then one row per mode:
#   | run | mode | tok/s | vs DDP | peak GiB | optimizer state GiB |
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/shard_overhead}}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
$py -m bench.throughput --torchrun --runs "${RUNS:-124M:32:30:10}" --impls default \
    --repeats "${REPEATS:-1}" --out "$out" --train-args= --train-args="--shard='optimizer'" \
    --train-args="--adamw_impl='torch'" --train-args="--shard='full' --adamw_impl='torch'" \
    2>&1 | tee "$out/shard_overhead.txt"
rc=${PIPESTATUS[0]}
$py - "$out/throughput.json" <<'EOF' | tee -a "$out/shard_overhead.txt"
import json, sys
from bench import throughput  # a script on stdin has the working directory (the root) on sys.path

runs = json.load(open(sys.argv[1]))["runs"]
modes = {  # train args -> (name, the DDP run it is compared with)
    "": ("DDP", ""),
    "--shard='optimizer'": ("ZeRO-1", ""),
    "--adamw_impl='torch'": ("DDP, torch AdamW", "--adamw_impl='torch'"),
    "--shard='full' --adamw_impl='torch'": ("FSDP2, torch AdamW", "--adamw_impl='torch'"),
}
rows = {(r["model"], r["batch"], r["train_args"]): r for r in throughput.summarise(runs)}
state = {(r["model"], r["batch"], r["train_args"]): r.get("state_bytes", [0])[0] for r in runs}
print("\n| run | mode | tok/s | vs DDP | peak GiB | optimizer state GiB |\n|---|---|---|---|---|---|")
for (model, batch, args), row in rows.items():
    name, base = modes.get(args, (args, ""))
    if "tok_per_s" not in row:
        print(f"| {model}:{batch} | {name} | failed: {row.get('error', '')[-100:]} | | | |")
        continue
    ref = rows.get((model, batch, base), {}).get("tok_per_s")
    ratio = f"{row['tok_per_s'] / ref:.3f}x" if ref else ""
    gib = state[model, batch, args] / 2**30
    print(
        f"| {model}:{batch} | {name} | {row['tok_per_s']:,.0f} | {ratio} | "
        f"{row['peak_gib']:.2f} | {gib:.2f} |"
    )
EOF
exit "$rc"
