"""The logits GEMM with E in its epilogue (fused_loss/exp_gemm.py) against cuBLAS + the row pass.

    python -m bench.bench_exp_gemm [--repeats 3] [--configs all] [--e2e]

Part 1, one chunk (GPU ms, CUDA events around 20 launches, medians over --repeats interleaved
rounds): the cuBLAS logits GEMM alone (algorithm chosen by timing), that GEMM + exp_rows_kernel
(the single-read chunk where exp_gemm does not apply), and exp_gemm's start + finish for each
tile configuration of CONFIGS (exp_gemm.LAUNCH's first), at the chunk shapes of the 124M and
1558M classifiers with fp32 master weights (6554 and 3277 rows) and of the 124M one with bf16
weights (1725 rows). Also each configuration's error of G = f E against
exp_gemm.exp_logits_reference's fp32 math.
Part 2 (--e2e): fwd+bwd of fused_linear_cross_entropy with exp_gemm and with the cuBLAS logits
GEMM + exp_rows_kernel (fl.launch_settings(exp_gemm=False), as before Hopper), and torch.compile of
the reference, at the 124M and 1558M shapes, fp32 master weight under autocast, interleaved
--repeats times; GPU ms with the host's latency hidden.
"""

import argparse
import statistics

import torch
import triton

from bench.common import LOSS_SHAPES, FwdBwd, events, make_inputs, master_weight, timed
from fused_loss import (
    exp_gemm,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
    triton_kernels,
)
from fused_loss import linear_cross_entropy as fl
from gpt2_fused.kernels.launch import launch_overrides, num_sms

# (BM, BN, BK, num_warps, num_stages) of exp_gemm.LAUNCH["cuda"]: its own, then other tiles
CONFIGS = {
    "128x256x64 w8 s4": (128, 256, 64, 8, 4),
    "128x256x64 w8 s3": (128, 256, 64, 8, 3),
    "128x256x32 w8 s6": (128, 256, 32, 8, 6),
}
CHUNKS = {"124M master (6554 rows)": (6554, 768), "1558M master (3277 rows)": (3277, 1600),
          "124M bf16 w (1725 rows)": (1725, 768)}  # fmt: skip
V, VOCAB = 50304, 50257


def config(name):
    """exp_gemm.LAUNCH["cuda"] with CONFIGS[name]'s tiles and launch, for the block."""
    BM, BN, BK, warps, stages = CONFIGS[name]
    cfg = dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages)
    return launch_overrides(exp_gemm.LAUNCH["cuda"], **cfg)


def one_hot_out(e, f, h, y):
    """G = diag(f) e - diag(h) onehot(y), fp32 (the single read's G, triton_kernels.py)."""
    G = e * f[:, None]
    rows = torch.nonzero(h != 0)[:, 0]
    G[rows, y[rows]] -= h[rows]
    return G


