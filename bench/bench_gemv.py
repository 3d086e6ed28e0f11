"""The batch-1 decoding GEMV with the weights coming from HBM, as in a real decoding step.

    python -m bench.bench_gemv [--sizes 124M,1558M] [--layers 48]
    TRITON_INTERPRET=1 python -m bench.bench_gemv --quick      # CPU: the baseline kernel's check

Each call reads the next of `--layers` copies of the weight (1558M: 48 x 20 MB, far beyond the
H200's L2), inside one CUDA graph, as a decoding step does (one weight replayed would sit in L2).
Per GPT-2 block shape (c_attn, attn c_proj, c_fc + GELU, mlp c_proj), µs per call and TB/s of
weight bytes for:
    cublas          F.linear (then F.gelu): a step without the GEMV
    loop            an earlier GEMV (a runtime K loop of 512-wide loads, no PDL), kept here
    gemv            gpt2_fused.kernels.gemv as model.py runs it (whole rows at once, PDL on Hopper)
    gemv no-pdl     its kernel launched plainly (gemv_variant)
    e{E} w{W}       its kernel with E weight elements per program, W warps (gemv_variant)
    block torch     what model.Block ran around the matmul before: F.layer_norm + F.linear
                    (+ GELU) for c_attn and c_fc, F.linear + the residual add for the projections
    block gemv      the same in one GEMV (the LayerNorm in its prologue, the add in its epilogue)
Correctness: each variant's output against the fp32 computation on the same bf16 inputs (max abs
error, next to cuBLAS's own). Prints a table last.
"""

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.common import graph_us
from gpt2_fused.kernels import gemv
from gpt2_fused.kernels.interpreter import to_dtype
from gpt2_fused.kernels.launch import num_sms

SHAPES = {  # (N, K, GELU, what model.Block fuses into it) of a block's four linear layers
    "124M": [(2304, 768, False, "ln"), (768, 768, False, "residual"), (3072, 768, True, "ln"),
             (768, 3072, False, "residual")],
    "1558M": [(4800, 1600, False, "ln"), (1600, 1600, False, "residual"),
              (6400, 1600, True, "ln"), (1600, 6400, False, "residual")],
}  # fmt: skip


