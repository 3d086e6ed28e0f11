# Session 22, call 3: the tied scatter's GPU test (tolerance fixed), then --tied_grad_scatter on/off
# at 124M:8 and 16, interleaved, two runs each, in what is left
set -u
out=$1; total=${2:-500}; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu tests/test_tied_grad.py -p no:cacheprovider 2>&1 | tail -3 | tee "$out/pytest.txt"
left=$(( total - $(el) ))
timeout $left python3 -m bench.throughput --runs 124M:8:30:10,124M:16:30:10 --impls default --repeats 2 \
    --train-args= --train-args=--tied_grad_scatter=False --time-budget $((left - 5)) --out /tmp/tp_ab 2>&1 \
    | grep -E '^\||WARN|Error|error' | tee "$out/ab.txt"
cp /tmp/tp_ab/throughput.json "$out/ab.json" 2>/dev/null
echo "total $(el) s"