def chunk_cases(n, D, configs):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) * (2.0 / D**0.5)).bfloat16()
    y = torch.randint(0, VOCAB, (n,), device="cuda", generator=g)
    y[::20] = -100
    gw = torch.full((1,), 1.0 / n, device="cuda")
    buf = torch.empty((n, V), device="cuda", dtype=torch.bfloat16)
    losses = torch.empty(n, device="cuda")
    f, h = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    cfg = fl.LAUNCH["cuda"]
    options = fl.row_kernel_options(cfg, cuda=True)
    programs = num_sms(0) * cfg["per_sm"]

    def cublas():
        fl.gemm(buf, x, w.t())

    def cublas_rows():  # as lce_pass launches it (mask_cols = V after the -inf fill)
        fl.gemm(buf, x, w.t())
        buf[:, VOCAB:].fill_(float("-inf"))
        triton_kernels.exp_rows_kernel[(min(n, programs),)](
            buf, y, gw, losses, f, h, n, V, VOCAB, V, buf.stride(0), -100,
            G_PER_ROW=False, WRITE_G=True, HOT=True, REBASE=fl.REBASE, BV=cfg["BV"],
            INTERPRETED=False,
            **options,
        )  # fmt: skip

    def epilogue(name):
        def run():
            with config(name):
                state = exp_gemm.scratch(n, V, x.device)
                exp_gemm.start(x, w, y, buf, state, vocab_size=VOCAB, ignore_index=-100)
                exp_gemm.finish(
                    buf, y, gw, state, losses, f, h, vocab_size=VOCAB, ignore_index=-100,
                    g_per_row=False, want_grad=True,
                )  # fmt: skip

        return run

    e_ref, f_ref, h_ref, loss_ref = exp_gemm.exp_logits_reference(
        x, w, y, gw, vocab_size=VOCAB, ignore_index=-100
    )
    g_ref = one_hot_out(e_ref, f_ref, h_ref, y)
    errors = {}
    for name in configs:
        try:
            epilogue(name)()
            torch.cuda.synchronize()
            G = one_hot_out(buf.float(), f, h, y)
            errors[name] = (
                ((G - g_ref).norm() / g_ref.norm()).item(),
                (losses - loss_ref).abs().max().item(),
            )
        except Exception as e:  # a configuration that does not compile or fit: report it
            errors[name] = repr(e)[:120]
    del e_ref, g_ref
    cases = {"cuBLAS GEMM": cublas, "cuBLAS GEMM + exp_rows_kernel": cublas_rows}
    cases.update({name: epilogue(name) for name in configs if not isinstance(errors[name], str)})
    return cases, errors, 2 * n * D * V


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="all")
    ap.add_argument("--e2e", action="store_true")
    args = ap.parse_args()
    configs = list(CONFIGS) if args.configs == "all" else args.configs.split(";")
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for label, (n, D) in CHUNKS.items():
        cases, errors, flop = chunk_cases(n, D, configs)
        times = {k: [] for k in cases}
        for _ in range(args.repeats):
            for k, fn in cases.items():
                times[k].append(events(fn))
        print(f"\n{label}, D {D}: ms per chunk (median of {args.repeats}), TFLOP/s of the GEMM")
        print("| case | ms | TFLOP/s | err G | err loss |")
        print("|---|---|---|---|---|")
        for k, ts in times.items():
            ms = statistics.median(ts)
            err = errors.get(k, ("", ""))
            e = f"{err[0]:.1e} | {err[1]:.1e}" if err[0] != "" else " | "
            print(f"| {k} | {ms:.4f} | {flop / ms / 1e9:.0f} | {e} |")
        for k, err in errors.items():
            if isinstance(err, str):
                print(f"| {k} | failed: {err} | | | |")
    if not args.e2e:
        return
    compiled = torch.compile(linear_cross_entropy_reference)
    for shape in ("124M", "1558M"):
        x, w, t = make_inputs(*LOSS_SHAPES[shape])
        t = t.clamp(max=VOCAB - 1)
        w32 = w.float()

        def ours(a, b, c):
            return fused_linear_cross_entropy(a, b, c, vocab_size=VOCAB)

        runs = {
            "torch.compile": (FwdBwd(master_weight(compiled), x, w32, t), True),
            "ours, cuBLAS logits GEMM": (FwdBwd(master_weight(ours), x, w32, t), False),
            "ours, exp_gemm": (FwdBwd(master_weight(ours), x, w32, t), True),
        }
        times = {k: [] for k in runs}
        for _ in range(args.repeats):
            for k, (run, epilogue) in runs.items():
                with fl.launch_settings(exp_gemm=epilogue):  # False: as before Hopper
                    times[k].append(timed(run, 10, hide_host=True))
        print(f"\n{shape}, fp32 master w under autocast: fwd+bwd GPU ms per repeat")
        print("| case | GPU ms |")
        print("|---|---|")
        for k, ts in times.items():
            print(f"| {k} | {' / '.join(f'{v:.2f}' for v in ts)} |")


if __name__ == "__main__":
    main()
