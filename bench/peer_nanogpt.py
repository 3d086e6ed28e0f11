"""nanoGPT's own model, compiled and trained as its train.py does: the independent reference that
bench/throughput.py's rows are compared with in the same call.

    python -m bench.peer_nanogpt --nanogpt DIR [--runs 124M:8,124M:16,1558M:16] [--steps 30]
        [--warmup 10] [--bias] [--out DIR]

DIR is a checkout of github.com/karpathy/nanoGPT (nothing of it is copied here: its model.py is
imported from DIR at run time). Each run is a fresh process (no recompilation for a second shape)
that builds GPT(GPTConfig(...)) at the preset's size (block 1024, vocab 50304, dropout 0, bias
off as train.py's default, --bias for on), moves it to the GPU in fp32, takes the model's own
configure_optimizers (fused AdamW), torch.compile()s it, and runs train.py's step with one
micro-batch: forward under bf16 autocast, backward, clip_grad_norm_(1.0), step,
zero_grad(set_to_none=True); no host sync inside the timed steps. Tokens are uniform random,
made on the GPU before the loop (train.py reads them from disk each step, which costs it host
time this does not). Reported per run: the median step time over the steps after --warmup
(CUDA events at the step boundaries), tok/s, peak GPU memory allocated and the time from the
process's start to the end of step 1 (compile included). Writes DIR/peer_nanogpt.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from model import GPTConfig  # this repo's, for the presets' sizes (the child imports nanoGPT's)

CHILD = r"""
import json, statistics, sys, time
t_start = time.time()
import torch
args = json.loads(sys.argv[1])
sys.path.insert(0, args["nanogpt"])
from model import GPT, GPTConfig  # nanoGPT's model.py

torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
n_layer, n_head, n_embd = args["shape"]
B, T = args["batch"], 1024
model = GPT(GPTConfig(block_size=T, vocab_size=50304, n_layer=n_layer, n_head=n_head,
                      n_embd=n_embd, dropout=0.0, bias=args["bias"])).to("cuda")
opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
model = torch.compile(model)
g = torch.Generator(device="cuda").manual_seed(0)
tokens = [torch.randint(0, 50257, (B, T + 1), device="cuda", generator=g) for _ in range(4)]
batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]  # as get_batch's
steps = args["steps"]
events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
startup = None
events[0].record()
for step in range(steps):
    x, y = batches[step % len(batches)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    events[step + 1].record()
    if step == 1:
        events[step + 1].synchronize()
        startup = time.time() - t_start
        first_loss = loss.item()
torch.cuda.synchronize()
ms = [events[i].elapsed_time(events[i + 1]) for i in range(args["warmup"], steps)]
print("RESULT " + json.dumps(dict(ms=statistics.median(ms), loss_first=first_loss,
      loss_last=loss.item(), peak_gib=torch.cuda.max_memory_allocated() / 2**30,
      startup_s=startup)))
"""


def run(nanogpt, model, batch, steps, warmup, bias, timeout=900):
    c = GPTConfig.from_preset(model)
    args = dict(nanogpt=os.path.abspath(nanogpt), shape=(c.n_layer, c.n_head, c.n_embd),
                batch=batch, steps=steps, warmup=warmup, bias=bias)  # fmt: skip
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                       text=True, timeout=timeout)  # fmt: skip
    res = dict(model=model, batch=batch, rc=p.returncode, wall_s=round(time.time() - t0, 1))
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res |= json.loads(line[len("RESULT ") :])
            res["tok_per_s"] = batch * 1024 / res["ms"] * 1e3
    if p.returncode:
        res["error"] = (p.stdout + p.stderr).strip()[-600:]
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT")
    p.add_argument("--runs", default="124M:8,124M:16,124M:32,124M:64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--bias", action="store_true", help="GPTConfig(bias=True), as GPT-2")
    p.add_argument("--out", default=os.environ.get("OUT", "out/peer_nanogpt"))
    args = p.parse_args()
    if not os.path.isfile(os.path.join(args.nanogpt, "model.py")):
        sys.exit(f"error: no model.py in {args.nanogpt} (--nanogpt: a nanoGPT checkout)")
    results = []
    print("| model:batch | nanoGPT ms/step | tok/s | peak GiB | start-up s | loss first, last |")
    print("|---|---|---|---|---|---|")
    for spec in args.runs.split(","):
        model, batch, *rest = spec.split(":")
        steps, warmup = (int(rest[0]), int(rest[1])) if rest else (args.steps, args.warmup)
        if not 2 <= warmup < steps:  # step 1 ends the start-up; a median needs a timed step
            sys.exit(f"error: {spec}: need 2 <= warmup < steps, got {warmup} and {steps}")
        r = run(args.nanogpt, model, int(batch), steps, warmup, args.bias)
        results.append(r)
        if r["rc"]:
            print(f"| {spec} | failed: {r['error'][-300:]} |")
            continue
        print(f"| {spec} | {r['ms']:.2f} | {r['tok_per_s']:,.0f} | {r['peak_gib']:.2f} | "
              f"{r['startup_s']:.1f} | {r['loss_first']:.4f}, {r['loss_last']:.4f} |")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "peer_nanogpt.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
