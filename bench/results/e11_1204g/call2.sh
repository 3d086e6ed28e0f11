# Eleventh session, call 2 (~8 min), on branch lt_ws (checked out at the root):
#   .gpu/base = main, .gpu/wc = weight_casts (70c4275).
# 1. GPU tests lt_ws touches (+ the fixed weight-casts test), data prep in the background.
# 2. 124M:8 and :16 default, wc vs lt_ws, two runs each, interleaved.
# 3. real-data quality pair main vs weight_casts: train.py configs/wikipedia.py, seed 1337, both at once.
# carry [".whl", ".gpu/base", ".gpu/wc", ".gpu/wiki", ".gpu/call2.sh"]
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
root=$PWD
start=$(date +%s)
W=.gpu/wiki
(PYTHONPATH=/tmp/site:$root python3 -m data.fineweb --from-text $W/train_0*.txt.xz --val-from $W/valid.txt.xz \
    --name wiki --out-dir $root/data/cache/wiki --no-progress > "$out/prep.txt" 2>&1) &
prep=$!
PYTHONPATH=/tmp/site:$root timeout 200 python3 -m pytest -q -m gpu tests/test_mlp.py tests/test_attention.py \
    tests/test_cublaslt.py tests/test_weight_casts.py tests/test_model.py -n 4 -p no:cacheprovider \
    > "$out/pytest_ltws.txt" 2>&1
echo "tests: $(( $(date +%s) - start )) s"; tail -1 "$out/pytest_ltws.txt"
grep -E "^FAILED|^ERROR" "$out/pytest_ltws.txt" | cut -c1-300 | head
wait $prep; tail -2 "$out/prep.txt"; echo "prep done: $(( $(date +%s) - start )) s"
for rep in 1 2; do for side in wc ltws; do
    dir=$root; [ $side = wc ] && dir=$root/.gpu/wc
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 130 python3 -m bench.throughput \
        --runs 124M:8:20:8,124M:16:20:8 --impls default \
        --out "$out/ab_${side}_$rep" 2>&1 | grep -E '^\| 124M' | sed "s/^/$side $rep /")
    rm -f "$out"/ab_${side}_$rep/*.jsonl
done; done
echo "ab done: $(( $(date +%s) - start )) s"
left=$(( 575 - ($(date +%s) - start) ))
for side in base wc; do
    dir=$root/.gpu/$side; mkdir -p $dir/data/cache; ln -sfn $root/data/cache/wiki $dir/data/cache/wiki
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout $left python3 train.py configs/wikipedia.py --batch_size=16 \
        --total_batch_size=16384 --max_steps=2000 --warmup_steps=100 --eval_interval=200 \
        --val_tokens=1048576 --sample_interval=0 --ckpt_interval=0 --seed=1337 --out_dir=out/q \
        > "$out/q_$side.log" 2>&1; echo "$side exit $?") &
done
wait
echo "quality done: $(( $(date +%s) - start )) s"
python3 - "$out" "$root" <<'PY'
import json, sys
out, root = sys.argv[1:]
runs = {}
for side in ("base", "wc"):
    try:
        rows = [json.loads(l) for l in open(f"{root}/.gpu/{side}/out/q/log.jsonl")]
    except OSError:
        rows = []
    runs[side] = rows
    with open(f"{out}/q_{side}.jsonl", "w") as f:  # thinned: first 10 steps, every 20th, evals
        for r in rows:
            if "val_loss" in r or r["step"] < 10 or r["step"] % 20 == 0:
                f.write(json.dumps(r) + "\n")
tr = {s: {r["step"]: r["loss"] for r in rows if "loss" in r} for s, rows in runs.items()}
va = {s: {r["step"]: r["val_loss"] for r in rows if "val_loss" in r} for s, rows in runs.items()}
print("| train step | main | weight_casts | diff |")
for st in list(range(10)) + [100, 500, 1000, 1999]:
    if st in tr["base"] and st in tr["wc"]:
        print(f"| {st} | {tr['base'][st]:.5f} | {tr['wc'][st]:.5f} | {tr['wc'][st]-tr['base'][st]:+.5f} |")
print("| val step | main | weight_casts | diff |")
for st in sorted(va["base"]):
    if st in va["wc"]:
        print(f"| {st} | {va['base'][st]:.4f} | {va['wc'][st]:.4f} | {va['wc'][st]-va['base'][st]:+.4f} |")
PY
echo "total: $(( $(date +%s) - start )) s"
