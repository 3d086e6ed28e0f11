#!/usr/bin/env bash
# The remaining H200 measurements of 2026-11-29 in one call on a 2-GPU host, two streams at once
# (one GPU each, so they do not share a GPU; they do share the 32 CPU cores while compiling):
#   GPU 0: profile of a 124M step; 500 wiki steps -> fused-loss bench on its hidden states;
#          350M throughput, fused loss
#   GPU 1: 1558M and 350M throughput, torch loss; the one-GPU reference run of the DDP check
#          (ONE_GPU=1: CUDA_VISIBLE_DEVICES is set inside ddp_h200.sh)
# then both GPUs: bench/ddp_h200.sh (torchrun, 2 GPUs). Logs and JSON under $1.
set -uo pipefail
O=${1:-out/x2}
mkdir -p "$O"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python -m data.fineweb --from-text .gpu/train_00.txt.xz --val-from .gpu/valid.txt.xz \
    --name wiki --out-dir data/cache/wiki --no-progress > "$O/prep.log" 2>&1
(
    export CUDA_VISIBLE_DEVICES=0
    python bench/throughput.py --runs "" --profile 124M:32 --out "$O/p" > "$O/profile.log" 2>&1
    python train.py configs/wikipedia.py --total_batch_size=32768 --max_steps=500 \
        --warmup_steps=50 --eval_interval=250 --val_tokens=262144 --sample_interval=0 \
        --ckpt_interval=0 --out_dir=out/wiki500 > "$O/wiki500.log" 2>&1
    python bench/bench_fused_loss.py --shapes "" --checkpoint out/wiki500 \
        --tokens "$(ls data/cache/wiki/*_val_*.bin | head -1)" --reps 8 --out "$O/real" \
        > "$O/real.log" 2>&1
    python bench/throughput.py --runs 350M:32 --impls fused --steps 20 --warmup 8 \
        --out "$O/t350f" > "$O/t350f.log" 2>&1
    echo "stream A done at $(( $(date +%s) - t0 )) s"
) &
(
    export CUDA_VISIBLE_DEVICES=1
    python bench/throughput.py --runs 1558M:16 --impls torch --steps 20 --warmup 8 \
        --out "$O/t1558" > "$O/t1558.log" 2>&1
    ONE_GPU=1 NGPU=2 bash bench/ddp_h200.sh "$O/ddp" one-only > /dev/null 2>&1
    python bench/throughput.py --runs 350M:32 --impls torch --steps 20 --warmup 8 \
        --out "$O/t350t" > "$O/t350t.log" 2>&1
    echo "stream B done at $(( $(date +%s) - t0 )) s"
) &
wait
left=$(( 585 - ($(date +%s) - t0) ))
echo "DDP phase gets ${left} s"
[ "$left" -gt 30 ] && NGPU=2 timeout "$left" bash bench/ddp_h200.sh "$O/ddp" skip-one > "$O/ddp.log" 2>&1
python bench/ddp_compare.py "$O/ddp" >> "$O/ddp.log" 2>&1
