#!/usr/bin/env bash
# Issue 56's GPU call for --fp8=fused, in one device call (~7 minutes on an H200):
#   1. the tests of the fused casts, LayerNorm backward and half blocks on the GPU, and the
#      recipe's GPU tests (tracebacks kept in pytest.txt)
#   2. each fused cast against Inductor's producer + a separate dynamic cast (bench_fp8_casts)
#   3. the MLP half block, fwd+bwd: bf16 op, torchao tensorwise, mlp_fp8 (bench_fp8_mlp), with
#      the fused step's kernels and the GEMM floor; the attention half's table the same way
#   4. only if the fused MLP's GPU time beat bf16's there: train.py at 1558M:16, --fp8=fused
#      against the bf16 default and plain (bench.throughput)
#   PROFILE=1: instead of 1-4, the 1558M:16 --fp8=fused step's top kernels (~2 minutes)
#   bash bench/fp8_fused_call.sh [OUT_DIR]      (torchao's wheel carried for the torchao rows)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/fp8_fused}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# Triton 3.6's bundled ptxas (12.8) miscompiles act_fp8's transposed GELU-gradient copy
# (triton-lang/triton#11111, bench/RESULTS.md#fp8-fused-casts); the machine's CUDA 13 one does not
for p in /usr/local/cuda-13*/bin/ptxas /usr/local/cuda/bin/ptxas; do
    if [ -x "$p" ] && "$p" --version | grep -q "release 13"; then
        export TRITON_PTXAS_PATH=$p
        break
    fi
done
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
$py -m bench.bench_fp8_casts --out "$out" 2>&1 | tail -24 | tee "$out/casts.txt"
$py -m bench.bench_fp8_mlp --out "$out" 2>&1 | tail -34 | tee "$out/mlp.txt"
$py -m bench.bench_fp8_mlp --half attn --out "$out" 2>&1 | tail -12 | tee "$out/attn.txt"
if $py -c "import json, sys; r = json.load(open('$out/bench_fp8_mlp.json'))['results']
fused = min(r[k]['gpu_ms'] for k in r if k.startswith('fused'))
sys.exit(0 if fused < r['bf16']['gpu_ms'] else 1)"; then
    $py -m bench.throughput --runs 1558M:16:12:4 --impls fp8_fused,default,plain --time-budget 300 \
        --out "$out/throughput" 2>&1 | grep -E '^\||WARNING' | tee "$out/throughput.txt"
else
    echo "fused MLP not faster than bf16: no training run"
fi
