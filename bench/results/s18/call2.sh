# Session 18, call 2: cuBLAS/cuBLASLt without workspace (no 4-byte memset before each nvjet GEMM?),
# interleaved a/c at 124M:8/16; then nanoGPT's model (bench/peer_nanogpt.py) at 124M:8/16
set -u
out=$1; mkdir -p "$out"; export PYTHONUNBUFFERED=1; start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
rm -rf /tmp/treec && mkdir /tmp/treec && cp -r bench data configs fused_loss gpt2_fused tests train.py model.py sample.py /tmp/treec/
sed -i 's/^WORKSPACE = 32 \* 2\*\*20/WORKSPACE = 0/' /tmp/treec/gpt2_fused/kernels/cublaslt.py
grep -n "^WORKSPACE" /tmp/treec/gpt2_fused/kernels/cublaslt.py | tee -a "$out/gpu.txt"
here=$PWD
tp() {  # label, dir, env...
  local label=$1 dir=$2; shift 2
  (cd $dir && env "$@" timeout 110 python3 -m bench.throughput --runs 124M:8:30:10,124M:16:30:10 --impls default \
    --time-budget 105 --out /tmp/tp_$label 2>&1 | grep -E '^\| 124M|WARN|Error|error' | sed "s/^/$label /" | tee -a "$out/tp.txt")
  cp /tmp/tp_$label/throughput.json "$out/tp_$label.json" 2>/dev/null
  echo "$label done at $(el) s"
}
tp a1 $here X=1
tp c1 /tmp/treec CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0
tp a2 $here X=1
tp c2 /tmp/treec CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0
left=$(( 585 - $(el) ))
[ $left -gt 60 ] && timeout $left python3 -m bench.peer_nanogpt --nanogpt .gpu/nanogpt --runs 124M:8,124M:16 \
    --out $out/peer 2>&1 | grep -E "^\||rror" | tee "$out/peer.txt"
echo "total $(el) s"
