# GPT-2 124M on FineWeb sample-10BT with Muon for the blocks' matrices
# (gpt2_fused/training/muon.py): llm.c's recipe (configs/gpt2_124m_fineweb.py) in fewer tokens.
# PROVISIONAL until measured: the token cut assumes Muon's target of reaching AdamW's loss in
# 1.33x fewer tokens on the 2,000-step Wikipedia pair (bench/quality_pair.sh), and muon_lr is
# nanochat's default, not yet swept here.
#   18,865 AdamW steps / 1.33 = 14,184 steps x 524,288 tokens = 7.44B tokens (AdamW: 9.89B)
# Data: python -m data.fineweb
# Run:  torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb_muon.py
dataset = "data/cache/fineweb10B"
model = "gpt2"  # 12 layers, 12 heads, 768 wide, block 1024
batch_size = "auto"  # the largest micro-batch that fits the GPU (gpt2_fused/training/memory.py)
total_batch_size = 524288  # 2**19 tokens per optimizer step
max_steps = 14184  # 18,865 / 1.33 (above)
optimizer = "muon"
muon_lr = 0.02  # the blocks' matrices
muon_momentum = 0.95
muon_weight_decay = 0.0
learning_rate = 6e-4  # AdamW: wte (= the head), wpe, LayerNorm gains, biases
final_lr_frac = 0.0  # cosine to 0, for both
warmup_steps = 700
weight_decay = 0.1  # AdamW's, on wte and wpe
grad_clip = 1.0
eval_interval = 250
val_tokens = 10485760  # the llm.c / modded-nanogpt validation budget
sample_interval = 2000
ckpt_interval = 1000
keep_last = 3  # the newest three: a resume falls back past a damaged one
out_dir = "out/gpt2_124m_fineweb_muon"
