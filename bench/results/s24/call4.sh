# Twenty-fourth session, call 4 (call 3 never started): cuBLASLt's candidates timed cool and
# heated (probe_heated.py), then call3.sh (SM clock and power beside 124M:64, default and plain).
#   run: bash bench/results/s24/call4.sh $OUT
out=$1; mkdir -p "$out"
PYTHONPATH=. timeout 150 python3 bench/results/s24/probe_heated.py 2>&1 | tail -12 | tee "$out/heated.txt"
bash bench/results/s24/call3.sh "$out"
