"""The MLP's two GEMMs that carry the GELU, as persistent Triton kernels (Hopper: TMA, wgmma).

    up:     h = x @ w.T + b,  a = gelu_tanh(h)          x (M, K), w (N, K), b (N,); h, a (M, N)
    dgelu:  dh = (dy @ w) * gelu_tanh'(h)               dy (M, K), w (K, N), h (M, N); dh (M, N)
            parts[i] = sum of the rows of dh in row tile i   (M / BM, N) fp32, when asked

with gelu_tanh(h) = h s and gelu_tanh'(h) = s + 2 h s (1 - s) k0 (1 + 3 k1 h^2), where
s = sigmoid(2 u) = (1 + tanh u) / 2, u = k0 (h + k1 h^3), k0 = sqrt(2 / pi), k1 = 0.044715:
one exp2 and one reciprocal an element. Both are evaluated on the fp32 accumulator (+ bias), as
cuBLASLt's GELU_AUX_BIAS and DGELU epilogues do (mlp.py); the outputs are rounded once to the
inputs' dtype. parts are the column sums of dh as stored (rounded), a row tile each, so that the
bias gradient db = colsum.row_sum(parts) needs no second read of dh.

Why: in cuBLASLt the two epilogue GEMMs run at ~485-505 TFLOP/s at the 124M shapes, against ~700
for the plain GEMMs of the same step, and the bias gradient is one more full read of dh
(bench/RESULTS.md#mlp). Tiles run row-major (the programs at work share rows of x / dy; w stays
in L2). Under the CPU interpreter the same code runs with the operands widened to fp32 (the
interpreter's bf16 tl.dot is wrong). gelu_up_reference / dgelu_reference are the math in torch.
"""

import torch
import triton
import triton.language as tl

from gpt2_fused.kernels.device import is_hopper, num_sms
from gpt2_fused.kernels.interpreter import to_dtype

K0 = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
K1 = tl.constexpr(0.044715)
LOG2E = tl.constexpr(1.4426950408889634)

# tiles and launch by device ("cpu": the interpreter); H_TMA: dgelu reads h through a TMA
# descriptor (else pointer loads); others are timed by bench/bench_gelu_gemm.py
LAUNCH = {
    "up": {
        "cuda": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
        "cpu": dict(BM=16, BN=16, BK=16, num_warps=1, num_stages=1),
    },
    "dgelu": {
        "cuda": dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4, H_TMA=True),
        "cpu": dict(BM=16, BN=16, BK=16, num_warps=1, num_stages=1, H_TMA=True),
    },
}


