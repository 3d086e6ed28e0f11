"""Do cuBLASLt's candidates rank the same on a cool GPU (how cublaslt._fastest picks: 5 calls x 2
rounds) and under the 700 W limit (each candidate timed over 60 calls right after ~1 s of a
large GEMM loop)? For the epilogue GEMMs of the MLP and the residual projections at 124M:64 and
1558M:16 shapes. GPU ms a call. A probe, not kept.
    PYTHONPATH=. python3 bench/results/s24/probe_heated.py"""

import time

import torch

from gpt2_fused.kernels import cublaslt
from gpt2_fused.kernels.cublaslt import EPI_DGELU, EPI_GELU_AUX_BIAS, matmul
from gpt2_fused.kernels.mlp import linear_add

ROWS = []


def heat(seconds=1.0):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def ms_per_call(run, reps):
    """bench.common.events without its GPU sleep in front, which would let the card cool."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        run()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def fastest_both(runs, key, reps=5, rounds=2):
    """cublaslt._fastest's pick, with each candidate also timed heated (recorded in ROWS)."""
    pick = ORIGINAL(runs, key, reps, rounds)
    cool = cublaslt.TUNING[key]
    hot = []
    for run, t in zip(runs, cool, strict=True):
        if t == float("inf"):  # refused by cuBLASLt
            hot.append(t)
            continue
        heat()
        run()
        hot.append(ms_per_call(run, 60))
    ROWS.append((cool, hot, pick))
    return pick


ORIGINAL = cublaslt._fastest


def rnd(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.1


def gemms(M, C):
    """name -> a call that makes cublaslt tune (and so time) one GEMM of the layer."""
    F = 4 * C
    x, a, h = rnd(M, C), rnd(M, F), rnd(M, F)
    up = (x, rnd(F, C).t(), torch.empty_like(a))
    return {
        "c_fc GELU_AUX_BIAS": lambda: matmul(
            *up, bias=rnd(F), aux=torch.empty_like(h), epilogue=EPI_GELU_AUX_BIAS
        ),
        "c_proj dx DGELU": lambda: matmul(
            rnd(M, C), rnd(C, F), torch.empty_like(h), aux=h, epilogue=EPI_DGELU
        ),  # fmt: skip
        "mlp c_proj + residual": lambda: linear_add(a, rnd(C, F), rnd(C), rnd(M, C)),
        "attn c_proj + residual": lambda: linear_add(x, rnd(C, C), rnd(C), rnd(M, C)),
    }


def main():
    cublaslt._fastest = fastest_both
    torch.manual_seed(0)
    for name, M, C in (("124M:64", 65536, 768), ("1558M:16", 16384, 1600)):
        for gname, fn in gemms(M, C).items():
            ROWS.clear()
            fn()
            for cool, hot, pick in ROWS:
                best_hot = min(range(len(hot)), key=hot.__getitem__)
                print(f"{name} {gname}: pick {pick} (cool {cool[pick]:.4f}, hot {hot[pick]:.4f}); "
                      f"hot best {best_hot} ({hot[best_hot]:.4f}, {hot[best_hot] / hot[pick]:.3f}x)"
                      f"; cool {' '.join(f'{t:.4f}' for t in cool)}; "
                      f"hot {' '.join(f'{t:.4f}' for t in hot)}")  # fmt: skip


if __name__ == "__main__":
    main()
