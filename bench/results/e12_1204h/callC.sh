# Call C (twelfth session): the 1558M:16 pair (call B's plain run was cut: cold compile 149 s),
# then the output_code probe with val_tokens big enough for B 16.
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
timeout 450 python3 -m bench.throughput --runs 1558M:16:16:6 --impls default,plain \
    --out "$out/gate_1558M" 2>&1 | grep -E '^\| (model|---|1558M)'
rm -f "$out"/gate_1558M/*.jsonl
echo "pair: $(( $(date +%s) - start )) s"
TORCH_LOGS=output_code timeout 100 python3 train.py --model=gpt2 --n_layer=2 \
    --batch_size=16 --total_batch_size=16384 --max_steps=3 --eval_interval=0 --sample_interval=0 \
    --ckpt_interval=0 --val_tokens=65536 --dataset=data/cache/random --out_dir=/tmp/oc > "$out/output_code.txt" 2>&1
tail -2 "$out/output_code.txt"
grep -o "torch\.ops\.aten\.[a-z_0-9.]*\|extern_kernels\.[a-z_0-9]*\|torch\.ops\.gpt2_fused\.[a-z_0-9.]*" \
    "$out/output_code.txt" | sort | uniq -c | sort -rn | head -30
grep -o "Original ATen: \[[^]]*sum[^]]*\]" "$out/output_code.txt" | sort | uniq -c | head -20
gzip -f "$out/output_code.txt"
echo "total: $(( $(date +%s) - start )) s"
