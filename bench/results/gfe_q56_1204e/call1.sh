# Next session: branch grad_foreach's gate + same-call A/B against main on accumulation runs.
# Before: cd /work/main && rm -rf .gpu/base && mkdir -p .gpu/base && git archive main | tar -x -C .gpu/base
#         git checkout --detach grad_foreach   (then git checkout main after)
# run: GATE=<sha> bash .gpu/gfe_call.sh $OUT   carry [".whl", ".gpu"]   (~9 min)
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
root=$PWD
PYTHONPATH=/tmp/site:$root GATE_COMMIT=$GATE RUNS_LARGE="" RUNS=124M:32:30:10 REPEATS=1 BUDGET=360 \
    bash bench/gpu_gate.sh "$out/gate" > "$out/gate.log" 2>&1
tail -6 "$out/gate.log"; grep -E "^FAILED|^E " "$out/gate/gate_pytest.txt" | cut -c1-300 | head
# accumulation: total batch 65,536 = 8 micro-batches of 8, 4 of 16 (kept grads under graphs)
for r in 0; do
    for side in base branch; do
        dir=$root; [ $side = base ] && dir=$root/.gpu/base
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 -m bench.throughput --runs 124M:8:12:4,124M:16:10:3 \
            --impls default --train-args=--total_batch_size=65536 --out "$out/ab_${side}_$r" 2>&1 |
            grep -E '^\| 124M' | sed "s/^/$side $r /")
    done
done
