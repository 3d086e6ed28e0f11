# For a later session (not run yet): is 124M:64 slower than on 3ab6aea (632K on the thirteenth
# session's H200 against 612K on the twenty-second's), and if so, which setting since? One call:
#   rm -rf .gpu/old3ab && mkdir -p .gpu/old3ab && git archive 3ab6aea | tar -x -C .gpu/old3ab
#   run: bash bench/results/s22/next_b64.sh $OUT   (carry: [".gpu"])
# 3ab6aea's default and ours alternate; then ours with one setting of 1fe3cad / f02e51d / 4c819a6
# off at a time, and plain, each against the default in the same bench.throughput call.
set -u
out=$1; total=${2:-560}; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpu.txt"
old() {  # 3ab6aea's tree, its own bench.throughput, one run
    (cd .gpu/old3ab && timeout 120 python3 -m bench.throughput --runs 124M:64:20:8 --impls default \
        --out /tmp/old_$1 2>&1 | grep -E '^\| 124M' | sed "s/^/old $1 /" | tee -a "$out/old.txt")
}
old 1
timeout 360 python3 -m bench.throughput --runs 124M:64:20:8 --impls default --repeats 2 \
    --train-args= --train-args=--triton_partial_sums=False --train-args=--layernorm_partial_rows=0 \
    --train-args=--tied_grad_scatter=False --time-budget 350 --out /tmp/tp_flags 2>&1 \
    | grep -E '^\||WARN|Error|error' | tee "$out/flags.txt"
cp /tmp/tp_flags/throughput.json "$out/flags.json" 2>/dev/null
echo "flags done at $(el) s"
old 2
left=$(( total - $(el) ))
[ $left -gt 70 ] && timeout $left python3 -m bench.throughput --runs 124M:64:20:8 --impls default,plain \
    --time-budget $((left - 5)) --out /tmp/tp_plain 2>&1 | grep -E '^\||WARN|Error|error' | tee "$out/plain.txt"
echo "total $(el) s"
