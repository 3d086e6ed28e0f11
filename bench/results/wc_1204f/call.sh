# Tenth session, call 2: branch weight_casts (AdamW keeps the fast Linears' bf16 casts) against
# main, and every GPU test on the branch. Run from the branch's tree; main's archive in .gpu/base.
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
root=$PWD
start=$(date +%s)
PYTHONPATH=/tmp/site:$root timeout 240 python3 -m pytest -q -m gpu tests/ -n 4 -p no:cacheprovider \
    --durations=5 > "$out/pytest_gpu.txt" 2>&1
echo "tests: $(( $(date +%s) - start )) s"; tail -3 "$out/pytest_gpu.txt"
grep -E "^FAILED|^ERROR" "$out/pytest_gpu.txt" | cut -c1-300 | head
# interleaved: base, casts, base, casts; one micro-batch a step (bench/throughput.py's rows)
for rep in 0 1; do
  for side in base casts; do
    dir=$root; [ $side = base ] && dir=$root/.gpu/base
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 150 python3 -m bench.throughput \
        --runs 124M:8:20:8,124M:16:20:8 --impls default \
        --out "$out/ab_${side}_$rep" 2>&1 | grep -E '^\| 124M' | sed "s/^/$side $rep /")
    rm -f "$out"/ab_${side}_$rep/*.jsonl
  done
done
echo "total: $(( $(date +%s) - start )) s"
