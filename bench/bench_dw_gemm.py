"""dw's accumulation over the fused loss's chunks with bf16 weights (issue 28): cuBLAS into an fp32
accumulator, as fused_loss does, against a Triton GEMM that keeps dw as a pair of bf16 halves (a
variant measured and dropped: bench/RESULTS.md#fused-loss).

    python -m bench.bench_dw_gemm [--repeats 3] [--configs all]
    TRITON_INTERPRET=1 python -m bench.bench_dw_gemm --check      # the kernel against float64

Why: with a bf16 weight the fused loss holds dw in an fp32 accumulator (V, D) across chunks, and
that accumulator takes most of the memory allowance (147 MiB of 320 at 124M, 307 of 320 at 1558M),
so the chunks are small (19 of 1725 rows at 124M, 16 of 1024 at 1558M) and each chunk's dw GEMM
reads and writes it (beta = 1). Held instead as hi + lo, hi = the bf16 gradient that the call
returns anyway and lo = bf16(acc - hi), only lo (V * D * 2 bytes) is extra: the chunks get ~1.5x
(124M) to 1.6x (1558M) the rows. hi + lo carries ~16 significant bits; each chunk's epilogue
forms acc = E^T (f x) + hi + lo in fp32 and splits it again, so the accumulated error stays near
2^-17 of |dw| a chunk against the final bf16 rounding's 2^-9. cuBLAS cannot split its output,
hence a Triton GEMM: C (V, D) += A^T B with A = E (n, V) and B = f * x (n, D), both read through
TMA descriptors with K (the chunk's rows) as their outer dimension; wgmma takes the transposed
A from shared memory for 16-bit types.

Timed (GPU ms, CUDA events around 20 launches, medians over --repeats interleaved rounds) at the
chunk shapes of 124M and 1558M with bf16 weights: cuBLAS accumulating into fp32 at today's rows,
the hi/lo kernel at today's rows (the kernel against cuBLAS) and at the rows the freed memory
allows (what a call would run), each scaled to the call's N rows (ms a chunk x chunks).
"""

import argparse
import statistics

import torch
import triton
import triton.language as tl

from bench.common import events
from fused_loss import linear_cross_entropy as fl
from gpt2_fused.kernels.device import num_sms
from gpt2_fused.kernels.interpreter import to_dtype

V = 50304
SHAPES = {"124M": (32768, 768), "1558M": (16384, 1600)}
# (BM, BN, BK, num_warps, num_stages). At sm_90 (ptxas -v, triton 3.6 and 3.9) the 128 x 256,
# 256 x 128 and 4-warp tiles spill 660-960 bytes in the accumulating epilogue (the fp32 tile, hi
# and lo at once); 128 x 128 at 8 warps takes 206-214 registers and does not spill
CONFIGS = {
    "128x256x64 w8 s3": (128, 256, 64, 8, 3),
    "256x128x64 w8 s3": (256, 128, 64, 8, 3),
    "128x128x64 w8 s4": (128, 128, 64, 8, 4),
    "128x128x64 w8 s5": (128, 128, 64, 8, 5),
    "128x128x64 w4 s4": (128, 128, 64, 4, 4),
}


@triton.jit
def _dw_hilo_kernel(
    e_desc,  # (n, V) block [BK, BM]: E (or G) of the chunk
    xs_desc,  # (n, D) block [BK, BN]: f * x of the chunk
    hi_ptr,  # (V, D) bf16: dw so far, rounded (the returned gradient after LAST)
    lo_ptr,  # (V, D) bf16: dw so far - hi, rounded (unused after LAST)
    n_rows,
    V,
    D,
    FIRST: tl.constexpr,  # no dw so far: hi, lo not read
    LAST: tl.constexpr,  # hi = bf16(dw), lo not written
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PROGRAMS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """hi + lo += E^T xs over one chunk, fp32 in between: acc = E^T xs + hi + lo, hi = bf16(acc),
    lo = bf16(acc - hi). Persistent; the tiles of one V block (pid_m) are consecutive, so the
    programs at work at once share E's tiles."""
    num_n = tl.cdiv(D, BN)
    tiles = tl.cdiv(V, BM) * num_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m = tile // num_n
        pid_n = tile % num_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, n_rows, BK):  # TMA zero-fills the rows past n_rows
            a = e_desc.load([k0, pid_m * BM])
            b = xs_desc.load([k0, pid_n * BN])
            if INTERPRETED:  # the interpreter's bf16 tl.dot is wrong (triton 3.9)
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a.T, b, acc)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        mask = (rows < V)[:, None] & (cols < D)[None, :]
        at = rows[:, None].to(tl.int64) * D + cols[None, :]
        if not FIRST:
            acc += tl.load(hi_ptr + at, mask=mask, other=0.0).to(tl.float32)
            acc += tl.load(lo_ptr + at, mask=mask, other=0.0).to(tl.float32)
        hi = to_dtype(acc, tl.bfloat16, INTERPRETED)
        tl.store(hi_ptr + at, hi, mask=mask)
        if not LAST:
            tl.store(
                lo_ptr + at, to_dtype(acc - hi.to(tl.float32), tl.bfloat16, INTERPRETED), mask=mask
            )


