#!/usr/bin/env bash
# DDP on the GPUs of one host: the real train.py, 124M, micro-batch B=32 (another
# model: e.g. MODEL_ARGS="--model=gpt2-xl --activation_memory_budget=0.95" B=16; any train.py
# setting can go there), total batch TOTAL tokens per step (default NGPU x B x T), on random
# tokens (data/cache/random; made here if missing). The resume part needs STEPS >= 16.
#   NGPU=2 [ONE_GPU=0 TOTAL=.. STEPS=30 RESUME=1] bash bench/ddp_scaling.sh LOGDIR [skip-one | one-only]
# 1. one GPU with NGPU-fold more gradient accumulation (the reference; skipped with skip-one when it
#    ran already), 2. NGPU GPUs through torchrun: same data order, so the loss curves must agree,
#    3. an NGPU run with checkpoints every 10 steps killed (SIGKILL) after step 15, then resumed:
#    it must continue the curve of run 2 (RESUME=0 skips it). Then `python -m bench.ddp_compare`
#    compares them.
# Rehearsal on CPU (gloo, ~50 s on 2 cores): MODEL_ARGS="--n_layer=2 --n_head=2
#   --n_embd=64 --block_size=64 --device=cpu" T=64 B=4 NGPU=2 bash bench/ddp_scaling.sh /tmp/ddp
set -uo pipefail
LOG=${1:-out/ddp}
NGPU=${NGPU:-2}
B=${B:-32}
T=${T:-1024}
TOTAL=${TOTAL:-$((NGPU * B * T))}
STEPS=${STEPS:-30}
read -r -a MODEL <<< "${MODEL_ARGS:---model=gpt2}"
mkdir -p "$LOG" out/ddp
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -c "from bench import throughput as t; t.random_dataset('data/cache/random', 1 << 24)"
ARGS=("${MODEL[@]}" --dataset=data/cache/random --batch_size="$B"
      --total_batch_size="$TOTAL" --max_steps="$STEPS" --warmup_steps=5 --eval_interval=0
      --val_tokens=$((NGPU * B * T)) --sample_interval=0 --keep_last=2)
TR=(torchrun --standalone --nproc_per_node="$NGPU")
if [ "${2:-}" != skip-one ]; then
    rm -rf out/ddp/one
    CUDA_VISIBLE_DEVICES=${ONE_GPU:-0} python train.py "${ARGS[@]}" --ckpt_interval=0 \
        --out_dir=out/ddp/one > "$LOG/one.log" 2>&1
    cp out/ddp/one/log.jsonl "$LOG/one.jsonl"
fi
[ "${2:-}" = one-only ] && exit 0
rm -rf out/ddp/multi out/ddp/resume
"${TR[@]}" train.py "${ARGS[@]}" --ckpt_interval=0 --out_dir=out/ddp/multi > "$LOG/multi.log" 2>&1
cp out/ddp/multi/log.jsonl "$LOG/multi.jsonl"
if [ "${RESUME:-1}" = 0 ]; then python -m bench.ddp_compare "$LOG"; exit 0; fi
"${TR[@]}" train.py "${ARGS[@]}" --ckpt_interval=10 --out_dir=out/ddp/resume \
    > "$LOG/resume_a.log" 2>&1 &
pid=$!
until grep -q '"step": 15,' out/ddp/resume/log.jsonl 2>/dev/null || ! kill -0 $pid 2>/dev/null; do
    sleep 0.5
done
# SIGKILL torchrun and its workers (they run in sessions of their own, so a process-group kill
# of torchrun would leave them training): everything whose command line names this out_dir
pkill -9 -f "out_dir=out/ddp/resume"; wait $pid 2>/dev/null
while pgrep -f "out_dir=out/ddp/resume" > /dev/null; do sleep 0.2; done
echo "killed after: $(grep -c '"loss"' out/ddp/resume/log.jsonl) logged steps; checkpoints: $(ls out/ddp/resume)"
"${TR[@]}" train.py "${ARGS[@]}" --ckpt_interval=10 --out_dir=out/ddp/resume --resume \
    > "$LOG/resume_b.log" 2>&1
cp out/ddp/resume/log.jsonl "$LOG/resume.jsonl"
python -m bench.ddp_compare "$LOG"
