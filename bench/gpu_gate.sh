#!/usr/bin/env bash
# The GPU gate: run it on one H200, in one call, on the exact code you are about to land whenever
# a change reaches code that runs on CUDA, and put its table in bench/RESULTS.md (#gpu-gate).
#
#   bash bench/gpu_gate.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else out/gpu_gate
#
# 1. every GPU test: pytest -m gpu tests/
# 2. the throughput pair, train.py's defaults against the plain path (materialised logits, torch
#    MLP and attention, torch's fused AdamW, fp32 residual stream): 1558M at micro-batch 16 first
#    (REPEATS_LARGE runs: a cold 1558M pair takes 260-310 s, so three of them do not fit the
#    device's 600 s a call with the rest), then 124M at 32 (REPEATS runs of each, interleaved:
#    medians and ratios). No repeat (default and plain of one model:batch) starts that would end
#    past BUDGET seconds from the start, and one that starts runs whole (a slow machine loses 124M
#    repeats, with a warning, rather than the call's whole table or a default without its plain).
# Then one short table. Exit status: pytest's, else throughput.py's. About 9 minutes on an H200.
# Environment: PYTHON (default python3), REPEATS (3), REPEATS_LARGE (1), RUNS / RUNS_LARGE (the
# model:batch[:steps:warmup] lists; empty: none), IMPLS (default,plain; bench/throughput.py's, e.g.
# default,plain,fp8), BUDGET (570), GATE_COMMIT (the commit the table names, when
# the copy has no .git), WORKERS (pytest-xdist processes for the tests when installed, default 4).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/gpu_gate}}  # the table and the JSON; the runs' logs stay in out/gpu_gate/
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
xdist=()  # the GPU tests are independent: several processes share the one GPU
$py -c "import xdist" 2>/dev/null && xdist=(-n "${WORKERS:-4}")

start=$(date +%s)
$py -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=12 "${xdist[@]}" 2>&1 | tee "$out/gate_pytest.txt"
rc_tests=${PIPESTATUS[0]}
tests_s=$(($(date +%s) - start))

rc_speed=0
for pair in "${RUNS_LARGE-1558M:16:16:6}|${REPEATS_LARGE:-1}" "${RUNS-124M:32:30:10}|${REPEATS:-3}"; do
    IFS="|" read -r runs repeats <<<"$pair"
    [ -z "$runs" ] && continue
    left=$((${BUDGET:-570} - ($(date +%s) - start)))
    $py -m bench.throughput --runs "$runs" --impls "${IMPLS:-default,plain}" --repeats "$repeats" \
        --time-budget "$((left > 1 ? left : 1))" \
        --out "out/gpu_gate/${runs%%:*}" 2>&1 | tee -a "$out/gate_throughput.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && rc_speed=$rc
    cp "out/gpu_gate/${runs%%:*}/throughput.json" "$out/gate_throughput_${runs%%:*}.json"
done

echo
echo "## GPU gate: ${GATE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}, $(date -u +%F)"
$py -c "import torch, triton; print(f'{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}')"
echo "pytest -m gpu tests/ (${tests_s} s): $(grep -E '(passed|failed|error)' "$out/gate_pytest.txt" | tail -1)"
sed -n '/^| model | batch | impl/,/^$/p' "$out/gate_throughput.txt" | grep '^|'
grep WARNING "$out/gate_throughput.txt"
echo "total $(($(date +%s) - start)) s"
[ "$rc_tests" -ne 0 ] && exit "$rc_tests"
exit "$rc_speed"
