"""LayerNorm backward's column sums (bench/RESULTS.md#layernorm-backwards-column-sums): one
compiled LayerNorm as the trainer runs it, forward + backward, for each of Inductor's mix-order
split sizes and with the mix-order reduction off.

    python -m bench.bench_layernorm_grad [--rows 8192,16384] [--width 768] [--only trainer,...]

The function: h = LayerNorm(x) under bf16 autocast on a bf16 residual stream x (B T, C), fp32
weight and bias, plus the residual itself, so that dx = d_residual + LayerNorm's backward of dh,
the sum the mix-order kernel fuses in training. Inductor then computes dw and db as partial sums
of split_size rows a program in an fp32 workspace, which the generated wrapper finishes with an
eager torch sum (ATen's reduce_kernel). Each variant's gradients are compared with float64
torch (the table's max err: all variants should agree, ~2e-3 from bf16), timed as a CUDA graph of
20 forward + backward calls (median of --repeats replays), and profiled once outside the graph:
µs a call in the Triton kernels, in ATen's reduce kernels and in memsets. Prints a table last.
"trainer" is the trainer's split (compile_settings.layernorm_split), "trainer + row_sum" the same
with the partial sums finished by grad_sums.row_sum (compile_settings.triton_partial_sums), counted
in the Triton column.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.common import graph_us
from gpt2_fused.training.compile_settings import layernorm_split, triton_partial_sums

VARIANTS = {"inductor": {}, "off": {"triton.mix_order_reduction": False}} | {
    f"split {n}": {"triton.mix_order_reduction_split_size": n} for n in (8, 16, 32, 64, 128)
}


def layernorm_residual(x, w, b):
    """(LayerNorm(x) in bf16, x): the two uses of the residual stream at a block's LayerNorm."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = F.layer_norm(x, (x.shape[-1],), w, b)
    return h.to(torch.bfloat16), x * 1.0


def inputs(rows, width):
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(rows, width, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).requires_grad_()
    b = (0.1 * torch.randn(width, device="cuda", generator=g)).requires_grad_()
    dh = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    dr = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    return x, w, b, dh, dr


def reference(x, w, b, dh, dr):
    """(dx, dw, db) in float64."""
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    h = F.layer_norm(x64, (x.shape[-1],), w64, b64)
    return torch.autograd.grad((h, x64), (x64, w64, b64), (dh.double(), dr.double()))


def kernel_us(step, calls=5):
    """µs a call of step() in Triton kernels, ATen reduce kernels and memsets (profiler)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    out = {"triton": 0.0, "reduce": 0.0, "memset": 0.0, "other": 0.0}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = "triton" if e.name.startswith(("triton_", "finish_kernel")) else "other"
        kind = "reduce" if "reduce_kernel" in e.name else kind
        kind = "memset" if "memset" in e.name.lower() else kind
        out[kind] += e.device_time / calls
    return out


def measure(name, patch, rows, width, repeats, row_sum=False):
    torch._dynamo.reset()
    x, w, b, dh, dr = inputs(rows, width)
    fn = torch.compile(layernorm_residual, dynamic=False)

    def step():
        return torch.autograd.grad(fn(x, w, b), (x, w, b), (dh, dr))

    with torch._inductor.config.patch(patch), triton_partial_sums(row_sum):
        got = step()  # compiles the forward and the backward under the patch
    want = reference(x, w, b, dh, dr)
    err = max(((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, want, strict=True))
    us = graph_us(lambda i: step(), range(20), repeats)
    return dict(name=name, rows=rows, us=us, err=err, **kernel_us(step))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8192,16384", help="B T values, comma-separated")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default="", help="variant names, comma-separated (default: all)")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    rows = []
    for n in map(int, args.rows.split(",")):
        split = layernorm_split(n, args.width, -1)
        trainer = {} if split is None else {"triton.mix_order_reduction_split_size": split}
        variants = [(name, patch, False) for name, patch in VARIANTS.items()]
        variants += [("trainer", trainer, False), ("trainer + row_sum", trainer, True)]
        for name, patch, row_sum in variants:
            if only and name not in only:
                continue
            rows.append(measure(name, patch, n, args.width, args.repeats, row_sum))
            print(rows[-1], flush=True)
    print("\n| rows | variant | µs fwd+bwd (graph) | Triton µs | reduce µs | memset µs | max err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rows']} | {r['name']} | {r['us']:.1f} | {r['triton']:.1f} | "
            f"{r['reduce']:.1f} | {r['memset']:.1f} | {r['err']:.1e} |"
        )


if __name__ == "__main__":
    main()
