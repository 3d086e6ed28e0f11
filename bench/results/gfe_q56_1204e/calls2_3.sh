# Next session, issue 56: the 2,000-step gap's spread, fused vs torchao tensorwise beside the same bf16 runs.
# One call per seed (~7 min): SEED=1337 bash .gpu/q56_spread.sh $OUT   carry [".whl", ".gpu"] (torchao in .whl)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=.gpu/wiki STEPS=2000 SEEDS="$SEED" PARALLEL=1 PACK=1 \
    CHANGE=";--fp8='fused';--fp8='fused';--fp8='tensorwise';--fp8='tensorwise'" \
    timeout 570 bash bench/quality_pair.sh "$1/q_s$SEED" 2>&1 | tail -24
