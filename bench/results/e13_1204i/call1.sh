# Thirteenth session, call 1 of 3: branch next2 (02977fa = main 399b1fd + loss_scale_fused +
# ln_split + inductor_pdl) against main, 124M default, one micro-batch a step, B 16 then B 8.
#   loss_scale_fused: the compiled backward scales the fused loss's saved dx, dw as plain products
#     (no copy of the 154 MB dw, no in-place op): expect ~0.15 ms a micro-batch (+0.5 % B 16, +1 % B 8)
#   ln_split: --layernorm_grad_rows (0 Inductor's = 16 rows here; 64; -1 unfused): the eager
#     torch.sum after each LayerNorm backward (RESULTS#layernorm-backwards-column-sums)
#   --inductor_pdl=True: Inductor's kernels with programmatic dependent launch. Before adopting
#     it, read Inductor's wait placement (codegen/triton.py _handle_pdl_before_access: a kernel
#     waits only when it reads what the scheduler's previous node wrote) and run the GPU tests
#     and a real-data pair with it on.
# Setup (from /work/main):
#   rm -rf .gpu/base && mkdir -p .gpu/base && git archive main | tar -x -C .gpu/base
#   rm -rf .gpu/base/tests .gpu/base/data/embedded .gpu/base/bench/results
#   git checkout --detach next2
# Run: bash .gpu/e13_call1.sh $OUT   carry [".whl", ".gpu/base", ".gpu/e13_call1.sh"]  (~520 s)
# Then: next2's default vs main gives loss_scale_fused; the variants give the best
#   layernorm_grad_rows (make it the default only if it wins at both batches by > 0.5 %).
# Call 2: the gate on the commit to land (fresh machine): PART=A of this session's callAB.sh
#   (bench/results/e12_1204h/callAB.sh): pytest -m gpu tests/ + 124M:32 pair.
# Call 3: 1558M:16 pair (timeout 450; cold compile ~150 s each; if layernorm_grad_rows moved,
#   its variant too: 97 LayerNorms x 2 eager sums of (1024, 1600) a step) + 124M:64 main vs branch
#   (timeout 110 a run, not 70: a cold B 16-64 run needs ~60-80 s) + if time is left
#   `python -m bench.throughput --runs 124M:64:12:4 --impls default --profile 124M:64`: the top
#   kernels at B 64, where the default is 3 % short of issue 55's 629K and gains nothing over B 32.
set -u
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
root=$PWD
start=$(date +%s)
for b in 16 8; do
    left=$(( 545 - ($(date +%s) - start) ))
    [ $left -lt 120 ] && break
    (cd .gpu/base && PYTHONPATH=/tmp/site:$root/.gpu/base timeout 110 python3 -m bench.throughput \
        --runs 124M:$b:20:8 --impls default --out "$out/main_$b" 2>&1 | grep -E '^\| 124M' | sed 's/^/main  /')
    left=$(( 545 - ($(date +%s) - start) ))
    PYTHONPATH=/tmp/site:$root timeout $left python3 -m bench.throughput --runs 124M:$b:20:8 \
        --impls default --train-args= --train-args=--layernorm_grad_rows=64 \
        --train-args=--layernorm_grad_rows=-1 --train-args=--inductor_pdl=True \
        --time-budget $(( left - 10 )) --out "$out/next2_$b" 2>&1 | grep -E '^\| 124M|WARNING' | sed 's/^/next2 /'
    echo "B $b done: $(( $(date +%s) - start )) s"
done
rm -f "$out"/*/*.jsonl
tar czf "$out/e13_call1_json.tgz" -C "$out" $(cd "$out" && ls -d main_* next2_* 2>/dev/null)
rm -rf "$out"/main_* "$out"/next2_*
echo "total: $(( $(date +%s) - start )) s"
