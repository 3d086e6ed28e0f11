python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
t0=$(date +%s)
unset TRITON_PTXAS_PATH
echo "== FP8 kernel + fused GPU tests, bundled ptxas"
python3 -m pytest -q -p no:cacheprovider -rf --tb=line -n 4 tests/test_fp8_scale.py tests/test_ln_fp8.py \
    tests/test_act_fp8.py tests/test_mlp_fp8.py tests/test_attn_fp8.py > $OUT/pytest.txt 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=line tests/test_fp8.py -k "fused or check" >> $OUT/pytest.txt 2>&1
grep -E "^/|^E |^FAILED|passed|failed" $OUT/pytest.txt | cut -c1-300 | head -30
echo "== elapsed $(($(date +%s)-t0)) s"
W=.gpu/wiki STEPS=2000 SEEDS="1337 42" PARALLEL=1 CHANGE="--fp8='fused'" timeout $((590-$(date +%s)+t0)) bash bench/quality_pair.sh $OUT/quality 2>&1 | tail -40
grep -h "fp8\|note" $OUT/quality/change_s1337.log | head -5
echo "== elapsed $(($(date +%s)-t0)) s"
