# Twenty-third session, call 3: cuDNN attention on views of qkv or three buffers
# (probe_attn_layout.py), then where 124M:64's step goes (default and plain step timelines, with
# top_kernels), then 3ab6aea's default and ours once more each if time is left.
#   run: bash bench/results/s23/call3.sh $OUT 300   (carry: [".gpu"], the 3ab6aea copy of call 1)
set -u
out=$1; total=${2:-300}; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpu.txt"
PYTHONPATH=. timeout 60 python3 bench/results/s23/probe_attn_layout.py 2>&1 | tail -8 | tee "$out/probe.txt"
plain="--loss_impl='torch' --mlp_impl='torch' --attn_impl='torch' --adamw_impl='torch'"
plain="$plain --low_precision_residual=False --compile_mode='default'"
timeout 110 python3 -m bench.step_timeline --run 124M:64 --steps 12 --out /tmp/tl_d > "$out/default.log" 2>&1
cp /tmp/tl_d/timeline_*.json "$out/default.json"; echo "default timeline at $(el) s"
if [ $(( total - $(el) )) -gt 90 ]; then
    timeout 100 python3 -m bench.step_timeline --run 124M:64 --steps 12 --train-args="$plain" \
        --out /tmp/tl_p > "$out/plain.log" 2>&1
    cp /tmp/tl_p/timeline_*.json "$out/plain.json"; echo "plain timeline at $(el) s"
fi
left=$(( total - $(el) ))
if [ $left -gt 90 ]; then
    (cd .gpu/old3ab && timeout $(( left / 2 )) python3 -m bench.throughput --runs 124M:64:20:8 \
        --impls default --out /tmp/old_3 2>&1 | grep -E '^\| 124M' | sed "s/^/old 3 /" | tee -a "$out/old.txt")
    left=$(( total - $(el) ))
    [ $left -gt 40 ] && timeout $left python3 -m bench.throughput --runs 124M:64:20:8 --impls default \
        --out /tmp/new_3 2>&1 | grep -E '^\| 124M' | sed "s/^/new 3 /" | tee -a "$out/old.txt"
fi
echo "total $(el) s"
