"""Gradients summed over a micro-batch's rows. Column sums of a tall (M, N) gradient, the bias
gradient of a linear layer, in two passes that read it once; optionally laid out as the
concatenation of three (M, C) parts as they are read (the qkv gradient); and the last pass alone,
for the partial sums of LayerNorm's dw and db that Inductor leaves.

    colsum(t)             t (M, N) -> sum_m t[m] (N,) fp32
    qkv_grad(dq, dk, dv)  each (M, C) -> ([dq | dk | dv] (M, 3C), its column sums (3C,) fp32)
    row_sum(t)            t (P, N) fp32, a short stack of partial sums -> sum_p t[p] (N,) fp32

Why: the bias gradients of GPT-2's c_fc (M, 4C) and c_attn (M, 3C) are column sums over M = B T
rows (32K at 124M:32). Inductor's reduction for them runs well below the HBM bandwidth at these
shapes, and for c_attn it cannot fuse the sum into the copy that lays out the three attention
gradients as [dq | dk | dv] for the weight-gradient GEMMs (the copy walks rows, the sum columns),
so the three are read twice; these two passes reach ~3.4 TB/s at both widths
(bench/RESULTS.md#attention).

Pass 1 (partial_sums_kernel): program (j, p) reads rows [p R, (p + 1) R) of the BN columns of
block j, 2 BM rows at a time, stores them to the concatenation when it is asked for, and writes
their fp32 sums to partial row p. Pass 2 (finish_kernel) adds the P partial rows up. The order
of the additions is fixed, so the result is the same from run to run (no atomics). Under the CPU
interpreter the same kernels run (16-bit values are only loaded, stored and widened to fp32).
colsum_reference / qkv_grad_reference are the same in torch.
row_sum is pass 2 alone, launched for P of a few hundred to a thousand rows: the partial dw and
db sums that Inductor leaves for each LayerNorm backward (compile_settings.triton_partial_sums has
its generated code call row_sum in place of ATen's column sum, which at these shapes takes a
memset and 6-11 us; bench/RESULTS.md#layernorm-backwards-column-sums). Its reference is t.sum(0).
Both ops are torch.library.triton_ops: called eagerly they launch the kernels themselves; inside
torch.compile's region (the training step's backward) Inductor sees through them and launches
the kernels from its own generated code, without the dispatcher's and Triton's Python launcher's
~100 us a call (bench/RESULTS.md#host-cost).
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from gpt2_fused.kernels.launch import num_sms

# pass 1's launch: elements of one of the two tiles a program reads per step (BM rows x BN
# columns), its warps and how many programs per SM (the rows are split so): 3 is what stays
# resident at this tile (~160 registers a thread, tests/test_grad_sums.py), one wave; other launches
# are timed by bench/bench_grad_sums.py (bench/RESULTS.md#attention)
LAUNCH = {
    "cuda": dict(tile=8192, num_warps=4, per_sm=3),
    "cpu": dict(tile=256, num_warps=1, per_sm=1),
}


@triton.jit
def partial_sums_kernel(
    a_ptr,  # (M, C) the first (or only) part
    b_ptr,  # (M, C) the second, when THREE
    c_ptr,  # (M, C) the third, when THREE
    cat_ptr,  # (M, 3C) out: [a | b | c], when THREE
    part_ptr,  # (P, N) fp32 out: partial column sums, N = 3C when THREE, else C
    M,
    C,
    stride_in,  # the parts' row stride (elements)
    ROWS: tl.constexpr,  # R rows a program, a multiple of 2 BM
    BM: tl.constexpr,
    BN: tl.constexpr,  # divides C when THREE (a block lies in one part)
    THREE: tl.constexpr,
):
    j = tl.program_id(0)
    p = tl.program_id(1)
    N = 3 * C if THREE else C
    col0 = j * BN
    src = a_ptr
    in0 = col0
    if THREE:
        which = col0 // C
        in0 = col0 - which * C
        if which == 1:
            src = b_ptr
        elif which == 2:
            src = c_ptr
    lanes = tl.arange(0, BN)
    cols_in = in0 + lanes
    cols = col0 + lanes
    col_ok = cols < N
    # each thread adds up its own elements; one reduction across threads, at the end
    # two tiles a step, both loaded before either is used (two reads in flight per program)
    acc = tl.zeros((BM, BN), tl.float32)
    for r0 in range(0, ROWS, 2 * BM):
        rows = p * ROWS + r0 + tl.arange(0, BM)
        mask = (rows < M)[:, None] & col_ok[None, :]
        mask2 = (rows + BM < M)[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        t = tl.load(src + r64 * stride_in + cols_in[None, :], mask=mask, other=0.0)
        t2 = tl.load(src + (r64 + BM) * stride_in + cols_in[None, :], mask=mask2, other=0.0)
        if THREE:
            tl.store(cat_ptr + r64 * N + cols[None, :], t, mask=mask)
            tl.store(cat_ptr + (r64 + BM) * N + cols[None, :], t2, mask=mask2)
        acc += t.to(tl.float32) + t2.to(tl.float32)
    tl.store(part_ptr + p.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def finish_kernel(part_ptr, out_ptr, P, N, BP: tl.constexpr, BN: tl.constexpr):
    """out (N,) fp32 = the sum of the P partial rows, in row order."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros((BP, BN), tl.float32)
    for p0 in range(0, P, BP):
        rows = p0 + tl.arange(0, BP)
        mask = (rows < P)[:, None] & (cols < N)[None, :]
        acc += tl.load(
            part_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0
        )
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < N)


