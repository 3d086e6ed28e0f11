#!/usr/bin/env bash
# The GPU gate: run it on one H200, in one call, on the exact code you are about to land whenever
# a change reaches code that runs on CUDA, and put its table in bench/RESULTS.md (§0).
#
#   bash bench/gpu_gate.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else out/gpu_gate
#
# 1. every GPU test: pytest -m gpu tests/
# 2. the throughput pair, train.py's defaults against the plain path (materialised logits, torch
#    MLP, torch's fused AdamW, fp32 residual stream), 124M at micro-batch 32 and 1558M at 16,
#    REPEATS runs of each, interleaved, medians and ratios (bench/throughput.py)
# Then one short table. Exit status: pytest's, else throughput.py's.
# Environment: PYTHON (default python3), REPEATS (3), RUNS (the model:batch[:steps:warmup] list),
# GATE_COMMIT (the commit named in the table, when the copy has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/gpu_gate}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
runs=${RUNS:-124M:32:30:10,1558M:16:16:6}

start=$(date +%s)
$py -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$out/gate_pytest.txt"
rc_tests=${PIPESTATUS[0]}
tests_s=$(($(date +%s) - start))

$py bench/throughput.py --runs "$runs" --impls default,plain --repeats "${REPEATS:-3}" \
    --out "$out" 2>&1 | tee "$out/gate_throughput.txt"
rc_speed=${PIPESTATUS[0]}

echo
echo "## GPU gate: ${GATE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}, $(date -u +%F)"
$py -c "import torch, triton; print(f'{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}')"
echo "pytest -m gpu tests/ (${tests_s} s): $(grep -E '(passed|failed|error)' "$out/gate_pytest.txt" | tail -1)"
sed -n '/^| model | batch | impl/,$p' "$out/gate_throughput.txt"
echo "total $(($(date +%s) - start)) s"
[ "$rc_tests" -ne 0 ] && exit "$rc_tests"
exit "$rc_speed"
