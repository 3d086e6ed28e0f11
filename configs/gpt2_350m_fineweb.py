# GPT-2 350M on FineWeb sample-100BT: llm.c's recipe (31.5B tokens).
# Data: python -m data.fineweb --version 100BT
# Run:  torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_350m_fineweb.py
# llm.c reports a FineWeb val loss of about 2.93.
dataset = "data/cache/fineweb100B"
model = "gpt2-medium"  # 24 layers, 16 heads, 1024 wide
batch_size = "auto"  # micro-batch per GPU: the largest that fits; grad accumulation makes up
total_batch_size = 524288
max_steps = 60000  # x 524,288 = 31.5B tokens
learning_rate = 3e-4
final_lr_frac = 0.0
warmup_steps = 700
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 250
val_tokens = 10485760
sample_interval = 5000
ckpt_interval = 2000
keep_last = 3  # the newest three: a resume falls back past a damaged one
out_dir = "out/gpt2_350m_fineweb"
