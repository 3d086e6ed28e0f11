# A small GPT on TinyStories (~470M tokens): fluent children's stories within an hour on one GPU.
# Data: python -m data.tinystories
# Run:  python train.py configs/tinystories.py
dataset = "data/cache/tinystories"
n_layer = 8
n_head = 8
n_embd = 512
block_size = 512
batch_size = "auto"  # micro-batch per GPU: the largest that fits; grad accumulation makes up
total_batch_size = 131072  # 2**17 tokens per step
max_steps = 5000  # x 131,072 = 655M tokens, about 1.4 passes
learning_rate = 1e-3
final_lr_frac = 0.1
warmup_steps = 200
weight_decay = 0.1
eval_interval = 250
val_tokens = 1048576
sample_interval = 500
ckpt_interval = 1000
keep_last = 3  # the newest three: a resume falls back past a damaged one
out_dir = "out/tinystories"
