# Twenty-fourth session, call 1: cuDNN attention on views of qkv against three buffers
# (s23/probe_attn_layout.py); c_proj's residual epilogue against addmm alone (probe_proj.py);
# then training with the residual added outside the c_projs (resid_outside.py's copy, "outside")
# against main, 1558M:16 and 124M:64, interleaved, while time is left.
#   run: bash bench/results/s24/call1.sh $OUT 560
set -u
out=$1; total=${2:-560}; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$out/gpu.txt"
PYTHONPATH=. timeout 60 python3 bench/results/s23/probe_attn_layout.py 2>&1 | tail -6 | tee "$out/attn.txt"
PYTHONPATH=. timeout 60 python3 bench/results/s24/probe_proj.py 2>&1 | tail -8 | tee "$out/proj.txt"
python3 bench/results/s24/resid_outside.py /tmp/vr
ab() {  # run tag tree
    left=$(( total - $(el) )); [ $left -gt 60 ] || return 0
    (cd $3 && timeout $left python3 -m bench.throughput --runs $1 --impls default --out /tmp/ab_$2 \
        2>&1 | grep -E '^\| [0-9]' | sed "s/^/$2 /" | tee -a "$out/ab.txt")
    cp /tmp/ab_$2/throughput.json "$out/ab_$2.json" 2>/dev/null; echo "$2 at $(el) s"
}
ab 1558M:16:20:8 main_1558a .
ab 1558M:16:20:8 out_1558a /tmp/vr
ab 124M:64:20:8 main_64a .
ab 124M:64:20:8 out_64a /tmp/vr
ab 1558M:16:20:8 out_1558b /tmp/vr
ab 1558M:16:20:8 main_1558b .
echo "total $(el) s"
