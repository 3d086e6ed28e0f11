# GPT-2 124M on FineWeb sample-10BT: llm.c's reproduction recipe.
# Data: python -m data.fineweb  (writes the shards read below)
# Run:  torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb.py
# llm.c reaches a FineWeb val loss of about 3.28 and HellaSwag ~29.9 with this recipe.
dataset = "data/cache/fineweb10B"
model = "gpt2"  # 12 layers, 12 heads, 768 wide, block 1024
batch_size = "auto"  # micro-batch per GPU: the largest that fits; grad accumulation makes up
total_batch_size = 524288  # 2**19 tokens per optimizer step
max_steps = 18865  # x 524,288 = 9.9B tokens, one pass over sample-10BT
learning_rate = 6e-4
final_lr_frac = 0.0  # cosine to 0
warmup_steps = 700
weight_decay = 0.1
grad_clip = 1.0
eval_interval = 250
val_tokens = 10485760  # the llm.c / modded-nanogpt validation budget
sample_interval = 2000
ckpt_interval = 1000
keep_last = 3  # the newest three: a resume falls back past a damaged one
out_dir = "out/gpt2_124m_fineweb"