@triton.jit
def _gemv_loop_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K,
    GELU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """The earlier GEMV: BLOCK_N rows, a runtime loop over K in BLOCK_K steps (each load waits
    for the last), bias and GELU on the fp32 sum."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1) + tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if GELU:
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    tl.store(y_ptr + rows, to_dtype(y, y_ptr.dtype.element_ty, INTERPRETED), mask=row_ok)


def gemv_loop(x, w, b, gelu):
    """Its launch: 16 rows a program, halved to leave >= 2 programs per SM."""
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    block = 16
    while block > 2 and triton.cdiv(n, block) < 264:
        block //= 2
    _gemv_loop_kernel[(triton.cdiv(n, block),)](
        x, w, b, y, n, k, GELU=gelu, BLOCK_N=block, BLOCK_K=512,
        INTERPRETED=x.device.type != "cuda", num_warps=4,
    )  # fmt: skip
    return y


def gemv_variant(x, w, b, gelu, elements=gemv.ELEMENTS, num_warps=gemv.NUM_WARPS, use_pdl=None):
    """gpt2_fused.kernels.gemv's kernel (bias, GELU; no LayerNorm, residual or cache) at another
    launch: `elements` weights a program (its block_n rule otherwise), num_warps, PDL or not
    (None: as gemv launches it)."""
    use_pdl = gemv.pdl(x.device) if use_pdl is None else use_pdl
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    KP = triton.next_power_of_2(k)
    sms = num_sms(x.device.index)
    block = max(1, elements // KP)
    while block > 1 and triton.cdiv(n, block) < 2 * sms:
        block //= 2
    gemv.gemv_kernel[(triton.cdiv(n, block),)](
        x, w, b, w, w, w, y, w, w, w, n, 0.0, 0, K=k, KP=KP, BLOCK_N=block, HAS_BIAS=True,
        LN=False, LN_BIAS=False, GELU=gelu, RESIDUAL=False, KV=False, HEAD=1, PDL=use_pdl,
        INTERPRETED=False, num_warps=num_warps, **(dict(launch_pdl=True) if use_pdl else {}),
    )  # fmt: skip
    return y


def cublas(x, w, b, gelu):
    y = F.linear(x, w, b)
    return F.gelu(y, approximate="tanh") if gelu else y


def quick():
    """CPU: the baseline kernel under the interpreter against F.linear in fp64."""
    for n, k, gelu in [(37, 100, False), (64, 1100, True)]:
        x = torch.randn(k, dtype=torch.bfloat16)
        w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
        b = torch.randn(n, dtype=torch.bfloat16)
        ref = cublas(x.double(), w.double(), b.double(), gelu)
        err = (gemv_loop(x, w, b, gelu).double() - ref).abs().max().item()
        err_torch = (cublas(x, w, b, gelu).double() - ref).abs().max().item()
        print(f"N={n} K={k} gelu={gelu}: error {err:.2e} (torch bf16 {err_torch:.2e})")
        assert err <= 1.2 * err_torch + ref.abs().max().item() * 2**-8


def measure(n, k, gelu, around, layers):
    """Rows (shape, variant, µs per call, TB/s, max abs error) for one (N, K) shape."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    copies = [
        (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
        for _ in range(layers)
    ]
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    x = (2 * torch.randn(k, device="cuda", generator=g) + 1).to(torch.bfloat16)
    ln_w = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    ln_b = (0.3 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    r = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    ref = cublas(x.float(), copies[0].float(), b.float(), gelu)
    variants = {
        "cublas": lambda w: cublas(x, w, b, gelu),
        "loop": lambda w: gemv_loop(x, w, b, gelu),
        "gemv": lambda w: gemv.gemv(x, w, b, gelu=gelu),
        "gemv no-pdl": lambda w: gemv_variant(x, w, b, gelu, use_pdl=False),
    }
    for e in (2048, 4096, 8192, 16384):
        for nw in (4, 8):
            variants[f"e{e} w{nw}"] = lambda w, e=e, nw=nw: gemv_variant(
                x, w, b, gelu, elements=e, num_warps=nw
            )
    # the block's op around this matmul: the LayerNorm before c_attn and c_fc, the residual add
    # after the projections
    ln = (ln_w, ln_b, 1e-5) if around == "ln" else None
    res = r if around == "residual" else None
    block_ref = gemv.gemv_reference(
        x.float(), copies[0].float(), b.float(), gelu=gelu, residual=None if res is None else
        r.float(), ln=None if ln is None else (ln_w.float(), ln_b.float(), 1e-5))  # fmt: skip
    blocks = {
        "block torch": lambda w: gemv.gemv_reference(x, w, b, gelu=gelu, ln=ln, residual=res),
        "block gemv": lambda w: gemv.gemv(x, w, b, gelu=gelu, ln=ln, residual=res),
    }
    shape = f"{n} x {k}{' gelu' if gelu else ''}"
    rows = []
    for name, fn in {**variants, **blocks}.items():
        want = block_ref if name in blocks else ref
        err = (fn(copies[0]).float() - want).abs().max().item()
        us = graph_us(lambda i, fn=fn: fn(copies[i]), copies)
        rows.append((shape, name, us, 2 * n * k / us / 1e6, err))
        print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="124M,1558M")
    p.add_argument("--layers", type=int, default=48, help="weight copies read in turn")
    p.add_argument("--quick", action="store_true", help="CPU check of the baseline kernel")
    args = p.parse_args()
    if args.quick:
        return quick()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv.py times CUDA kernels: no GPU here (--quick checks on CPU)")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for size in args.sizes.split(","):
        for shape in SHAPES[size]:
            rows += measure(*shape, args.layers)
    print("\n| N x K | variant | µs per call | TB/s | max abs error vs fp32 |")
    print("|---|---|---|---|---|")
    for shape, name, us, tbs, err in rows:
        print(f"| {shape} | {name} | {us:.2f} | {tbs:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
