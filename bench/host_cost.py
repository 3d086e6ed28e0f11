"""Host time per call of each custom op, the pieces inside them, and torch's own ops for scale.

    python -m bench.host_cost [--calls 400] [--out DIR]

At shapes so small that the GPU finishes each kernel before the host issues the next (64 rows,
width 64, bf16), the wall time of a call is its host time: what it costs the eager path and the
compiled default path (which calls our ops through the dispatcher) every time a step runs them.
A replayed CUDA graph has none of it. Each line: median over 5 rounds of `--calls` calls,
synchronised at the end of each round; "fwd+bwd" runs the op under autograd and its backward;
"compiled caller" calls it from a torch.compile'd function (Dynamo's guards and Inductor's
wrapper included), the way the default training step calls it.
"""

import argparse
import statistics
import time

import torch

from bench.common import write_json
from fused_loss import fused_linear_cross_entropy
from gpt2_fused.kernels import attention, cublaslt, grad_sums, mlp

M, D, V, HEADS = 64, 64, 512, 2  # rows, width, vocabulary, heads: every kernel ~1-5 us


def per_call_us(fn, calls, rounds=5):
    """Median over rounds of the wall time per call (us), each round synchronised at its end."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def compiled(op, *args):
    """A call of op(*args) from a torch.compile'd function, as the training step makes it."""
    fn = torch.compile(lambda *a: op(*a), fullgraph=True)
    return lambda: fn(*args)


def cases():
    """name -> a callable making one call, on tiny CUDA tensors."""
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, dtype=bf, grad=False):
        t = (torch.randn(*shape, device=dev, generator=g) * 0.1).to(dtype)
        return t.requires_grad_(grad)

    x, r = rand(M, D), rand(M, D)
    w_fc, b_fc = rand(4 * D, D, dtype=torch.float32), rand(4 * D, dtype=torch.float32)
    w_pr, b_pr = rand(D, 4 * D, dtype=torch.float32), rand(D, dtype=torch.float32)
    w_fc_c, w_pr_c = w_fc.to(bf), w_pr.to(bf)
    h, out = rand(M, 4 * D), torch.empty(M, 4 * D, device=dev, dtype=bf)
    b_fc_c = b_fc.to(bf)
    params = [t.clone().requires_grad_(True) for t in (w_fc, b_fc, w_pr, b_pr)]
    xg = x.clone().requires_grad_(True)
    x3 = rand(2, M // 2, D, grad=True)
    w_at, b_at = rand(3 * D, D, dtype=torch.float32, grad=True), rand(3 * D, dtype=torch.float32)
    b_at.requires_grad_(True)
    w_cp, b_cp = rand(D, D, dtype=torch.float32, grad=True), rand(D, dtype=torch.float32)
    w_lm, y = rand(V, D, grad=True), torch.randint(0, V, (M,), device=dev, generator=g)
    parts = [rand(M, D) for _ in range(3)]

    def fwd_bwd(fn):
        def run():
            fn().float().sum().backward()

        return run

    def mlp_fwd():
        with torch.no_grad():
            mlp.mlp_cublaslt(x, w_fc, b_fc, w_pr, b_pr, residual=r)

    return {
        "torch.empty (32 MiB)": lambda: torch.empty(32 * 2**20, dtype=torch.uint8, device=dev),
        "bias.to(bf16)": lambda: b_fc.to(bf),
        "torch.addmm": lambda: torch.addmm(b_fc_c, x, w_fc_c.t()),
        "cublaslt.matmul (GELU_AUX_BIAS)": lambda: cublaslt.matmul(
            x, w_fc_c.t(), out, bias=b_fc_c, aux=h, epilogue=cublaslt.EPI_GELU_AUX_BIAS
        ),
        "colsum op": lambda: grad_sums.colsum(h),
        "colsum op, compiled caller": compiled(grad_sums.colsum, h),
        "qkv_grad op": lambda: grad_sums.qkv_grad(*parts),
        "qkv_grad op, compiled caller": compiled(grad_sums.qkv_grad, *parts),
        "dgelu_mm op": lambda: mlp.dgelu_mm(x, w_pr_c, h),
        "mlp_gelu op (fwd)": mlp_fwd,
        "mlp_gelu fwd+bwd": fwd_bwd(lambda: mlp.mlp_cublaslt(xg, *params, residual=r)),
        "attention fwd+bwd": fwd_bwd(lambda: attention.attention_fast(x3, w_at, b_at, HEADS)),
        "proj_residual fwd+bwd": fwd_bwd(
            lambda: attention.proj_residual_fast(x3, w_cp, b_cp, r.view(2, M // 2, D))
        ),
        "mlp_gelu fwd+bwd, compiled caller": fwd_bwd(
            torch.compile(lambda: mlp.mlp_cublaslt(xg, *params, residual=r))
        ),
        "fused loss fwd+bwd": fwd_bwd(lambda: fused_linear_cross_entropy(xg, w_lm, y)),
        "torch F.linear + cross_entropy fwd+bwd": fwd_bwd(
            lambda: torch.nn.functional.cross_entropy((xg @ w_lm.t()).float(), y)
        ),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = {name: per_call_us(fn, args.calls) for name, fn in cases().items()}
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| call | host us a call |\n|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")
    write_json(args.out, "host_cost.json", rows)


if __name__ == "__main__":
    main()
