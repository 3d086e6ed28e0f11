#!/usr/bin/env bash
# Issue 56's first GPU call for --fp8=fused, in one device call (~8 minutes on an H200):
#   1. the tests of the fused casts and half blocks on the GPU, and the recipe's GPU tests
#   2. each fused cast against Inductor's producer + a separate dynamic cast (bench_fp8_casts)
#   3. the MLP half block, fwd+bwd: bf16 op, torchao tensorwise, mlp_fp8 (bench_fp8_mlp)
#   4. train.py at 1558M:16: --fp8=fused against --fp8=tensorwise and plain (bench.throughput)
#   bash bench/fp8_fused_call.sh [OUT_DIR]      (torchao's wheel carried for the torchao rows)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/fp8_fused}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# every test of the fused kernels and half blocks (on this GPU: cuDNN's attention, compiled
# Triton), then the recipe's GPU tests
$py -m pytest -q -p no:cacheprovider tests/test_ln_fp8.py tests/test_act_fp8.py \
    tests/test_mlp_fp8.py tests/test_attn_fp8.py 2>&1 | tail -15 | tee "$out/pytest.txt"
$py -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8.py 2>&1 | tail -15 \
    | tee -a "$out/pytest.txt"
$py -m bench.bench_fp8_casts --out "$out" 2>&1 | tail -16 | tee "$out/casts.txt"
$py -m bench.bench_fp8_mlp --out "$out" 2>&1 | tail -8 | tee "$out/mlp.txt"
$py -m bench.throughput --runs 1558M:16:12:4 --impls fp8_fused,fp8,plain --time-budget 330 \
    --out "$out/throughput" 2>&1 | grep -E '^\||WARNING' | tee "$out/throughput.txt"
