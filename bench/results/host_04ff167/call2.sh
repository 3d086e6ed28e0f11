#!/bin/bash
# call 2: host time at 124M small micro-batches: default vs plain, reduce-overhead
export PYTHONUNBUFFERED=1
set -o pipefail
for v in default plain; do timeout 100 python out_call/host_probe.py $v 16 2>&1 | grep -v Warn | tee -a $OUT/host.txt; done
timeout 250 python bench/throughput.py --runs 124M:16:30:10 --impls default,plain --train-args= --train-args="--compile_mode='reduce-overhead'" --out out/tp2 2>&1 | tee $OUT/tp2.txt
cp out/tp2/throughput.json $OUT/tp2.json
timeout 120 python bench/throughput.py --runs 124M:8:40:10 --impls default,plain --out out/tp3 2>&1 | tee $OUT/tp3.txt
cp out/tp3/throughput.json $OUT/tp3.json
