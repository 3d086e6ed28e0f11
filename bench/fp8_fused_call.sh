#!/usr/bin/env bash
# Issue 56's GPU call for --fp8=fused, in one device call (~9 minutes on an H200), with the ptxas
# a user's install has (Triton's bundled one; PTXAS=cuda13 takes the machine's CUDA 13 ptxas):
#   1. the tests of the casts, LayerNorm, delayed scales and half blocks on the GPU, and the
#      recipe's GPU tests (tracebacks kept in pytest.txt)
#   2. bench_fp8_casts: which in-kernel transposed copies are right (every store_transposed way,
#      given and delayed scales) and each cast's time against Inductor's producer + a cast
#   3. bench.fp8_stress: the 20-step GPU test's setting on three seeds (re-cast on overflow)
#   4. train.py at 124M:32, --fp8=fused against the bf16 default, and at 1558M:16 against the
#      default and plain (bench.throughput)
#   PROFILE=1: instead of 1-4, the 1558M:16 --fp8=fused step's top kernels (~2 minutes)
#   bash bench/fp8_fused_call.sh [OUT_DIR]      (torchao's wheel carried for test_fp8's rows)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/fp8_fused}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# Triton 3.6's bundled ptxas (12.8) miscompiles act_fp8's in-kernel transposed copies
# (triton-lang/triton#11111, bench/RESULTS.md#fp8-fused-end-to-end); act_fp8 then splits them off
if [ "${PTXAS:-bundled}" = cuda13 ]; then
    for p in /usr/local/cuda-13*/bin/ptxas /usr/local/cuda/bin/ptxas; do
        if [ -x "$p" ] && "$p" --version | grep -q "release 13"; then
            export TRITON_PTXAS_PATH=$p
            break
        fi
    done
else
    unset TRITON_PTXAS_PATH
fi
echo "TRITON_PTXAS_PATH=${TRITON_PTXAS_PATH:-bundled}"
if [ "${PROFILE:-0}" = 1 ]; then
    $py -m bench.throughput --runs "" --impls default --profile 1558M:16 \
        --train-args="--fp8='fused'" --out "$out/profile" 2>&1 | tail -32 | tee "$out/profile.txt"
    exit 0
fi
$py -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_fp8_scale.py tests/test_ln_fp8.py \
    tests/test_act_fp8.py tests/test_mlp_fp8.py tests/test_attn_fp8.py >"$out/pytest.txt" 2>&1
$py -m pytest -q -m gpu -p no:cacheprovider -rf --tb=line tests/test_fp8.py -k "fused or check" \
    >>"$out/pytest.txt" 2>&1
grep -E "^/|^E |^FAILED|passed|failed" "$out/pytest.txt" | cut -c1-300 | head -30
$py -m bench.bench_fp8_casts --out "$out" 2>&1 | tail -30 | tee "$out/casts.txt"
$py -m bench.fp8_stress --seeds 1337 7 42 --out "$out" 2>&1 | tail -6 | tee "$out/stress.txt"
$py -m bench.throughput --runs 124M:32:30:10 --impls fp8_fused,default --time-budget 100 \
    --out "$out/throughput_124M" 2>&1 | grep -E '^\||WARNING' | tee "$out/throughput_124M.txt"
$py -m bench.throughput --runs 1558M:16:12:4 --impls fp8_fused,default,plain --time-budget 300 \
    --out "$out/throughput" 2>&1 | grep -E '^\||WARNING' | tee "$out/throughput.txt"
