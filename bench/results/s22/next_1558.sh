# For a later session (not run yet): where 1558M:16's step goes, default against plain (1.081x on
# the twenty-second session's H200 against issue 55's 1.10x). One call, ~330 s on an H200:
#   run: bash bench/results/s22/next_1558.sh $OUT
# Each timeline compiles afresh (70-115 s) and profiles the last three of 12 steps; the summaries
# (kernel time by kind, idle gaps) come back, the Chrome traces stay on the machine.
set -u
out=$1; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpu.txt"
plain="--loss_impl='torch' --mlp_impl='torch' --attn_impl='torch' --adamw_impl='torch'"
plain="$plain --low_precision_residual=False --compile_mode='default'"
timeout 200 python3 -m bench.step_timeline --run 1558M:16 --steps 12 --out /tmp/tl_d 2>&1 | tail -40 | tee "$out/default.txt"
timeout 200 python3 -m bench.step_timeline --run 1558M:16 --steps 12 --train-args="$plain" --out /tmp/tl_p 2>&1 | tail -40 | tee "$out/plain.txt"
cp /tmp/tl_d/timeline_*.json "$out/default.json"; cp /tmp/tl_p/timeline_*.json "$out/plain.json"
echo "total $(( $(date +%s) - start )) s"
