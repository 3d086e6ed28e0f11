"""What the three commands (train.py, sample.py, eval_hellaswag.py) are built from; nothing here
runs on import.

    config.py         TrainConfig (it nests model.GPTConfig), its parser and checks
    checkpoint.py     checkpoint files: atomic writes, loading, falling back past damaged ones
    distributed.py    processes under torchrun: set-up, rank-0 printing, teardown
    sharding.py       --shard: DDP, ZeRO-1 or FSDP2, and full checkpoints from each
    optim.py          AdamW (groups, the clipped step, state loading) and the LR schedule
    compile_guard.py  torch.compile's settings, and the compiled-vs-eager loss check
    runlog.py         step stats read one step late, log.jsonl / W&B, the stop on signals
    plot.py           the loss curve (out_dir/loss.png) from log.jsonl
    device.py         device and dtype choice, peak FLOP/s
    errors.py         one-line errors for the command lines
    generate.py       sampling with a static KV cache (model.generate, sample.py)
    model_io.py       models from checkpoints and HF GPT-2 directories, and back
"""
