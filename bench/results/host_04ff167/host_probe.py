"""Host time per training fwd+bwd at 124M:B (compiled), default vs plain: how long the host takes
to enqueue a step when the GPU is idle, the GPU time of the step, and the top CPU ops."""
import json, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
from core.compile_guard import compiler_settings
from core.config import load_config
from model import GPT, GPTConfig

PLAIN = dict(loss_impl="torch", mlp_impl="torch", attn_impl="torch", low_precision_residual=False)
name, B = sys.argv[1], int(sys.argv[2])
torch.backends.cuda.matmul.allow_tf32 = True
cfg = load_config(["--model='gpt2'"])
mcfg = GPTConfig.from_preset("gpt2", **(PLAIN if name == "plain" else {}))
with torch.device("cuda"):
    model = GPT(mcfg)
idx = torch.randint(0, 50257, (B, 1024), device="cuda")
tgt = torch.randint(0, 50257, (B, 1024), device="cuda")
params = list(model.parameters())
with compiler_settings(cfg):
    compiled = torch.compile(model)
    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = compiled(idx, tgt)
        loss.backward()
        for p in params:
            p.grad = None
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter(); e0.record()
        step()
        e1.record(); t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(1000 * (t1 - t0)); gpu.append(e0.elapsed_time(e1))
    # steady state, back to back
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize(); back = 100 * (time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kern = sum(e.self_device_time_total for e in prof.key_averages()) / 3000
    rows = sorted(((e.self_cpu_time_total / 3000, e.count // 3, e.key[:90]) for e in prof.key_averages()), reverse=True)[:30]
med = lambda v: sorted(v)[len(v) // 2]
print(f"RESULT {name} B{B}: host enqueue {med(host):.2f} ms, gpu (enqueue->done, idle start) {med(gpu):.2f} ms, back-to-back {back:.2f} ms/step, kernels {kern:.2f} ms/step")
for ms, n, k in rows:
    print(f"  {ms:7.3f} ms x{n:<5d} {k}")
