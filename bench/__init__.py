"""Benchmarks and measurement scripts, run from the repo root as `python -m bench.<name>`
(`python -m bench.throughput --help`); they import the repo's packages as users do, and what
several share from bench.common, never from one another. Their results go to bench/RESULTS.md.

    throughput          training tok/s of the real train.py, default against plain (the gate's)
    peer_nanogpt        nanoGPT's own model.py trained as its train.py does: the same-call peer
    parity              train.py's data order against an independent sampler: val loss curves
    compile_check       a compiled training step against eager mode, per compile variant
    bench_fused_loss    the fused linear + cross-entropy against torch, torch.compile, Liger, CCE
    bench_loss_options  the cost of the fused loss's options (softcap, z_loss, bias, smoothing)
    bench_exp_gemm      the logits GEMM with exp in its epilogue against cuBLAS + the row pass
    step_timeline       the GPU's busy and idle time over train.py's own steps, by kernel kind
    host_cost           host time per call of each custom op and the pieces inside them
    bench_mlp           GPT-2's MLP: torch (eager, compiled) against the cuBLASLt-epilogue op
    bench_attention     causal attention per SDPA backend; --branch: the attention op against torch
    bench_grad_sums     the bias-gradient column sums against torch
    bench_layernorm_grad  a LayerNorm's fwd+bwd per Inductor mix-order split size
    bench_gemv          the batch-1 decoding GEMV with its weights from HBM
    bench_adamw         the optimizer step against its memory floor
    bench_muon          Muon's optimizer step and Newton-Schulz against AdamW and the plain loop
    bench_fp8           FP8 variants of the training fwd+bwd against bf16
    bench_fp8_mlp       a half block (MLP or attention) fwd+bwd: bf16, torchao FP8, fused casts
    fp8_stress          delayed FP8 scales under stress: 20 steps at lr 1e-3, per-step gaps to bf16
    bench_sample        generation speed of the decode modes
    bench_data          data preparation and loader throughput
    shard_memory        per-rank memory of --shard's modes at W ranks
    memory_fit          each recipe's auto micro-batch and tok/s under 12-80 GB caps
    ddp_compare         compares the logs of bench/ddp_scaling.sh
    plot_loss           train and val loss of train.py's log(s) as a PNG
    common              (no command) shapes, inputs, loss methods and timers the others share

The shell scripts run these on a GPU host, `bash bench/<script>.sh`:

    gpu_gate.sh         every GPU test, then default against plain at 124M:32 and 1558M:16
    quality_pair.sh     2,000-step Wikipedia runs of the default beside a change, same seed and data
    ddp_scaling.sh      train.py on one GPU against torchrun on several, then a kill and a resume
    shard_overhead.sh   --shard's modes against DDP on one GPU under torchrun
"""
