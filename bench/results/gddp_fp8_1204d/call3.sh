set -u
out=$1; mkdir -p $out; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m data.fineweb --from-text .gpu/wiki/train_0*.txt.xz --val-from .gpu/wiki/valid.txt.xz --name wiki --out-dir data/cache/wiki --no-progress 2>&1 | tail -1
echo "prep $(($(date +%s)-t0)) s"
common="configs/wikipedia.py --batch_size=16 --total_batch_size=16384 --max_steps=2000 --warmup_steps=100 --eval_interval=200 --val_tokens=1048576 --sample_interval=0 --ckpt_interval=0 --seed=1337"
rm -rf out/q2
python3 train.py $common --out_dir=out/q2/base > $out/base.log 2>&1 &
python3 train.py $common --fp8=fused --out_dir=out/q2/fused > $out/fused.log 2>&1 &
E5=1 python3 .gpu/margin_train.py $common --fp8=fused --out_dir=out/q2/fused_e5m1 > $out/fused_e5m1.log 2>&1 &
wait
echo "runs done $(($(date +%s)-t0)) s"
python3 - <<'PY'
import json
def val(n): return {r["step"]: r["val_loss"] for r in map(json.loads, open(f"out/q2/{n}/log.jsonl")) if "val_loss" in r}
b, f, m = val("base"), val("fused"), val("fused_e5m1")
print("| step | bf16 | fused | gap | fused e5m2 2^1 | gap |\n|---|---|---|---|---|---|")
for s in sorted(b):
    print(f"| {s} | {b[s]:.4f} | {f.get(s,float('nan')):.4f} | {f.get(s,float('nan'))-b[s]:+.4f} | {m.get(s,float('nan')):.4f} | {m.get(s,float('nan'))-b[s]:+.4f} |")
PY
tar czf $out/q2_logs.tgz out/q2/*/log.jsonl $out/*.log 2>/dev/null
python3 -m bench.throughput --runs 1558M:16:12:4 --impls fp8_fused,plain --time-budget $((540-($(date +%s)-t0)-100)) --out $out/t1558 2>&1 | grep -E '^\||WARNING'
tar czf $out/t1558.tgz $out/t1558 2>/dev/null; rm -rf $out/t1558
echo "total $(($(date +%s)-t0)) s"
