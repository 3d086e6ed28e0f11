# ruff: noqa
# test_gpu_fp8_training_follows_bf16_over_20_steps[fused] with the e4m3/e5m2 margins as given
import sys, json, tempfile, torch, triton.language as tl
from gpt2_fused.kernels import fp8_scale

e4, e5 = int(sys.argv[1]), int(sys.argv[2])
fp8_scale.MARGIN[torch.float8_e4m3fn], fp8_scale.MARGIN[torch.float8_e5m2] = e4, e5
fp8_scale.HEADROOM_E4M3, fp8_scale.HEADROOM_E5M2 = tl.constexpr(2.0**e4), tl.constexpr(2.0**e5)
import train

sys.path.insert(0, "tests")
from conftest import read_log

args = [
    "--n_layer=4",
    "--n_head=12",
    "--n_embd=768",
    "--block_size=256",
    "--batch_size=8",
    "--total_batch_size=2048",
    "--max_steps=20",
    "--warmup_steps=5",
    "--learning_rate=1e-3",
    "--eval_interval=0",
    "--sample_interval=0",
    "--device=cuda",
    "--dtype=auto",
]
d = tempfile.mkdtemp()
for seed in (1337, 7):
    train.main(args + [f"--out_dir={d}/bf16{seed}", "--fp8=off", f"--seed={seed}"])
    train.main(args + [f"--out_dir={d}/fp8{seed}", "--fp8=fused", f"--seed={seed}"])
    ref, _ = read_log(f"{d}/bf16{seed}")
    got, _ = read_log(f"{d}/fp8{seed}")
    gaps = [round(abs(got[s] - ref[s]), 4) for s in sorted(ref)]
    print(
        f"RESULT margins e4m3 {e4} e5m2 {e5} seed {seed}: max gap {max(gaps):.4f} at step {gaps.index(max(gaps))}; gaps {gaps}",
        flush=True,
    )
