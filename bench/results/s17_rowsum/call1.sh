# Session 17, call 1: triton_partial_sums A/B at 124M:8/16 (same tree, flag off), issue 55's rows
# (default, plain at 8/16/64), the patched code's GPU tests, the LayerNorm microbenchmark.
# (the copy under bench/results is the script as run: `bash .gpu/call1.sh $OUT` with carry .gpu, tree f02e51d)
set -u
out=$1; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_colsum.py tests/test_train.py \
    -k "row_sum or partial_sums or finishing or persistent_rows or layernorm" 2>&1 | tail -25 | tee "$out/tests.txt"
echo "tests done at $(el) s"
T=out/c1
timeout 200 python3 -m bench.throughput --runs 124M:8:30:10,124M:16:30:10 --impls default,plain \
    --time-budget 190 --out $T/a 2>&1 | grep -E '^\||WARN|Error|error' | tee "$out/tp_a.txt"
echo "a done at $(el) s"
timeout 110 python3 -m bench.throughput --runs 124M:8:30:10,124M:16:30:10 --impls default \
    --train-args=--triton_partial_sums=False --time-budget 100 --out $T/b 2>&1 | grep -E '^\||WARN|Error|error' | tee "$out/tp_b.txt"
echo "b done at $(el) s"
left=$(( 545 - $(el) ))
[ $left -gt 60 ] && timeout $left python3 -m bench.throughput --runs 124M:64:20:8 --impls default,plain \
    --time-budget $((left - 5)) --out $T/c 2>&1 | grep -E '^\||WARN|Error|error' | tee "$out/tp_c.txt"
echo "c done at $(el) s"
left=$(( 585 - $(el) ))
[ $left -gt 20 ] && timeout $left python3 -m bench.bench_layernorm_grad --rows 16384,8192 \
    --only "trainer,trainer + row_sum" --repeats 5 2>&1 | grep -E '^\|' | tee "$out/ln.txt"
for d in a b c; do [ -f $T/$d/throughput.json ] && cp $T/$d/throughput.json "$out/tp_$d.json"; done
echo "total $(el) s"
