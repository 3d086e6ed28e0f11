# Session 22, call 4 (the command, on the warm H200 after call 3): nanoGPT's model at 1558M:16
mkdir -p $OUT; PYTHONUNBUFFERED=1 timeout 290 python3 -m bench.peer_nanogpt --nanogpt .gpu/nanogpt --runs 1558M:16 --steps 16 --warmup 6 --out $OUT/peer 2>&1 | grep -E "^\||rror" | tee $OUT/peer1558.txt
