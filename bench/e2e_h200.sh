#!/usr/bin/env bash
# End-to-end on one GPU: the real train.py on the local Wikipedia text, fused loss vs torch loss
# from the same seed, plus a second torch seed for the seed-to-seed spread. Each run's log.jsonl
# gives the val curve and the step times (tok/s); the wrapper prints peak GPU memory.
#   W=dir-with-train_00.txt.xz-and-valid.txt.xz  STEPS=1000  [EXTRA="--low_precision_residual=True"] \
#     bash bench/e2e_h200.sh RUNDIR [LOGDIR]
# EXTRA: train.py arguments added to all three runs.
# Checkpoints go under RUNDIR; the logs, the JSONL metrics and the samples under LOGDIR.
# Expected: ~17.5M train tokens + 1.03M val tokens prepared; three runs of STEPS x 32,768 tokens.
set -uo pipefail
OUTDIR=${1:-out/e2e}
LOGDIR=${2:-$OUTDIR}
W=${W:-.gpu}
STEPS=${STEPS:-1000}
mkdir -p "$OUTDIR" "$LOGDIR"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python -m data.fineweb --from-text "$W"/train_00.txt.xz --val-from "$W"/valid.txt.xz \
    --name wiki --out-dir data/cache/wiki --no-progress 2>&1 | tail -3
echo "data prepared in $(( $(date +%s) - t0 )) s"

run() {  # name loss_impl seed steps outdir
    # shellcheck disable=SC2086  # EXTRA is split into arguments on purpose
    python - "$@" ${EXTRA:-} <<'PY' 2>&1 | grep -v "^  " | tee "$LOGDIR/$1.log" | grep -E "step +(1|50|100|500|999|1000)/|val|PEAK|Error|error" | head -40
import sys, torch, train
name, impl, seed, steps, outdir = sys.argv[1:6]
train.main(["configs/wikipedia.py", *sys.argv[6:], f"--loss_impl='{impl}'", f"--seed={seed}",
            f"--max_steps={steps}", "--total_batch_size=32768", "--batch_size=32",
            "--warmup_steps=100", "--eval_interval=100", "--val_tokens=262144",
            "--sample_interval=0", "--ckpt_interval=0", f"--out_dir={outdir}/{name}"])
print(f"PEAK_GIB {name} {torch.cuda.max_memory_allocated() / 2**30:.2f}")
PY
    cp "$OUTDIR/$1/log.jsonl" "$LOGDIR/$1.jsonl" 2>/dev/null
}
run fused fused 1337 "$STEPS" "$OUTDIR"
python sample.py --ckpt "$OUTDIR/fused" --num-samples 5 --max-new-tokens 80 --seed 1 \
    > "$LOGDIR/samples.txt" 2>&1; tail -c 1200 "$LOGDIR/samples.txt"
run torch torch 1337 "$STEPS" "$OUTDIR"
run torch_seed2 torch 2024 "$STEPS" "$OUTDIR"
echo "total $(( $(date +%s) - t0 )) s"
