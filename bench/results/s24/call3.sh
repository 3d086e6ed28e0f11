# Twenty-fourth session, call 3: SM clock and power while 124M:64 trains, default against plain
# (nvidia-smi sampled every 200 ms beside bench.throughput), to test whether the 700 W limit
# is what slows the same cuDNN kernels inside our step (results/s24/call2/).
#   run: bash bench/results/s24/call3.sh $OUT
set -u
out=$1; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
plain="--loss_impl='torch' --mlp_impl='torch' --attn_impl='torch' --adamw_impl='torch'"
plain="$plain --low_precision_residual=False --compile_mode='default'"
for impl in default plain; do
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu \
        --format=csv,noheader,nounits -lms 200 > "$out/smi_$impl.csv" &
    smi=$!
    timeout 200 python3 -m bench.throughput --runs 124M:64:150:10 --impls $impl --out /tmp/pw_$impl \
        2>&1 | grep -E '^\| 124M' | sed "s/^/$impl /" | tee -a "$out/tp.txt"
    kill $smi; cp /tmp/pw_$impl/throughput.json "$out/tp_$impl.json" 2>/dev/null
    echo "$impl done at $(( $(date +%s) - start )) s"
done
python3 - "$out" <<'PY'
import statistics, sys
for impl in ("default", "plain"):
    last = []  # the training steps: compile and autotuning draw less
    for line in open(f"{sys.argv[1]}/smi_{impl}.csv"):
        try:
            _, c, p, u = (float(v) if i else v for i, v in enumerate(line.split(", ")))
        except ValueError:
            continue
        if u >= 95 and p >= 400:
            last.append((c, p))
    print(f"{impl}: {len(last)} samples at >= 95 % busy and >= 400 W, SM clock median "
          f"{statistics.median(c for c, _ in last):.0f} MHz, power median "
          f"{statistics.median(p for _, p in last):.0f} W")
PY
