# Eleventh session, call 1 (~8 min): is cuBLAS's memset before each workspace GEMM worth removing?
# Setup (from /work/main):
#   rm -rf .gpu/base .gpu/wc .gpu/probe && mkdir -p .gpu/base .gpu/wc .gpu/probe
#   git archive main | tar -x -C .gpu/base; git archive weight_casts | tar -x -C .gpu/wc
#   git archive memset_probe | tar -x -C .gpu/probe; git checkout --detach lt_noworkspace
# run: bash .gpu/next_call.sh $OUT
#   carry [".whl", ".gpu/base", ".gpu/wc", ".gpu/probe", ".gpu/next_call.sh"]
# Then: git checkout main; rm -rf .gpu/base .gpu/wc .gpu/probe (tests/test_docs.py scans them).
# 1. bench_graph_gemms (memset_probe): one layer's GEMMs in a graph, today / all Lt / Lt without
#    a workspace: us a layer and memsets a replay.
# 2. the GPU tests lt_noworkspace touches (its ops against their references, mm_lt, kept casts).
# 3. 124M:8 and :16 default, one run each: main, weight_casts, lt_noworkspace (on weight_casts).
# If lt_noworkspace wins: the gate on it (bench/gpu_gate.sh) in call 2, then merge both.
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
root=$PWD
start=$(date +%s)
(cd .gpu/probe && PYTHONPATH=/tmp/site:$root/.gpu/probe timeout 120 python3 -m bench.bench_graph_gemms \
    2>&1 | tee "$out/graph_gemms.txt" | grep -E '^\|')
PYTHONPATH=/tmp/site:$root timeout 180 python3 -m pytest -q -m gpu tests/test_mlp.py tests/test_attention.py \
    tests/test_cublaslt.py tests/test_weight_casts.py tests/test_model.py -n 4 -p no:cacheprovider \
    > "$out/pytest_ltnw.txt" 2>&1
echo "tests: $(( $(date +%s) - start )) s"; tail -1 "$out/pytest_ltnw.txt"
grep -E "^FAILED|^ERROR" "$out/pytest_ltnw.txt" | cut -c1-300 | head
for side in base wc ltnw; do
    dir=$root; [ $side = base ] && dir=$root/.gpu/base; [ $side = wc ] && dir=$root/.gpu/wc
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 130 python3 -m bench.throughput \
        --runs 124M:8:20:8,124M:16:20:8 --impls default \
        --out "$out/ab_$side" 2>&1 | grep -E '^\| 124M' | sed "s/^/$side /")
    rm -f "$out"/ab_$side/*.jsonl
done
echo "total: $(( $(date +%s) - start )) s"
