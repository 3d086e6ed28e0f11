# GPT-2 774M on FineWeb sample-100BT: llm.c's recipe (150B tokens, 1.5 passes over 100BT).
# Data: python -m data.fineweb --version 100BT
# Run:  torchrun --nnodes=... --nproc_per_node=8 train.py configs/gpt2_774m_fineweb.py (README)
dataset = "data/cache/fineweb100B"
model = "gpt2-large"  # 36 layers, 20 heads, 1280 wide
batch_size = "auto"  # micro-batch per GPU: the largest that fits; grad accumulation makes up
total_batch_size = 524288
max_steps = 286102  # x 524,288 = 150B tokens
learning_rate = 2.5e-4
final_lr_frac = 0.0
warmup_steps = 700
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 500
val_tokens = 10485760
sample_interval = 10000
ckpt_interval = 2000
keep_last = 3  # the newest three: a resume falls back past a damaged one
out_dir = "out/gpt2_774m_fineweb"
