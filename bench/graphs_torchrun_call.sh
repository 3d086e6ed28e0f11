#!/usr/bin/env bash
# Issue 55's GPU call for CUDA graphs under torchrun (grad_sync "step"), one device call on one
# H200 (~8 minutes):
#   1. the GPU gate without 1558M (every GPU test, the torchrun + graphs run with evaluations,
#      a sample and a resume among them; then 124M:32 default against plain)
#   2. bench.throughput at 124M, micro-batch 8 (RUNS): under torchrun (1 process, NCCL) the
#      default (CUDA graphs, grads summed once a step) against plain (DDP, no graphs), then
#      the single-process default, the figure torchrun should now come close to
#   GATE_COMMIT=<sha> bash bench/graphs_torchrun_call.sh [OUT_DIR]   (pytest-xdist carried)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/graphs_torchrun}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
RUNS_LARGE="" RUNS=124M:32:30:10 REPEATS=1 BUDGET=${GATE_BUDGET:-330} \
    bash bench/gpu_gate.sh "$out/gate" >"$out/gate.log" 2>&1
rc=$?
tail -8 "$out/gate.log"
grep -E "^FAILED|^E " "$out/gate/gate_pytest.txt" | cut -c1-300 | head -10
runs=${RUNS:-124M:8:20:8}
$py -m bench.throughput --torchrun --runs "$runs" --impls default,plain \
    --time-budget "${BUDGET_TORCHRUN:-150}" --out "$out/torchrun" 2>&1 | grep -E '^\||WARNING' |
    tee "$out/torchrun.txt"
$py -m bench.throughput --runs "$runs" --impls default --time-budget "${BUDGET_SINGLE:-60}" \
    --out "$out/single" 2>&1 | grep -E '^\||WARNING' | tee "$out/single.txt"
exit $rc
