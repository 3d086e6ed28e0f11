#!/bin/bash
# call 1: FP8 variants at 1558M and 124M width, then 124M:16 default vs plain
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
set -o pipefail
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv | tee $OUT/smi.txt
F='Failed to load|KernelPreference|register_constant'
timeout 230 python bench/bench_fp8.py --preset gpt2-xl --n_layer 6 --batch 16 \
  --variants bf16,plain,tensorwise,rowwise,tensorwise_fast_accum,tensorwise_gw_bf16,tensorwise_mlp,tensorwise_no_qkv \
  --profile bf16,tensorwise --out out/bfx 2>&1 | grep -Ev "$F" | tee $OUT/xl.txt
cp out/bfx/bench_fp8.json $OUT/xl.json
timeout 170 python bench/bench_fp8.py --preset gpt2 --n_layer 12 --batch 32 \
  --variants bf16,plain,tensorwise,tensorwise_auto,tensorwise_mlp,tensorwise_fc,tensorwise_no_qkv \
  --profile bf16,tensorwise --out out/bfs 2>&1 | grep -Ev "$F" | tee $OUT/small.txt
cp out/bfs/bench_fp8.json $OUT/small.json
timeout 150 python bench/throughput.py --runs 124M:16:30:10 --impls default,plain --out out/tp 2>&1 | grep -Ev "$F" | tee $OUT/tp.txt
cp out/tp/throughput.json $OUT/tp.json
