"""Muon's optimizer step against AdamW's, and its Newton-Schulz compiled against the plain loop, on
the parameters of a GPT-2 preset (fp32 weights and grads, as train.py holds them).

    python -m bench.bench_muon [--preset 124M] [--reps 20]
    python -m bench.bench_muon --preset 124M --layers 1     # CPU: the check only, no timings

Times (CUDA events, ms per call, after one warm-up call that compiles and makes the state):
- adamw: optim.clipped_step with train.py's AdamW (MultiTensorAdamW on CUDA: the grad norm and
  the update, one Triton launch each over all parameters);
- muon: optim.clipped_step with train.py's Muon (gpt2_fused/training/muon.py: the blocks'
  matrices through momentum, Newton-Schulz and the update; torch's fused AdamW on the rest);
- ns compiled: muon.orthogonalize on each shape's stack of matrices in bf16, what the Muon step
  runs, alone;
- ns loop: muon.orthogonalize_reference on one matrix at a time, eager, in bf16.
The Newton-Schulz rows give TFLOP/s: a step of the iteration on an m x n matrix (m <= n) costs
2 m^2 n + m^3 multiply-adds, 2 FLOPs each (X X^T, A A, then (b A + c A^2) X); five steps a matrix.
bench/throughput.py --impls default,muon times the whole training step (bench/RESULTS.md#muon).

Checks first that the compiled stack and the loop agree (relative error < 3 % of the norm, the
bf16 GEMMs' order apart; tests/test_muon.py holds the same bound).
"""

import argparse
import statistics
import sys

import torch

from gpt2_fused.training import muon, optim
from gpt2_fused.training.config import TrainConfig
from model import GPT, GPTConfig

PRESETS = ("124M", "350M", "774M", "1558M")


def ns_flops(shape):
    """FLOPs of muon.NS_STEPS Newton-Schulz steps on each matrix of a (..., m, n) stack."""
    *batch, m, n = shape
    m, n = min(m, n), max(m, n)
    return muon.NS_STEPS * 2 * (2 * m * m * n + m**3) * (batch[0] if batch else 1)


def model_with_grads(preset, layers, device, seed=0):
    """A GPT of the preset (layers: fewer blocks) on device, every parameter with a random grad."""
    overrides = {"n_layer": layers} if layers else {}
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_preset(preset, **overrides)).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def time_ms(fn, reps, device):
    """Median ms of fn over reps calls, each timed by CUDA events; NaN on a CPU (run once)."""
    fn()  # warm-up: compiles, makes the optimizer state
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def optimizer_step(model, kind, device):
    """A closure: one clipped step of train.py's optimizer `kind` ("adamw" or "muon")."""
    cfg = TrainConfig(optimizer=kind)
    opt = optim.build_optimizer(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: optim.clipped_step(opt, params, cfg.grad_clip)


def stacks(model, dtype):
    """The blocks' matrices as Muon batches them: one (k, m, n) stack per shape, in dtype."""
    by_shape = {}
    for name, p in model.named_parameters():
        if muon.is_muon_matrix(name, p):
            by_shape.setdefault(tuple(p.shape), []).append(p.grad.to(dtype))
    return [torch.stack(gs) for gs in by_shape.values()]


def check(batches):
    """The largest relative error of the compiled stack against the loop, over the shapes."""
    worst = 0.0
    for b in batches:
        got = muon.orthogonalize(b)
        ref = torch.stack([muon.orthogonalize_reference(x, dtype=b.dtype) for x in b])
        err = torch.linalg.vector_norm(got.float() - ref.float()) / torch.linalg.vector_norm(ref)
        worst = max(worst, err.item())
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="124M", choices=PRESETS)
    ap.add_argument("--layers", type=int, default=0, help="fewer blocks (a CPU check)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # Muon's ns_dtype

    model = model_with_grads(args.preset, args.layers, device)
    batches = stacks(model, dtype)
    err = check(batches)
    flops = sum(ns_flops(b.shape) for b in batches)
    shapes = ", ".join(f"{b.shape[0]} x {tuple(b.shape[1:])}" for b in batches)
    print(f"{args.preset}: Newton-Schulz on {shapes}; {flops / 1e12:.3f} TFLOP a step; "
          f"compiled against the loop: {err:.2%} of the norm")  # fmt: skip
    if err > 0.03:
        print("MISMATCH: the compiled Newton-Schulz left the loop's result", file=sys.stderr)
        sys.exit(1)

    rows = []
    for kind in ("adamw", "muon"):
        model = model_with_grads(args.preset, args.layers, device)
        rows.append((kind, time_ms(optimizer_step(model, kind, device), args.reps, device), 0))
    loop = [x for b in batches for x in b]

    def compiled():
        return [muon.orthogonalize(b) for b in batches]

    def plain():
        return [muon.orthogonalize_reference(x, dtype=dtype) for x in loop]

    rows.append(("ns compiled", time_ms(compiled, args.reps, device), flops))
    rows.append(("ns loop", time_ms(plain, args.reps, device), flops))

    print(f"\n| {args.preset} | ms | TFLOP/s |")
    print("|---|---|---|")
    for name, ms, f in rows:
        tflops = f"{f / ms / 1e9:.0f}" if f and ms == ms else ""
        print(f"| {name} | {ms:.2f} | {tflops} |")


if __name__ == "__main__":
    main()
