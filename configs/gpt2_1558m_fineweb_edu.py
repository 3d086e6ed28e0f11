# GPT-2 1558M (GPT-2 XL) on FineWeb-Edu sample-100BT: llm.c's recipe (33.5B tokens).
# Data: python -m data.fineweb --edu --version 100BT
# Run:  torchrun --nnodes=... --nproc_per_node=8 train.py configs/gpt2_1558m_fineweb_edu.py (README)
# llm.c's run matched OpenAI GPT-2 1.5B HellaSwag (48.9) at about 25k of these 32k steps.
dataset = "data/cache/edufineweb100B"
model = "gpt2-xl"  # 48 layers, 25 heads, 1600 wide
batch_size = "auto"  # micro-batch per GPU: the largest that fits; grad accumulation makes up
# torch.compile recomputes cheap activations in the backward: less memory for a little time
# (bench/RESULTS.md#compile)
activation_memory_budget = 0.95
total_batch_size = 1048576  # 2**20 tokens per optimizer step
max_steps = 32000  # x 1,048,576 = 33.5B tokens
learning_rate = 6e-4
final_lr_frac = 0.1  # cosine to 6e-5
warmup_steps = 700
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 250
val_tokens = 10485760
sample_interval = 2000
ckpt_interval = 1000
keep_last = 3  # the newest three: a resume falls back past a damaged one
out_dir = "out/gpt2_1558m_fineweb_edu"
