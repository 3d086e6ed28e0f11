# Thirteenth session, call 3: main 399b1fd (.gpu/base) against land13 3ab6aea (the fused loss's
# compiled backward scales as plain products) at 124M:64 and 16, one run each, ABBA order.
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
root=$PWD; start=$(date +%s)
for spec in base:64 next:64 next:16 base:16; do
    side=${spec%%:*}; b=${spec##*:}
    dir=$root; [ $side = base ] && dir=$root/.gpu/base
    [ $(( $(date +%s) - start )) -gt 330 ] && break
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 115 python3 -m bench.throughput \
        --runs 124M:$b:20:8 --impls default --out "$out/ab_${side}_$b" 2>&1 \
        | grep -E '^\| 124M' | sed "s/^/$side /")
    rm -f "$out"/ab_${side}_$b/*.jsonl
done
tar czf "$out/e13_call3_json.tgz" -C "$out" $(cd "$out" && ls -d ab_* 2>/dev/null)
rm -rf "$out"/ab_*
echo "total: $(( $(date +%s) - start )) s"
