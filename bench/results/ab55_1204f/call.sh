# Next session, issue 55: branches wgrad_timed (dW GEMMs by a timed cuBLASLt/torch pick) and
# bias_fp32 (on top of it: fp32 bias into the cuBLASLt epilogues, no cast kernels), one call (~9 min).
# Before: cd /work/main && rm -rf .gpu/base .gpu/wgrad && mkdir -p .gpu/base .gpu/wgrad
#         git archive main | tar -x -C .gpu/base && git archive wgrad_timed | tar -x -C .gpu/wgrad
#         git checkout --detach bias_fp32   (then git checkout main after)
# run: bash .gpu/ab55_call.sh $OUT   carry [".whl", ".gpu/base", ".gpu/wgrad", ".gpu/ab55_call.sh"]
# If a branch wins at every micro-batch and its tests pass: merge it, then the full gate
# (bench/gpu_gate.sh, with 1558M) in a second call; record both in RESULTS (#cuda-graphs, #gpu-gate).
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
root=$PWD
PYTHONPATH=/tmp/site:$root python3 -m pytest -q -m gpu tests/test_cublaslt.py tests/test_mlp.py \
    -k "mm_fp32 or fp32_bias or epilogue" -p no:cacheprovider -rs > "$out/pytest_ab55.txt" 2>&1
tail -3 "$out/pytest_ab55.txt"; grep -E "^FAILED|^E " "$out/pytest_ab55.txt" | cut -c1-300 | head
# same-call A/B/C, one micro-batch a step (bench/throughput.py's rows), one run each
for side in base wgrad bias; do
    dir=$root; [ $side = base ] && dir=$root/.gpu/base; [ $side = wgrad ] && dir=$root/.gpu/wgrad
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 170 python3 -m bench.throughput \
        --runs 124M:8:20:8,124M:16:20:8,124M:32:20:8,124M:64:16:6 --impls default \
        --out "$out/ab_$side" 2>&1 | grep -E '^\| 124M' | sed "s/^/$side /")
done
