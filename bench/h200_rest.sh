#!/usr/bin/env bash
# The remaining single-H200 measurements of 2026-11-29 in one call, in order of need, each
# started only while the call's time budget (BUDGET s, default 570) still has room for it:
#   profile of a 124M step (fused); 400 wiki steps -> fused-loss bench on its hidden states;
#   1558M throughput with the torch loss; 350M throughput, fused then torch.
# Logs and JSON under $1 (default out/rest).
set -uo pipefail
O=${1:-out/rest}
BUDGET=${BUDGET:-570}
mkdir -p "$O"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
room() { [ $(( $(date +%s) - t0 + $1 )) -le "$BUDGET" ]; }  # room for a step of ~$1 s?
python -m data.fineweb --from-text .gpu/train_00.txt.xz --val-from .gpu/valid.txt.xz \
    --name wiki --out-dir data/cache/wiki --no-progress > "$O/prep.log" 2>&1
python bench/throughput.py --runs "" --profile 124M:32 --out "$O" > "$O/profile.log" 2>&1
echo "profile done at $(( $(date +%s) - t0 )) s"
python train.py configs/wikipedia.py --total_batch_size=32768 --max_steps=400 \
    --warmup_steps=50 --eval_interval=200 --val_tokens=262144 --sample_interval=0 \
    --ckpt_interval=0 --out_dir=out/wiki400 > "$O/wiki400.log" 2>&1
python bench/bench_fused_loss.py --shapes "" --checkpoint out/wiki400 \
    --tokens "$(ls data/cache/wiki/*_val_*.bin | head -1)" --reps 8 --out "$O" \
    > "$O/real.log" 2>&1
echo "real-logits bench done at $(( $(date +%s) - t0 )) s"
room 200 && python bench/throughput.py --runs 1558M:16 --impls torch --steps 20 --warmup 8 \
    --out "$O/t1558" > "$O/t1558.log" 2>&1
echo "1558M done at $(( $(date +%s) - t0 )) s"
for impl in fused torch; do
    room 95 && python bench/throughput.py --runs 350M:32 --impls $impl --steps 20 --warmup 8 \
        --out "$O/t350$impl" > "$O/t350$impl.log" 2>&1
    echo "350M $impl done at $(( $(date +%s) - t0 )) s"
done