def applies(*ts):
    """The TMA descriptors need 16-bit operands with 16-byte aligned rows and bases; the launches
    are tuned and tested on Hopper only."""
    for t in ts:
        if t.dtype not in (torch.bfloat16, torch.float16) or t.dtype != ts[0].dtype:
            return False
        if t.stride(-1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            return False
    return ts[0].device.type != "cuda" or is_hopper(ts[0].device)


@triton.jit
def _sig2u(h):
    """s = sigmoid(2 u) = (1 + tanh(u)) / 2 and du/dh, u = k0 (h + k1 h^3); fp32."""
    h2 = h * h
    u = K0 * h * (1.0 + K1 * h2)
    s = 1.0 / (1.0 + tl.exp2(u * (-2.0 * LOG2E)))  # exp2 -> inf for u << 0: s = 0
    return s, K0 * (1.0 + 3.0 * K1 * h2)


@triton.jit
def gelu_up_kernel(
    x_desc,  # (M, K) block [BM, BK]
    w_desc,  # (N, K) block [BN, BK]
    b_ptr,  # (N,)
    h_desc,  # (M, N) out, block [BM, BN]: the pre-activation
    a_desc,  # (M, N) out, block [BM, BN]: gelu_tanh of it
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PROGRAMS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    num_n = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * num_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m = tile // num_n
        pid_n = tile % num_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = x_desc.load([pid_m * BM, k0])
            w = w_desc.load([pid_n * BN, k0])
            if INTERPRETED:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w.T, acc)
        cols = pid_n * BN + tl.arange(0, BN)
        h = acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        s, _ = _sig2u(h)
        h_desc.store([pid_m * BM, pid_n * BN], to_dtype(h, h_desc.dtype, INTERPRETED))
        a_desc.store([pid_m * BM, pid_n * BN], to_dtype(h * s, a_desc.dtype, INTERPRETED))


@triton.jit
def dgelu_kernel(
    dy_desc,  # (M, K) block [BM, BK]
    w_desc,  # (K, N) block [BK, BN]
    h_desc,  # (M, N) block [BM, BN], when H_TMA
    h_ptr,  # (M, N) the same tensor, read through pointers otherwise
    dh_desc,  # (M, N) out, block [BM, BN]
    part_ptr,  # (cdiv(M, BM), N) fp32 out, when PARTS
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PROGRAMS: tl.constexpr,
    H_TMA: tl.constexpr,
    PARTS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    num_n = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * num_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m = tile // num_n
        pid_n = tile % num_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            dy = dy_desc.load([pid_m * BM, k0])
            w = w_desc.load([k0, pid_n * BN])
            if INTERPRETED:
                dy, w = dy.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(dy, w, acc)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        if H_TMA:  # rows past M read as 0 (their acc is 0 too: dy's rows past M are)
            h = h_desc.load([pid_m * BM, pid_n * BN]).to(tl.float32)
        else:
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            ptrs = h_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            h = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        s, du = _sig2u(h)
        dh = to_dtype(acc * (s + 2.0 * h * s * (1.0 - s) * du), dh_desc.dtype, INTERPRETED)
        dh_desc.store([pid_m * BM, pid_n * BN], dh)
        if PARTS:
            tl.store(part_ptr + pid_m * N + cols, tl.sum(dh.to(tl.float32), axis=0), mask=cols < N)


def _desc(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor  # triton >= 3.3

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _programs(tiles, device):
    return min(tiles, num_sms(device.index)) if device.type == "cuda" else tiles


def gelu_up(x, w, b, h, a):
    """Writes h = x @ w.T + b and a = gelu_tanh(h) into h, a (M, N); x (M, K), w (N, K), b (N,)
    in one 16-bit dtype (applies())."""
    M, K = x.shape
    N = w.shape[0]
    cuda = x.device.type == "cuda"
    cfg = LAUNCH["up"]["cuda" if cuda else "cpu"]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    programs = _programs(triton.cdiv(M, BM) * triton.cdiv(N, BN), x.device)
    gelu_up_kernel[(programs,)](
        _desc(x, [BM, BK]), _desc(w, [BN, BK]), b, _desc(h, [BM, BN]), _desc(a, [BM, BN]),
        M, N, K, BM=BM, BN=BN, BK=BK, PROGRAMS=programs, INTERPRETED=not cuda,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def dgelu_rows(M, device):
    """Rows of dgelu's partial sums for M rows of dh: one per row tile."""
    return triton.cdiv(M, LAUNCH["dgelu"]["cuda" if device.type == "cuda" else "cpu"]["BM"])


def dgelu(dy, w, h, dh, parts=None):
    """Writes dh = (dy @ w) * gelu_tanh'(h) into dh (M, N), and the column sums of each row
    tile of dh into parts (dgelu_rows(M), N) fp32 unless None; dy (M, K), w (K, N), h (M, N)
    in one 16-bit dtype (applies())."""
    M, K = dy.shape
    N = w.shape[1]
    cuda = dy.device.type == "cuda"
    cfg = LAUNCH["dgelu"]["cuda" if cuda else "cpu"]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    programs = _programs(triton.cdiv(M, BM) * triton.cdiv(N, BN), dy.device)
    dgelu_kernel[(programs,)](
        _desc(dy, [BM, BK]), _desc(w, [BK, BN]), _desc(h, [BM, BN]), h, _desc(dh, [BM, BN]),
        dh if parts is None else parts, M, N, K, BM=BM, BN=BN, BK=BK, PROGRAMS=programs,
        H_TMA=cfg["H_TMA"], PARTS=parts is not None, INTERPRETED=not cuda,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def gelu_up_reference(x, w, b):
    """(h, a) in torch, fp32 math, rounded to x's dtype once."""
    h = x.float() @ w.float().T + b.float()
    return h.to(x.dtype), F_gelu(h).to(x.dtype)


def F_gelu(h):
    return torch.nn.functional.gelu(h, approximate="tanh")


def dgelu_reference(dy, w, h):
    """dh in torch, fp32 math (torch's tanh-GELU backward), rounded to dy's dtype once."""
    hf = h.float().requires_grad_()
    g = dy.float() @ w.float()
    (dh,) = torch.autograd.grad(F_gelu(hf), hf, g)
    return dh.to(dy.dtype)
