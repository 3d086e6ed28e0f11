python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
t0=$(date +%s); export PYTHONUNBUFFERED=1; unset TRITON_PTXAS_PATH
for m in "1 1" "1 4" "2 4"; do
  set -- $m; TRITON_CACHE_DIR=/tmp/tc_$1_$2 timeout 250 python3 .gpu/probe_margin.py $1 $2 > $OUT/margin_$1_$2.log 2>&1 &
done
python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=5 -n 4 > $OUT/gate_pytest.txt 2>&1
grep -E "^FAILED|^ERROR|passed|failed" $OUT/gate_pytest.txt | cut -c1-250 | tail -8
python3 -m pytest -q -p no:cacheprovider -rf --tb=line -n 4 tests/test_fp8_scale.py tests/test_ln_fp8.py \
    tests/test_act_fp8.py tests/test_mlp_fp8.py tests/test_attn_fp8.py > $OUT/fp8_pytest.txt 2>&1
grep -E "^E |^FAILED|passed|failed" $OUT/fp8_pytest.txt | cut -c1-250 | tail -6
echo "== elapsed $(($(date +%s)-t0)) s"
wait
grep -h RESULT $OUT/margin_*.log; for f in $OUT/margin_*.log; do grep -q RESULT $f || tail -3 $f; done
echo "== elapsed $(($(date +%s)-t0)) s"
