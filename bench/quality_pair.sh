#!/usr/bin/env bash
# Training quality of one change against the default, in one call: the real train.py, GPT-2 124M
# on the local Wikipedia text, the same seed and data order, STEPS steps each; the val-loss curves
# side by side, then the final gap. Prints one table last.
#   W=dir-with-train_0*.txt.xz-and-valid.txt.xz  STEPS=2000  CHANGE="--fp8='tensorwise'" \
#     SEEDS="1337 42"  PARALLEL=1  bash bench/quality_pair.sh OUT_DIR
# CHANGE: several changes separated by ";" run side by side (change1, change2, ...); an empty
# one is the default again, the run-to-run spread of the same recipe (bf16 atomics, FP8
# rounding), e.g. CHANGE=";--fp8='fused';--fp8='tensorwise'".
# SEEDS: a default run and one per change for each (--seed: the init and the data order);
# PARALLEL=1 starts every run at once on the one GPU (124M at B 16 leaves it mostly idle; the
# step times are then meaningless, the losses are not). PACK=1: the logs and curves into one
# quality_runs.tgz (the device returns a few files a call).
# EXTRA: train.py arguments for both runs (a CPU rehearsal: EXTRA="--n_layer=1 --n_embd=64
# --n_head=2 --block_size=64 --device=cpu" STEPS=4 with a small W).
# W: the wikipedia_en folder (two train files, ~35M tokens, stay under the device's 64 MiB carry).
# Each run: batch 16 x 1024 tokens a step, warm-up 100, eval every 200 steps on 1M val tokens.
# Expected: ~35M train + ~1.03M val tokens prepared; two runs of STEPS x 16,384 tokens.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/quality}
W=${W:-.gpu/wiki}
STEPS=${STEPS:-2000}
CHANGE=${CHANGE:-"--fp8='tensorwise'"}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
t0=$(date +%s)
$py -m data.fineweb --from-text "$W"/train_0*.txt.xz --val-from "$W"/valid.txt.xz \
    --name wiki --out-dir data/cache/wiki --no-progress 2>&1 | tail -2
echo "data prepared in $(($(date +%s) - t0)) s"

run() {  # name, extra train.py arguments...
    local name=$1
    shift
    # shellcheck disable=SC2068  # the arguments are split on purpose
    $py train.py configs/wikipedia.py --batch_size=16 --total_batch_size=16384 \
        --max_steps="$STEPS" --warmup_steps=100 --eval_interval=200 --val_tokens=1048576 \
        --sample_interval=0 --ckpt_interval=0 --out_dir="out/quality/$name" ${EXTRA:-} $@ \
        >"$out/$name.log" 2>&1
    echo "$name: exit $?, $(grep -c '^step' "$out/$name.log") step lines, $(($(date +%s) - t0)) s"
    cp "out/quality/$name/log.jsonl" "$out/$name.jsonl"
}
rm -rf out/quality
SEEDS=${SEEDS:-1337}
IFS=";" read -r -a changes <<<"$CHANGE"
[ "${CHANGE: -1}" = ";" ] && changes+=("")  # read drops a trailing empty field
names=(base)
if [ ${#changes[@]} = 1 ]; then names+=(change); else
    for i in "${!changes[@]}"; do names+=("change$((i + 1))"); done
fi
for seed in $SEEDS; do
    for i in "${!names[@]}"; do
        args="--seed=$seed"
        [ "$i" -gt 0 ] && args="$args ${changes[$((i - 1))]}"
        # shellcheck disable=SC2086
        if [ "${PARALLEL:-0}" = 1 ]; then run "${names[$i]}_s$seed" $args & else run "${names[$i]}_s$seed" $args; fi
    done
done
wait

$py - "$out" "$CHANGE" $SEEDS <<'PY'
import json, sys
out, changes, seeds = sys.argv[1], sys.argv[2].split(";"), sys.argv[3:]
names = ["change"] if len(changes) == 1 else [f"change{i + 1}" for i in range(len(changes))]
labels = [c or "default again" for c in changes]
# the same change twice (a spread measurement) gets its own column and its own largest gap
labels = [lab if labels[:i].count(lab) == 0 else f"{lab} #{labels[:i].count(lab) + 1}"
          for i, lab in enumerate(labels)]
def curve(name):
    recs = [json.loads(line) for line in open(f"{out}/{name}.jsonl")]
    val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    train = [r for r in recs if "tok_per_s" in r]
    speed = sorted(r["tok_per_s"] for r in train[len(train) // 10:])
    return val, speed[len(speed) // 2] if speed else float("nan")
worst = dict.fromkeys(labels, 0.0)
for seed in seeds:
    bv, bs = curve(f"base_s{seed}")
    runs = [curve(f"{n}_s{seed}") for n in names]
    head = "".join(f" val loss, {lab} | gap |" for lab in labels)
    print(f"\nseed {seed}\n| step | val loss, default |{head}")
    print("|---|---|" + "---|---|" * len(labels))
    for step in sorted(set(bv).intersection(*(v for v, _ in runs))):
        row = f"| {step} | {bv[step]:.4f} |"
        for lab, (cv, _) in zip(labels, runs):
            gap = cv[step] - bv[step]
            worst[lab] = max(worst[lab], abs(gap))
            row += f" {cv[step]:.4f} | {gap:+.4f} |"
        print(row)
    # at B 16 the host's launches pace the 124M default path (RESULTS.md#cuda-graphs)
    speeds = ", ".join(f"{lab} {cs:,.0f} ({cs / bs:.3f}x)" for lab, (_, cs) in zip(labels, runs))
    print(f"median tok/s after 10 %: default {bs:,.0f}, {speeds}; not a speed comparison: "
          "bench/throughput.py is")
for lab in labels:
    print(f"\nlargest |gap| at any evaluation, {lab}, seeds {' '.join(seeds)}: {worst[lab]:.4f}")
PY
if [ "${PACK:-0}" = 1 ]; then
    tar czf "$out/quality_runs.tgz" -C "$out" $(cd "$out" && ls -- *.log *.jsonl) &&
        rm -f "$out"/*.log "$out"/*.jsonl
fi
echo "total $(($(date +%s) - t0)) s"
