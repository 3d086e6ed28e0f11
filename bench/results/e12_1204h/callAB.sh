# Twelfth session: land weight_casts + compile_cache (branch gate_next) after a clean gate on a
# FRESH machine (the eleventh session's gate on 70c4275 failed 3 tests on a cache another tree
# left: RESULTS#compile-cache). Two calls, the gate split as in the eighth session:
# Setup (from /work/main):
#   rm -rf .gpu/base && mkdir -p .gpu/base && git archive main | tar -x -C .gpu/base
#   rm -rf .gpu/base/tests .gpu/base/data/embedded .gpu/base/bench/results
#   git checkout --detach gate_next
# Call A: PART=A GATE=$(git rev-parse --short HEAD) bash .gpu/next_call.sh $OUT   carry [".whl"]
#   pytest -m gpu tests/ (fresh machine: no stale cache), then 124M:32 default vs plain.
# Call B: PART=B bash .gpu/next_call.sh $OUT   carry [".whl", ".gpu/base", ".gpu/next_call.sh"]
#   1558M:16 default vs plain (the gate's second half), a 2-layer output_code probe (which
#   backward op launches ATen's reduce_kernel: 2 at each LayerNorm boundary, each after a
#   24-byte memset, RESULTS#host-cost), then 124M:8/16/64 default, main vs gate_next (one run
#   each, interleaved, as many as fit).
# Then: git checkout main; git merge --ff-only gate_next; RESULTS #gpu-gate (new table), #weight-casts,
# #compile-cache; LOG; rm -rf .gpu/base.
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
root=$PWD
start=$(date +%s)
if [ "${PART:-A}" = A ]; then
    RUNS_LARGE="" REPEATS=1 BUDGET=570 GATE_COMMIT=${GATE:-?} bash bench/gpu_gate.sh "$out" 2>&1 | tail -14
    exit
fi
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cublaslt.py 2>&1 | tail -3
timeout 330 python3 -m bench.throughput --runs 1558M:16:16:6 --impls default,plain \
    --out "$out/gate_1558M" 2>&1 | grep -E '^\| (model|---|1558M)'
TORCH_LOGS=output_code timeout 120 python3 train.py --model=gpt2 --n_layer=2 \
    --batch_size=16 --total_batch_size=16384 --max_steps=3 --eval_interval=0 --sample_interval=0 \
    --ckpt_interval=0 --dataset=data/cache/random --out_dir=/tmp/oc > "$out/output_code.txt" 2>&1
grep -o "torch\.ops\.aten\.[a-z_0-9.]*\|extern_kernels\.[a-z_0-9]*\|torch\.ops\.gpt2_fused\.[a-z_0-9.]*" \
    "$out/output_code.txt" | sort | uniq -c | sort -rn | head -30
grep -o "Original ATen: \[[^]]*sum[^]]*\]" "$out/output_code.txt" | sort | uniq -c | head -20
gzip -f "$out/output_code.txt"
for b in 8 16 64; do for side in base next; do
    dir=$root; [ $side = base ] && dir=$root/.gpu/base
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 100 python3 -m bench.throughput \
        --runs 124M:$b:20:8 --impls default --out "$out/ab_${side}_$b" 2>&1 \
        | grep -E '^\| 124M' | sed "s/^/$side /")
    rm -f "$out"/ab_${side}_$b/*.jsonl
    [ $(( $(date +%s) - start )) -gt 500 ] && break 2
done; done
echo "ab done: $(( $(date +%s) - start )) s"
echo "total: $(( $(date +%s) - start )) s"