# row_sum's launch: the widest columns a program (from 8) that leave no more programs than SMs,
# so that ~100 programs share a 768- or 1600-wide stack (4-8 KB of fp32 a row block each), and
# elements a program adds per step
ROW_SUM_TILE = 4096


def row_sum(t):
    """The sum of the rows of t (P, N) fp32, row-major: (N,) fp32, added in row order (the same
    bits every call), one launch. A plain function, not an op: Inductor's generated wrapper calls
    it (compile_settings.triton_partial_sums), so no dispatcher sits in front of the launch."""
    if t.dim() != 2 or t.dtype != torch.float32 or t.stride() != (t.shape[1], 1):
        raise ValueError(f"row_sum: a row-major (P, N) fp32 tensor, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()}")  # fmt: skip
    P, N = t.shape
    programs = num_sms(t.device.index) if t.is_cuda else 4
    BN = 8
    while BN < 256 and triton.cdiv(N, BN) > programs:
        BN *= 2
    BP = min(triton.next_power_of_2(max(P, 1)), max(1, ROW_SUM_TILE // BN))
    out = torch.empty(N, device=t.device, dtype=torch.float32)
    finish_kernel[(triton.cdiv(N, BN),)](t, out, P, N, BP=BP, BN=BN)
    return out


def _launch(parts, M, C, three):
    """Pass 1 and 2 over `parts` (one or three (M, C) tensors of one row stride): the sums (N,)
    fp32 and, when three, the concatenation (M, 3C)."""
    a = parts[0]
    N = 3 * C if three else C
    cuda = a.device.type == "cuda"
    cfg = LAUNCH["cuda" if cuda else "cpu"]
    tile = cfg["tile"]
    BN = min(256, tile, triton.next_power_of_2(N))
    if three:  # the largest power of two <= 256 dividing C: every block within one part
        BN = min(BN, C & -C)
    BM = max(1, tile // BN)
    blocks = triton.cdiv(N, BN)
    want = num_sms(a.device.index) * cfg["per_sm"] if cuda else 4
    splits = max(1, min(triton.cdiv(M, BM), triton.cdiv(want, blocks)))
    rows = 2 * BM * triton.cdiv(triton.cdiv(M, splits), 2 * BM)
    P = triton.cdiv(M, rows)
    partial = torch.empty((P, N), device=a.device, dtype=torch.float32)
    # not written unless three; its own (empty) tensor rather than partial again, so that no
    # tensor is two of the kernel's arguments when Inductor functionalises the launch
    cat = torch.empty((M, N) if three else (0,), device=a.device, dtype=a.dtype)
    b, c = (parts[1], parts[2]) if three else (a, a)
    wrap_triton(partial_sums_kernel)[(blocks, P)](
        a, b, c, cat, partial, M, C, a.stride(0), ROWS=rows, BM=BM, BN=BN, THREE=three,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    sums = torch.empty(N, device=a.device, dtype=torch.float32)
    BN2 = min(64, triton.next_power_of_2(N))  # 36 programs for c_attn's 2304 columns
    wrap_triton(finish_kernel)[(triton.cdiv(N, BN2),)](
        partial, sums, P, N, BP=min(32, triton.next_power_of_2(P)), BN=BN2
    )
    return (cat if three else None), sums


def _check_2d(name, *ts):
    shape = ts[0].shape
    for t in ts:
        if t.dim() != 2 or t.shape != shape or t.dtype != ts[0].dtype:
            raise ValueError(f"{name}: parts must be 2-D of one shape and dtype, got "
                             f"{[(tuple(u.shape), u.dtype) for u in ts]}")  # fmt: skip
        if t.stride(1) != 1 or t.stride(0) != ts[0].stride(0):
            raise ValueError(f"{name}: parts must be row-major with one row stride, got "
                             f"{[u.stride() for u in ts]}")  # fmt: skip


@triton_op("gpt2_fused::colsum", mutates_args=())
def colsum(t: torch.Tensor) -> torch.Tensor:
    """The column sums of t (M, N), row-major, in fp32."""
    _check_2d("colsum", t)
    return _launch((t,), t.shape[0], t.shape[1], three=False)[1]


@triton_op("gpt2_fused::qkv_grad", mutates_args=())
def qkv_grad(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([dq | dk | dv] (M, 3C) contiguous, its column sums (3C,) fp32) of three (M, C) parts of
    one dtype and row stride."""
    _check_2d("qkv_grad", dq, dk, dv)
    M, C = dq.shape
    return _launch((dq, dk, dv), M, C, three=True)


def colsum_reference(t):
    """colsum in torch: the column sums of t in fp32 (in fp64 for an fp64 t)."""
    return t.sum(0, dtype=torch.promote_types(t.dtype, torch.float32))


def qkv_grad_reference(dq, dk, dv):
    """qkv_grad in torch: the concatenation and its fp32 column sums."""
    cat = torch.cat([dq, dk, dv], dim=1)
    return cat, colsum_reference(cat)
