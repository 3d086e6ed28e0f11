# Call D (twelfth session): 124M:16 and 64 default, main vs gate_next, one run each, time-guarded.
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
root=$PWD; start=$(date +%s)
for b in 16 64; do for side in base next; do
    dir=$root; [ $side = base ] && dir=$root/.gpu/base
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir PYTHONUNBUFFERED=1 timeout 70 python3 -m bench.throughput \
        --runs 124M:$b:20:8 --impls default --out "$out/ab_${side}_$b" 2>&1 \
        | grep -E '^\| 124M' | sed "s/^/$side /")
    rm -f "$out"/ab_${side}_$b/*.jsonl
    [ $(( $(date +%s) - start )) -gt 200 ] && break 2
done; done
echo "total: $(( $(date +%s) - start )) s"
