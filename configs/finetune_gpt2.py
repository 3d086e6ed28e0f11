# Fine-tune OpenAI's GPT-2 124M on your own text, as nanoGPT's finetune_shakespeare does: a small
# constant learning rate, few steps, an evaluation every 5.
# Data:    python -m data.fineweb --from-text MINE.txt --val-from MINE_VAL.txt  (data/cache/local)
# Weights: hf download openai-community/gpt2 config.json model.safetensors  (the HF cache, once)
# Run:     python train.py configs/finetune_gpt2.py
# The model's shape comes from the weights; --block_size=256 (say) cuts its context.
init_from = "gpt2"  # or gpt2-medium ... gpt2-xl, an HF GPT-2 folder, one of our checkpoints
dataset = "data/cache/local"
batch_size = "auto"  # the largest micro-batch (sequences of 1024) that fits the GPU
total_batch_size = 32768  # 32 sequences a step
max_steps = 20  # x 32,768 = 655K tokens
learning_rate = 3e-5
final_lr_frac = 1.0  # constant
warmup_steps = 0
eval_interval = 5
val_tokens = 65536  # or all the val text holds, if less
sample_interval = 10
ckpt_interval = 0  # one checkpoint, at the end
keep_last = 3
out_dir = "out/finetune_gpt2"
