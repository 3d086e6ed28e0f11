# Twenty-third session, call 1: the tied scatter's GPU test on 67750fc (its predicate was
# reworked after the last GPU run), then results/s22/next_b64.sh (124M:64 against 3ab6aea and
# with each setting since off).
#   rm -rf .gpu/old3ab && mkdir -p .gpu/old3ab && git archive 3ab6aea | tar -x -C .gpu/old3ab
#   run: bash bench/results/s23/call1.sh $OUT   (carry: [".gpu"])
set -u
out=$1; mkdir -p "$out"; export PYTHONUNBUFFERED=1
timeout 80 python3 -m pytest -q -m gpu tests/test_tied_grad.py 2>&1 | tail -5 | tee "$out/pytest_tied.txt"
bash bench/results/s22/next_b64.sh "$out" 505
