# Session 22, call 1: the tied scatter's graph probe (torch 2.11's CUDA backward), then nanoGPT's model
# (bench/peer_nanogpt.py, bias off) and our default at 124M:8/16/32/64 in one call (issue 55's absolute rows)
# (the probe failed here on "No module named gpt2_fused": it needs PYTHONPATH=.; call 2 ran it so)
set -u
out=$1; total=${2:-560}; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpu.txt"
timeout 100 python3 bench/results/s21/probe_tied.py > "$out/probe.txt" 2>&1
grep -E "^---|put|add|Error" "$out/probe.txt" | cut -c1-300 | head -30
echo "probe done at $(el) s"
timeout 250 python3 -m bench.peer_nanogpt --nanogpt .gpu/nanogpt --runs 124M:8,124M:16,124M:32,124M:64 \
    --out $out/peer 2>&1 | grep -E "^\||rror" | tee "$out/peer.txt"
echo "peer done at $(el) s"
left=$(( total - $(el) ))
timeout $left python3 -m bench.throughput --runs 124M:8:30:10,124M:16:30:10,124M:32:30:10,124M:64:20:8 --impls default \
    --time-budget $((left - 5)) --out /tmp/tp_d 2>&1 | grep -E '^\||WARN|Error|error' | tee "$out/tp_default.txt"
cp /tmp/tp_d/throughput.json "$out/tp_default.json" 2>/dev/null
echo "total $(el) s"
