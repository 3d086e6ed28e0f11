# Session 21, call 2 (in place of call 1, after four refused starts): the GPU gate on the commit to land,
# then the tied gradients' scatter against --tied_grad_scatter=False at 124M:16, interleaved, in what is left
set -u
out=$1; sha=$2; total=${3:-585}; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpu.txt"
REPEATS=1 REPEATS_LARGE=1 BUDGET=$((total - 145)) GATE_COMMIT=$sha bash bench/gpu_gate.sh "$out/gate" 2>&1 | tail -12
echo "gate done at $(el) s"
left=$(( total - $(el) ))
timeout $left python3 -m bench.throughput --runs 124M:16:30:10 --impls default --repeats 2 \
    --train-args= --train-args=--tied_grad_scatter=False --time-budget $((left - 5)) --out /tmp/tp_ab 2>&1 \
    | grep -E '^\||WARN|Error|error' | tee "$out/ab.txt"
cp /tmp/tp_ab/throughput.json "$out/ab.json" 2>/dev/null
echo "total $(el) s"
