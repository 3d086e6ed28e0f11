# Session 22, call 2 (the command as run on the warm H200 after call 1): the tied scatter's graph probe, then
# bench/results/s21/call2.sh (the GPU gate on 4c819a6, then --tied_grad_scatter on/off at 124M:16)
PYTHONPATH=. timeout 60 python3 bench/results/s21/probe_tied.py > /tmp/probe.txt 2>&1; mkdir -p $OUT; cp /tmp/probe.txt $OUT/
bash bench/results/s21/call2.sh $OUT 4c819a6 540
