python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
t0=$(date +%s); export PYTHONUNBUFFERED=1
unset TRITON_PTXAS_PATH
echo "== gate tests (bundled ptxas)"
python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=8 -n 4 > $OUT/gate_pytest.txt 2>&1
grep -E "^FAILED|^ERROR|passed|failed" $OUT/gate_pytest.txt | cut -c1-250 | tail -15
echo "== FP8 kernel tests on the GPU"
python3 -m pytest -q -p no:cacheprovider -rf --tb=line -n 4 tests/test_fp8_scale.py tests/test_ln_fp8.py \
    tests/test_act_fp8.py tests/test_mlp_fp8.py tests/test_attn_fp8.py > $OUT/fp8_pytest.txt 2>&1
grep -E "^/|^E |^FAILED|passed|failed" $OUT/fp8_pytest.txt | cut -c1-250 | tail -12
echo "== elapsed $(($(date +%s)-t0)) s"
W=.gpu/wiki
python3 -m data.fineweb --from-text $W/train_0*.txt.xz --val-from $W/valid.txt.xz --name wiki --out-dir data/cache/wiki --no-progress 2>&1 | tail -1
mkdir -p $OUT/quality
for seed in 1337 42; do
  timeout 260 python3 train.py configs/wikipedia.py --batch_size=16 --total_batch_size=16384 \
    --max_steps=2000 --warmup_steps=100 --eval_interval=200 --val_tokens=1048576 \
    --sample_interval=0 --ckpt_interval=0 --out_dir=out/quality/change_s$seed --seed=$seed --fp8=fused \
    > $OUT/quality/change_s$seed.log 2>&1 &
done
wait
for seed in 1337 42; do cp out/quality/change_s$seed/log.jsonl $OUT/quality/change_s$seed.jsonl; tail -2 $OUT/quality/change_s$seed.log; done
grep -h "val loss" $OUT/quality/change_s1337.log | tail -3
el=$(($(date +%s)-t0)); echo "== elapsed $el s"
python3 -m bench.throughput --runs 124M:32:30:10 --impls default,plain,fp8_fused --time-budget $((585-el)) \
    --out $OUT/tp124 2>&1 | grep -E '^\||WARNING|rror' | tee $OUT/tp124.txt
echo "== elapsed $(($(date +%s)-t0)) s"
