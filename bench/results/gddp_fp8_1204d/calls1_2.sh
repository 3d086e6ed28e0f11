# call 1 (main at 5b7c4a5 = graphs_ddp fast-forwarded), pytest-xdist carried in .whl
GATE_COMMIT=5b7c4a5 timeout 580 bash bench/graphs_torchrun_call.sh $OUT/g55
# call 2, the same machine
W=.gpu/wiki STEPS=2000 SEEDS="1337 42" PARALLEL=1 CHANGE="--fp8='fused'" timeout 420 bash bench/quality_pair.sh $OUT/q56
python3 -m bench.throughput --runs 124M:32:30:10 --impls default,plain --time-budget 150 --out $OUT/pair
