# Session 21, call 1: the tied gradients' scatter (ed22851) against --tied_grad_scatter=False in one call:
# a step timeline each way at 124M:16, and training at 124M:8/16 interleaved
set -u
out=$1; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpu.txt"
for a in "" "--tied_grad_scatter=False"; do
    timeout 90 python3 -m bench.step_timeline --run 124M:16 --train-args="$a" --out $out/tl > /dev/null 2> "$out/tl_err${a:+_off}.txt"
    echo "timeline '$a' done at $(el) s"
done
left=$(( 420 - $(el) ))
timeout $left python3 -m bench.throughput --runs 124M:8:30:10,124M:16:30:10 --impls default --repeats 2 \
    --train-args= --train-args=--tied_grad_scatter=False --time-budget $((left - 5)) --out /tmp/tp_ab 2>&1 \
    | grep -E '^\||WARN|Error|error' | tee "$out/ab.txt"
cp /tmp/tp_ab/throughput.json "$out/ab.json" 2>/dev/null
echo "total $(el) s"
