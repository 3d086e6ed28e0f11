python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
echo "== host cost, before (custom ops)"; (cd .gpu/old && python3 -m bench.host_cost --out $OUT/host_old 2>&1 | tail -20)
echo "== host cost, after (HEAD)"; python3 -m bench.host_cost --out $OUT/host_new 2>&1 | tail -20
for r in "124M:8|" "124M:16|" "124M:16|--compile_mode='default'"; do
  run=${r%%|*}; ta=${r#*|}; log=$OUT/tl_${run/:/_}_${#ta}.log
  timeout 120 python3 -m bench.step_timeline --run $run --train-args="$ta" --out $OUT/tl > $log 2>&1
  echo "== timeline $run $ta rc=$?"; python3 - $log <<'PY'
import json,sys
t=open(sys.argv[1]).read(); i=t.rfind('\n{'); 
try:
    d=json.loads(t[i:])
    print({k:(round(v,3) if isinstance(v,float) else v) for k,v in d.items() if k not in ("longest_gaps",)})
    for g in d["longest_gaps"][:8]: print("  ", g)
except Exception as e: print(t[-1500:])
PY
done
timeout 330 python3 -m bench.throughput --runs 124M:8:20:8,124M:16:20:8,124M:64:20:8 --impls default,plain --out $OUT/tp 2>&1 | tail -25
