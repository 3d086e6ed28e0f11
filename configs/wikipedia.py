# GPT-2 124M on the local English Wikipedia text (about 87M train tokens, 1M val), for machines
# without internet. Data (W = the wikipedia_en folder of the offline text; val = held-out articles):
#   python -m data.fineweb --from-text W/train_0*.txt.xz --val-from W/valid.txt.xz \
#       --name wiki --out-dir data/cache/wiki
# Run:  python train.py configs/wikipedia.py
# 87M tokens is small for 124M parameters: 1000 steps x 262,144 tokens is 3 passes over it.
dataset = "data/cache/wiki"
model = "gpt2"
batch_size = "auto"  # micro-batch per GPU: the largest that fits; grad accumulation makes up
total_batch_size = 262144  # 2**18 tokens per step
max_steps = 1000  # x 262,144 = 262M tokens
learning_rate = 6e-4
final_lr_frac = 0.1
warmup_steps = 100
weight_decay = 0.1
eval_interval = 100
val_tokens = 10485760  # clipped by the loader to the ~1.03M tokens the val shard holds
sample_interval = 250
ckpt_interval = 250
keep_last = 3  # the newest three: a resume falls back past a damaged one
out_dir = "out/wiki"
