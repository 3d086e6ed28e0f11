python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
t0=$(date +%s)
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
git log --oneline -1 2>/dev/null || true
python3 -c "import triton, inspect; from triton.backends.nvidia import compiler as c; print(inspect.getsource(c.CUDABackend.hash))" | head -4
echo "== probe, bundled ptxas, fresh cache"
TRITON_CACHE_DIR=/tmp/tc_bundled timeout 120 python3 .gpu/probe_bundled.py 2>&1 | tail -12 | tee $OUT/probe_bundled.txt
export TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas; $TRITON_PTXAS_PATH --version | tail -1
echo "== cache key: CUDA13 ptxas on the bundled cache dir"
TRITON_CACHE_DIR=/tmp/tc_bundled timeout 60 python3 .gpu/probe_bundled.py 2>&1 | tail -3 | tee $OUT/probe_cuda13_samecache.txt
echo "== elapsed $(($(date +%s)-t0)) s"
python3 -m bench.throughput --runs 1558M:16:12:4 --impls fp8_fused,default,plain --time-budget 300 \
    --out $OUT/tp1558 2>&1 | grep -E '^\||WARNING|rror' | tee $OUT/tp1558.txt
echo "== elapsed $(($(date +%s)-t0)) s"
python3 -m bench.throughput --runs 124M:32:30:10 --impls fp8_fused,default --time-budget 100 \
    --out $OUT/tp124 2>&1 | grep -E '^\||WARNING|rror' | tee $OUT/tp124.txt
el=$(($(date +%s)-t0)); echo "== elapsed $el s"
if [ $el -lt 440 ]; then
  timeout $((575-el)) python3 -m bench.throughput --runs "" --impls default --profile 1558M:16 \
        --train-args="--fp8='fused'" --out $OUT/profile 2>&1 | tail -32 | tee $OUT/profile.txt
fi
echo "== elapsed $(($(date +%s)-t0)) s"
