"""The batch-1 decoding GEMV with the weights coming from HBM, as in a real decoding step.

    python bench/bench_gemv.py [--sizes 124M,1558M] [--layers 48]

Run 85 timed fused_loss/gemv.py on one weight replayed 20 times: each block weight (<= 20 MB)
then sits in the H200's L2, and the kernel looked 1.2-2.3x faster than cuBLAS; in the real step
(run 86's profile) it read 1558M's weights at ~2 TB/s, no faster than cuBLAS. Here each call
reads the next of `--layers` copies of the weight (1558M: 48 x 20 MB, far beyond L2), inside one
CUDA graph, as the step does. Per GPT-2 block shape (c_attn, attn c_proj, c_fc + GELU, mlp
c_proj), µs per call and TB/s for:
    cublas      F.linear (then F.gelu), what a step without the GEMV runs
    gemv        fused_loss.gemv.gemv, the kernel in use (a runtime K loop)
    unrolled    the same math with K a compile-time constant and the K loop unrolled, so that a
                program's loads need not wait for each other; BLOCK_N and num_warps swept
Correctness: each variant's output against F.linear in fp32 on the same bf16 inputs (max abs
error, next to cuBLAS's own). Prints a table last. On CPU (TRITON_INTERPRET=1), --quick checks
the unrolled kernel against the reference on small shapes and exits.
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from fused_loss import gemv  # noqa: E402
from fused_loss.triton_kernels import _cast  # noqa: E402

SHAPES = {  # (N, K, GELU) of a block's four linear layers
    "124M": [(2304, 768, False), (768, 768, False), (3072, 768, True), (768, 3072, False)],
    "1558M": [(4800, 1600, False), (1600, 1600, False), (6400, 1600, True), (1600, 6400, False)],
}


@triton.jit
def _gemv_unrolled_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: the loads are independent
        k = k0 + ks
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if GELU:
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    tl.store(y_ptr + rows, _cast(y, y_ptr.dtype.element_ty, INTERPRETED), mask=row_ok)


def gemv_unrolled(x, w, b, gelu, block_n, num_warps, block_k=512):
    """act(w @ x + b) by the unrolled kernel; x (K,), w (N, K) contiguous, b (N,)."""
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_unrolled_kernel[(triton.cdiv(n, block_n),)](
        x, w, b, y, n, k, HAS_BIAS=True, GELU=gelu, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRETED=x.device.type != "cuda", num_warps=num_warps,
    )  # fmt: skip
    return y


def cublas(x, w, b, gelu):
    y = F.linear(x, w, b)
    return F.gelu(y, approximate="tanh") if gelu else y


def graph_us(fn, copies, repeats=5):
    """µs per call of fn(i) for i over the weight copies, in one CUDA graph; median of rounds."""
    for i in range(len(copies)):
        fn(i)  # compile the Triton kernels and warm cuBLAS before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(len(copies)):
            fn(i)
    rounds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / len(copies))
    return statistics.median(rounds)


def quick():
    """CPU: the unrolled kernel under the interpreter against F.linear in fp64."""
    for n, k, gelu in [(37, 100, False), (64, 1100, True)]:
        x = torch.randn(k, dtype=torch.bfloat16)
        w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
        b = torch.randn(n, dtype=torch.bfloat16)
        ref = cublas(x.double(), w.double(), b.double(), gelu)
        err = (gemv_unrolled(x, w, b, gelu, 4, 4).double() - ref).abs().max().item()
        err_torch = (cublas(x, w, b, gelu).double() - ref).abs().max().item()
        print(f"N={n} K={k} gelu={gelu}: error {err:.2e} (torch bf16 {err_torch:.2e})")
        assert err <= 1.2 * err_torch + ref.abs().max().item() * 2**-8


def measure(n, k, gelu, layers):
    """Rows (shape, variant, µs per call, TB/s, max abs error) for one (N, K) shape."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    copies = [
        (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        for _ in range(layers)
    ]
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(k, device="cuda", generator=g).to(torch.bfloat16)
    ref = cublas(x.float(), copies[0].float(), b.float(), gelu)
    variants = {
        "cublas": lambda w: cublas(x, w, b, gelu),
        "gemv": lambda w: gemv.gemv(x, w, b, gelu),
    }
    for bn in (2, 4, 8):
        for nw in (2, 4):
            variants[f"unrolled n{bn} w{nw}"] = functools.partial(
                gemv_unrolled, x, b=b, gelu=gelu, block_n=bn, num_warps=nw
            )
    shape, rows = f"{n} x {k}{' gelu' if gelu else ''}", []
    for name, fn in variants.items():
        err = (fn(copies[0]).float() - ref).abs().max().item()
        us = graph_us(lambda i, fn=fn: fn(copies[i]), copies)
        rows.append((shape, name, us, 2 * n * k / us / 1e6, err))
        print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="124M,1558M")
    p.add_argument("--layers", type=int, default=48, help="weight copies read in turn")
    p.add_argument("--quick", action="store_true", help="CPU check of the unrolled kernel")
    args = p.parse_args()
    if args.quick:
        return quick()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv.py times CUDA kernels: no GPU here (--quick checks on CPU)")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for size in args.sizes.split(","):
        for n, k, gelu in SHAPES[size]:
            rows += measure(n, k, gelu, args.layers)
    print("\n| N x K | variant | µs per call | TB/s | max abs error vs fp32 |")
    print("|---|---|---|---|---|")
    for shape, name, us, tbs, err in rows:
        print(f"| {shape} | {name} | {us:.2f} | {tbs:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