def dw_hilo(e, xs, hi, lo, first, last, config=None):
    """hi + lo (+)= e.T @ xs: e (n, V), xs (n, D) bf16 with 16-byte aligned rows; hi, lo (V, D)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cuda = e.device.type == "cuda"
    BM, BN, BK, warps, stages = CONFIGS[config] if cuda else (16, 16, 16, 1, 1)
    n, Vc = e.shape
    D = xs.shape[1]
    e_desc = TensorDescriptor(e, list(e.shape), list(e.stride()), [BK, BM])
    xs_desc = TensorDescriptor(xs, list(xs.shape), list(xs.stride()), [BK, BN])
    tiles = triton.cdiv(Vc, BM) * triton.cdiv(D, BN)
    programs = min(tiles, num_sms(e.device.index)) if cuda else tiles
    _dw_hilo_kernel[(programs,)](
        e_desc, xs_desc, hi, lo, n, Vc, D, FIRST=first, LAST=last, BM=BM, BN=BN, BK=BK,
        PROGRAMS=programs, INTERPRETED=not cuda, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def check():
    """Chunks accumulated through hi/lo against float64 and against fp32 accumulation then one cast:
    both should carry about one bf16 rounding of dw (~2e-3 relative), no more."""
    g = torch.Generator().manual_seed(0)
    n, Vc, D, chunks = 48, 80, 40, 5
    es = [torch.randn(n, Vc, generator=g).bfloat16() for _ in range(chunks)]
    xs = [torch.randn(n, D, generator=g).bfloat16() for _ in range(chunks)]
    hi, lo = torch.empty(Vc, D, dtype=torch.bfloat16), torch.empty(Vc, D, dtype=torch.bfloat16)
    for i, (e, x) in enumerate(zip(es, xs, strict=True)):
        dw_hilo(e, x, hi, lo, first=i == 0, last=i == chunks - 1)
    ref = sum(e.double().T @ x.double() for e, x in zip(es, xs, strict=True))
    fp32 = sum(e.float().T @ x.float() for e, x in zip(es, xs, strict=True)).bfloat16()

    def rel(a):
        return ((a.double() - ref).norm() / ref.norm()).item()

    print(f"hi/lo {rel(hi):.2e}, fp32 accumulator cast once {rel(fp32):.2e}")
    assert rel(hi) < 1.2 * rel(fp32) + 1e-4
    # without lo (bf16 accumulation, one rounding a chunk) the error grows with the chunks
    hb = torch.empty(Vc, D, dtype=torch.bfloat16)
    for i, (e, x) in enumerate(zip(es, xs, strict=True)):
        dw_hilo(e, x, hb, torch.zeros_like(lo), first=i == 0, last=True)
    print(f"bf16 accumulation (no lo) {rel(hb):.2e}")
    assert rel(hb) > 1.3 * rel(hi)  # the check can tell the two apart


def time_shape(shape, N, D, configs, repeats):
    rows_fp32 = fl.rows_per_chunk(N, V, D, 2, V * D * 4, True)
    rows_hilo = fl.rows_per_chunk(N, V, D, 2, V * D * 2, True)
    g = torch.Generator(device="cuda").manual_seed(0)
    e = (torch.rand(rows_hilo, V, device="cuda", generator=g) * 1e-4).bfloat16()
    xs = torch.randn(rows_hilo, D, device="cuda", generator=g).bfloat16()
    acc = torch.zeros(V, D, device="cuda")
    hi = torch.zeros(V, D, device="cuda", dtype=torch.bfloat16)
    lo = torch.zeros_like(hi)

    def cublas(r=rows_fp32):
        fl.gemm(acc, e[:r].t(), xs[:r], accumulate=True)

    def hilo(r, name):
        return lambda: dw_hilo(e[:r], xs[:r], hi, lo, first=False, last=False, config=name)

    cases = {f"cuBLAS into fp32, {rows_fp32} rows": (cublas, rows_fp32)}
    for name in configs:
        for r in (rows_fp32, rows_hilo):
            try:
                hilo(r, name)()
                torch.cuda.synchronize()
                cases[f"hi/lo {name}, {r} rows"] = (hilo(r, name), r)
            except Exception as exc:  # a configuration that does not compile or fit
                print(f"{name} at {r} rows: {repr(exc)[:200]}")
    # the kernel's result against cuBLAS's on one chunk
    fl.gemm(acc, e.t(), xs)
    dw_hilo(e, xs, hi, lo, first=True, last=False, config=configs[0])
    err = ((hi.float() + lo.float() - acc).norm() / acc.norm()).item()
    times = {k: [] for k in cases}
    for _ in range(repeats):
        for k, (fn, _) in cases.items():
            times[k].append(events(fn))
    flop = 2 * V * D
    print(f"\n{shape} (N {N}, D {D}): hi + lo against cuBLAS's fp32 on a chunk: {err:.1e}")
    print("| case | ms a chunk | TFLOP/s | chunks | ms a call |")
    print("|---|---|---|---|---|")
    for k, ts in times.items():
        ms, r = statistics.median(ts), cases[k][1]
        chunks = triton.cdiv(N, r)
        print(f"| {k} | {ms:.4f} | {flop * r / ms / 1e9:.0f} | {chunks} | {ms * chunks:.3f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="all")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        check()
        return
    configs = list(CONFIGS) if args.configs == "all" else args.configs.split(";")
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for shape, (N, D) in SHAPES.items():
        time_shape(shape, N, D, configs, args.repeats)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
