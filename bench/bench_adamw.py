"""The optimizer step's cost against its memory floor: is torch's fused AdamW the next lever?

    python -m bench.bench_adamw [--preset 1558M] [--reps 10]
    TRITON_INTERPRET=1 python -m bench.bench_adamw --preset 124M --layers 1   # CPU: the check only

A 1558M step profile spent 17.1 ms in torch's fused AdamW and 4.6 ms in grad-norm clipping,
about twice what their bytes need at the H200's 4.8 TB/s (bench/RESULTS.md#adamw). This times, on
the parameter shapes of a GPT-2 preset (fp32 params, grads and moments, as train.py has them):

- torch: `clip_grad_norm_` then `torch.optim.AdamW(fused=True).step()`;
- train.py (torch's AdamW): `optim.clipped_step`, the norm then the fused step with the clip
  factor passed as its grad_scale (read in-kernel; the kernel writes the clipped grads back:
  36 bytes);
- torch adam: the fused step alone;
- triton: the norm as torch computes it, then one Triton launch per parameter that reads the
  clip factor from device memory (no host sync) and applies it while updating: the grads are
  read once, not three times (norm, scale in place, step);
- triton flat: the same kernel once over all parameters laid end to end: the bandwidth a single
  launch reaches (train.py's parameters are separate tensors, so this is a bound, not an option);
- MultiTensorAdamW (gpt2_fused/kernels/adamw.py, train.py's default on CUDA): the norm and the
  step each in one launch over all tensors, through tables of their addresses.

and checks that `triton` leaves the same parameters and moments as `torch` after a few steps.
Floor: AdamW reads p, g, m, v and writes p, m, v (28 bytes per parameter); the norm reads g
(4 more). The per-tensor and flat kernels here are exploratory; train.py uses
gpt2_fused/kernels/adamw.py.
"""

import argparse
import sys

import torch
import triton
import triton.language as tl

from gpt2_fused.kernels.adamw import MultiTensorAdamW
from gpt2_fused.training import optim
from model import GPT, GPTConfig

PRESETS = ("124M", "350M", "774M", "1558M")
LR, BETAS, EPS, WD, MAX_NORM = 6e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


@triton.jit
def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, n, lr, beta1, beta2, eps, decay,
                  step_size, bc2_sqrt, BLOCK: tl.constexpr):  # fmt: skip
    """One AdamW update of BLOCK fp32 elements, the grads scaled by *coef_ptr (the clip
    factor) on the way in. decay = 1 - lr * weight_decay; step_size = lr / bias_correction1."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask) * tl.load(coef_ptr)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = tl.load(p_ptr + offs, mask=mask)
    m = m + (1.0 - beta1) * (g - m)  # torch: exp_avg.lerp_(grad, 1 - beta1)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p * decay - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(p_ptr + offs, p, mask=mask)


def clip_coef(grads, max_norm):
    """torch.nn.utils.clip_grad_norm_'s clamped factor, as a device scalar."""
    return torch.clamp(max_norm / (torch.nn.utils.get_total_norm(grads) + 1e-6), max=1.0)


class TritonAdamW:
    """Plain-tensor AdamW state (m, v per parameter), updated by adamw_kernel."""

    def __init__(self, params, weight_decays, block=4096):
        self.params, self.wds, self.block, self.step_count = params, weight_decays, block, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    def step(self, coef):
        self.step_count += 1
        bc1 = 1 - BETAS[0] ** self.step_count
        bc2_sqrt = (1 - BETAS[1] ** self.step_count) ** 0.5
        for p, m, v, wd in zip(self.params, self.m, self.v, self.wds, strict=True):
            n = p.numel()
            adamw_kernel[(triton.cdiv(n, self.block),)](
                p, p.grad, m, v, coef, n, LR, BETAS[0], BETAS[1], EPS, 1 - LR * wd,
                LR / bc1, bc2_sqrt, BLOCK=self.block, num_warps=8,
            )  # fmt: skip


def make_params(preset, layers, device, seed=0):
    """fp32 tensors with the preset's parameter shapes (layers: fewer blocks, 0 = all), grads
    filled, and their weight decays (train.py: decay on tensors of >= 2 dims)."""
    config = GPTConfig.from_preset(preset, **({"n_layer": layers} if layers else {}))
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(config).parameters()]
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.randn(shape, device=device, generator=gen) * 0.02
        p.grad = torch.randn(shape, device=device, generator=gen) * 1e-3
        params.append(p)
    return params, [WD if len(s) >= 2 else 0.0 for s in shapes]


