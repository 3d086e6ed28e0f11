#!/usr/bin/env bash
# Issue 55's GPU call for CUDA graphs under torchrun (grad_sync "step"), in one device call on
# one H200 (~8 minutes):
#   1. the GPU tests of training, DDP and sharding (the torchrun + graphs run with evaluations,
#      a sample and a resume among them)
#   2. bench.throughput at 124M, micro-batch 8 and 16: under torchrun (1 process, NCCL) the
#      default (CUDA graphs, grads summed once a step) against plain (DDP, no graphs), then the
#      single-process default, the figure torchrun should now match
#   bash bench/graphs_torchrun_call.sh [OUT_DIR]      (pytest-xdist carried for the tests)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/graphs_torchrun}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
xdist=()
$py -c "import xdist" 2>/dev/null && xdist=(-n "${WORKERS:-4}")
$py -m pytest -q -m gpu -p no:cacheprovider -rf --tb=line "${xdist[@]}" tests/test_ddp.py \
    tests/test_train.py tests/test_shard.py >"$out/pytest.txt" 2>&1
grep -E "^/|^E |^FAILED|passed|failed" "$out/pytest.txt" | cut -c1-300 | head -20
runs=${RUNS:-124M:8:20:8,124M:16:20:8}
$py -m bench.throughput --torchrun --runs "$runs" --impls default,plain \
    --time-budget "${BUDGET_TORCHRUN:-240}" --out "$out/torchrun" 2>&1 | grep -E '^\||WARNING' |
    tee "$out/torchrun.txt"
$py -m bench.throughput --runs "$runs" --impls default --time-budget "${BUDGET_SINGLE:-100}" \
    --out "$out/single" 2>&1 | grep -E '^\||WARNING' | tee "$out/single.txt"
