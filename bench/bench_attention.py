"""Causal attention at the training shapes: each scaled_dot_product_attention backend, same run.

    python -m bench.bench_attention [--shapes 124M:32,1558M:16] [--repeats 5] [--branch]

For each GPT-2 shape (B, nh, T = 1024, hs = 64, bf16, is_causal) and each backend that accepts
it (torch's own pick, cuDNN, flash, mem-efficient): forward and forward + backward in ms (CUDA
events, the median of --repeats rounds of 10 calls), TFLOP/s of the causal fwd + bwd (the
causal half of 4 * B * nh * T^2 * hs forward, 2.5x that for both), and the errors of y, dq, dk
and dv against fp32 math attention on the same bf16 inputs (max abs error / max abs reference).
torch's pick is whichever kernel scaled_dot_product_attention chooses with every backend on.
Prints a table last. On an H200 with torch 2.11, torch's pick is cuDNN's kernel already
(bench/RESULTS.md#attention).
--branch times the training branch instead: c_attn + attention forward + backward under bf16
autocast with an fp32 weight (GPU ms, median of rounds), torch's path (nn.Linear + SDPA) compiled
against gpt2_fused/kernels/attention.py's op (model attn_impl="fast") compiled. Its passes alone
(grad_sums.qkv_grad, colsum) are bench/bench_grad_sums.py's, timed as CUDA graphs.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt2_fused.training.compile_cache import use_keyed_cache

SHAPES = {"124M": (12, 768), "350M": (16, 1024), "774M": (20, 1280), "1558M": (25, 1600)}
BACKENDS = {
    "torch pick": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def attend(q, k, v, backend):
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_ms(fn, repeats):
    """Median over rounds of the mean ms of 10 calls."""
    fn()
    rounds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / 10)
    return statistics.median(rounds)


def rel_err(got, ref):
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def measure(name, batch, repeats):
    n_head, n_embd = SHAPES[name]
    T, hs = 1024, n_embd // n_head
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, n_head, T, hs)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "qkv")
    dy = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
    # the fp32 reference on the same bf16 values (math backend)
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref_y = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref_grads = torch.autograd.grad(ref_y, ref_in, dy.float())
    flops = 4 * batch * n_head * T * T * hs / 2  # causal forward: half of QK^T and PV
    rows = []
    for label, backend in BACKENDS.items():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        try:
            y = attend(*x, backend)
            grads = torch.autograd.grad(y, x, dy)
        except RuntimeError as e:  # the backend refuses this shape or GPU
            rows.append({"shape": f"{name}:{batch}", "backend": label, "error": str(e)[:80]})
            continue

        def fwd(x=x, backend=backend):
            with torch.no_grad():
                attend(*x, backend)

        def fwd_bwd(x=x, backend=backend):
            torch.autograd.grad(attend(*x, backend), x, dy)

        f_ms, fb_ms = time_ms(fwd, repeats), time_ms(fwd_bwd, repeats)
        errs = [rel_err(y, ref_y)] + [rel_err(a, b) for a, b in zip(grads, ref_grads, strict=True)]
        rows.append(
            {
                "shape": f"{name}:{batch}",
                "backend": label,
                "fwd_ms": f_ms,
                "fwd_bwd_ms": fb_ms,
                "tflops": 3.5 * flops / fb_ms / 1e9,
                "err": errs,
            }
        )
        print(rows[-1], flush=True)
    return rows


def branch(name, batch, repeats):
    """Rows (shape, case, ms) of the --branch timings."""
    from gpt2_fused.kernels import attention

    n_head, C = SHAPES[name]
    B, T = batch, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, C, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(3 * C, C, device="cuda", generator=g) * C**-0.5).requires_grad_()
    b = torch.zeros(3 * C, device="cuda", requires_grad=True)
    dy = torch.randn(B, T, C, device="cuda", generator=g).bfloat16()

    def plain(x, w, b):
        q, k, v = F.linear(x, w, b).split(C, dim=2)
        q, k, v = [t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v)]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    def ours(x, w, b):
        return attention.attention_fast(x, w, b, n_head)

    rows = []
    for case, fn in (("torch path, compiled", plain), ("attention op, compiled", ours)):
        f = torch.compile(fn)

        def step(f=f):
            with torch.autocast("cuda", torch.bfloat16):
                y = f(x, w, b)
            y.backward(dy.view(y.shape))

        rows.append((f"{name}:{batch}", case, time_ms(step, repeats)))
    return rows


def table(rows):
    lines = [
        "| shape | backend | fwd ms | fwd+bwd ms | TFLOP/s | err y / dq / dk / dv |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['backend']} | refused: {r['error']} | | | |")
            continue
        errs = " / ".join(f"{e:.1e}" for e in r["err"])
        lines.append(
            f"| {r['shape']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
            f"{r['tflops']:.0f} | {errs} |"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="124M:32,1558M:16", help="model:batch list")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--branch", action="store_true", help="the training branch, fwd + bwd")
    args = p.parse_args()
    use_keyed_cache()  # not another version's custom-op graphs
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py times CUDA kernels: no GPU here")
    print(torch.cuda.get_device_name(), torch.__version__)
    rows = []
    for spec in args.shapes.split(","):
        name, batch = spec.split(":")
        if args.branch:
            rows += branch(name, int(batch), args.repeats)
        else:
            rows += measure(name, int(batch), args.repeats)
    if args.branch:
        print("| shape | case | ms |\n|---|---|---|")
        print("\n".join(f"| {s} | {c} | {ms:.3f} |" for s, c, ms in rows))
        return
    print(table(rows))


if __name__ == "__main__":
    main()