def time_ms(fn, reps):
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    fn()  # warm-up (compiles the kernel, creates the optimizer state)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def check(preset, layers, steps, device):
    """Max |p - p_torch| and |m - m_torch| after `steps` updates from the same start (grads
    scaled up so that the clip acts), and the parameter count."""
    ref, wds = make_params(preset, layers, device)
    ours = [p.detach().clone() for p in ref]
    for p, q in zip(ref, ours, strict=True):
        p.grad.mul_(100.0)
        q.grad = p.grad.clone()
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(ref, wds, strict=True)]
    torch_opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=device == "cuda")
    triton_opt = TritonAdamW(ours, wds)
    for _ in range(steps):
        grads = [p.grad.clone() for p in ref]
        torch.nn.utils.clip_grad_norm_(ref, MAX_NORM)
        torch_opt.step()
        for p, g in zip(ref, grads, strict=True):  # the next step starts from unclipped grads
            p.grad.copy_(g)
        triton_opt.step(clip_coef([q.grad for q in ours], MAX_NORM))
    err = max((p - q).abs().max().item() for p, q in zip(ref, ours, strict=True))
    pairs = zip(ref, triton_opt.m, strict=True)
    err_m = max((torch_opt.state[p]["exp_avg"] - m).abs().max().item() for p, m in pairs)
    return err, err_m, len(ref), sum(p.numel() for p in ref)


def time_per_tensor(preset, layers, reps, device):
    """(name, bytes per parameter, ms) of the optimizer steps on the preset's tensors."""
    params, wds = make_params(preset, layers, device, seed=1)
    groups = [  # as train.py groups them
        {"params": [p for p, wd in zip(params, wds, strict=True) if wd], "weight_decay": WD},
        {"params": [p for p, wd in zip(params, wds, strict=True) if not wd], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=device == "cuda")
    ours = TritonAdamW(params, wds)
    multi = MultiTensorAdamW(groups, lr=LR, betas=BETAS, eps=EPS)

    def clip():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)

    def clip_step():
        clip()
        opt.step()

    def train_step():
        optim.clipped_step(opt, params, MAX_NORM)

    def triton_step():
        ours.step(clip_coef([p.grad for p in params], MAX_NORM))

    def multi_step():
        optim.clipped_step(multi, params, MAX_NORM)

    rows = [
        ("torch: clip_grad_norm_ + fused AdamW", 40, clip_step),
        ("train.py: norm + fused AdamW, clip as grad_scale", 36, train_step),
        ("torch: fused AdamW alone", 28, opt.step),
        ("torch: clip alone", 12, clip),
        ("triton: norm + AdamW per tensor, clip in-kernel", 32, triton_step),
        ("MultiTensorAdamW: norm + AdamW, one launch each", 32, multi_step),
        ("MultiTensorAdamW: AdamW alone", 28, multi.step),
    ]
    return [(name, nbytes, time_ms(fn, reps)) for name, nbytes, fn in rows]


def time_flat(n, reps, device):
    flat = TritonAdamW([torch.zeros(n, device=device)], [WD])
    flat.params[0].grad = torch.zeros(n, device=device)
    one = torch.ones((), device=device)
    return ("triton flat: AdamW, one launch", 28, time_ms(lambda: flat.step(one), reps))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1558M", choices=PRESETS)
    ap.add_argument("--layers", type=int, default=0, help="fewer blocks (CPU smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s for the floor")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    err, err_m, count, n = check(args.preset, args.layers, args.check_steps, device)
    print(f"{args.preset}: {count} tensors, {n / 1e6:.1f}M params; after {args.check_steps} "
          f"steps max |p - p_torch| {err:.2e}, |m - m_torch| {err_m:.2e}")  # fmt: skip
    if err > 1e-6 or err_m > 1e-9:
        print("MISMATCH against torch's AdamW", file=sys.stderr)
    results = time_per_tensor(args.preset, args.layers, args.reps, device)
    results.append(time_flat(n, args.reps, device))

    print(f"\n| {args.preset} optimizer step | bytes/param | ms | TB/s | floor ms |")
    print("|---|---|---|---|---|")
    for name, nbytes, ms in results:
        floor = nbytes * n / args.bandwidth * 1e3
        print(f"| {name} | {nbytes} | {ms:.2f} | {nbytes * n / ms / 1e9:.2f} | {floor:.2f} |")


if __name__ == "__main__":
    main()
