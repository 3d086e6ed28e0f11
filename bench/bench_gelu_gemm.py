"""The MLP's GELU GEMMs: Triton (gpt2_fused/kernels/gelu_gemm.py) against cuBLASLt's epilogues.

    python -m bench.bench_gelu_gemm [--shapes 124M:16,1558M:16] [--repeats 3] [--configs all]

Per shape (M = micro-batch x 1024 rows, D, F = 4 D), GPU ms per call (CUDA events around 20
calls, the host hidden; medians of --repeats interleaved rounds):
- up: cuBLASLt GELU_AUX_BIAS (mlp.py's today) against gelu_gemm.gelu_up for each launch of
  UP_CONFIGS; a plain torch.mm of the same shape gives the rate a GEMM reaches without epilogue;
- dgelu: cuBLASLt DGELU + colsum (the bias gradient, as mlp.py's backward) against
  gelu_gemm.dgelu with its partial sums + colsum.row_sum, for each launch of DGELU_CONFIGS.
Errors: max |out - fp32 reference| / max |reference| (gelu_gemm's torch references), and the bias
gradient's against the fp32 sum of the reference dh.
"""

import argparse
import statistics

import torch

from bench.common import events
from gpt2_fused.kernels import gelu_gemm
from gpt2_fused.kernels.colsum import colsum, row_sum
from gpt2_fused.kernels.cublaslt import EPI_DGELU, EPI_GELU_AUX_BIAS, matmul
from gpt2_fused.kernels.device import launch_overrides

SHAPES = {"124M": 768, "350M": 1024, "774M": 1280, "1558M": 1600}
# (BM, BN, BK, num_warps, num_stages)
UP_CONFIGS = {
    "128x256x64 w8 s3": (128, 256, 64, 8, 3),
    "128x128x64 w8 s4": (128, 128, 64, 8, 4),
    "128x128x64 w4 s4": (128, 128, 64, 4, 4),
    "256x128x64 w8 s3": (256, 128, 64, 8, 3),
    "128x256x64 w8 s2": (128, 256, 64, 8, 2),
}
# (BM, BN, BK, num_warps, num_stages, H_TMA)
DGELU_CONFIGS = {
    "128x128x64 w8 s4 tma": (128, 128, 64, 8, 4, True),
    "128x128x64 w8 s4 ptr": (128, 128, 64, 8, 4, False),
    "128x256x64 w8 s3 ptr": (128, 256, 64, 8, 3, False),
    "128x256x64 w8 s2 tma": (128, 256, 64, 8, 2, True),
    "128x128x64 w4 s4 tma": (128, 128, 64, 4, 4, True),
    "256x128x64 w8 s3 ptr": (256, 128, 64, 8, 3, False),
}


def rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def compiles(name, fn, cases):
    """Runs fn once; a launch that does not compile (shared memory) is said and dropped."""
    try:
        fn()
        return True
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {str(e)[-300:]}")
        del cases[name]
        return False


def up_cases(M, D, F, configs):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(F, D, device="cuda", generator=g) / D**0.5).bfloat16()
    b = (torch.randn(F, device="cuda", generator=g) * 0.1).bfloat16()
    h = torch.empty(M, F, device="cuda", dtype=torch.bfloat16)
    a = torch.empty_like(h)
    h_ref, a_ref = gelu_gemm.gelu_up_reference(x, w, b)
    cases = {
        "torch.mm, no epilogue": (lambda: torch.mm(x, w.t()), None),
        "cuBLASLt GELU_AUX_BIAS": (
            lambda: matmul(x, w.t(), a, bias=b, aux=h, epilogue=EPI_GELU_AUX_BIAS), (h, a)),
    }  # fmt: skip
    for name, (BM, BN, BK, warps, stages) in configs.items():
        cfg = dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages)

        def run(cfg=cfg):
            with launch_overrides(gelu_gemm.LAUNCH["up"]["cuda"], **cfg):
                gelu_gemm.gelu_up(x, w, b, h, a)

        cases["triton " + name] = (run, (h, a))
    errs = {}
    for name, (fn, outs) in list(cases.items()):
        if outs is None:
            continue
        h.zero_(), a.zero_()
        if compiles(name, fn, cases):
            errs[name] = f"h {rel(h, h_ref):.1e}, a {rel(a, a_ref):.1e}"
    return {k: v[0] for k, v in cases.items()}, errs, 2 * M * D * F


def dgelu_cases(M, D, F, configs):
    g = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(D, F, device="cuda", generator=g) / D**0.5).bfloat16()
    h = torch.randn(M, F, device="cuda", generator=g).bfloat16()
    dh = torch.empty_like(h)
    ref = gelu_gemm.dgelu_reference(dy, w, h)
    db_ref = ref.float().sum(0)
    parts = torch.empty(gelu_gemm.dgelu_rows(M, dy.device), F, device="cuda")
    out = {}

    def cublaslt():
        matmul(dy, w, dh, aux=h, epilogue=EPI_DGELU)
        out["db"] = colsum(dh)

    cases = {"torch.mm, no epilogue": (lambda: torch.mm(dy, w), False),
             "cuBLASLt DGELU + colsum": (cublaslt, True)}  # fmt: skip
    for name, (BM, BN, BK, warps, stages, tma) in configs.items():
        cfg = dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages, H_TMA=tma)

        def run(cfg=cfg):
            with launch_overrides(gelu_gemm.LAUNCH["dgelu"]["cuda"], **cfg):
                p = parts[: gelu_gemm.dgelu_rows(M, dy.device)]
                gelu_gemm.dgelu(dy, w, h, dh, p)
                out["db"] = row_sum(p)

        cases["triton " + name + " + row_sum"] = (run, True)
    errs = {}
    for name, (fn, check) in list(cases.items()):
        if not check:
            continue
        dh.zero_()
        if compiles(name, fn, cases):
            errs[name] = f"dh {rel(dh, ref):.1e}, db {rel(out['db'], db_ref):.1e}"
    return {k: v[0] for k, v in cases.items()}, errs, 2 * M * D * F


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="124M:16,1558M:16", help="model:micro-batch, comma list")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="all", help='"all", or "first" (LAUNCH\'s own only)')
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    rows = []
    for spec in args.shapes.split(","):
        model, batch = spec.split(":")
        D = SHAPES[model]
        M, F = int(batch) * 1024, 4 * D
        up_cfg, dg_cfg = UP_CONFIGS, DGELU_CONFIGS
        if args.configs == "first":
            up_cfg = dict(list(UP_CONFIGS.items())[:1])
            dg_cfg = dict(list(DGELU_CONFIGS.items())[:1])
        for op, build, cfgs in (("up", up_cases, up_cfg), ("dgelu", dgelu_cases, dg_cfg)):
            try:
                cases, errs, flop = build(M, D, F, cfgs)
            except Exception as e:  # a launch that does not compile (shared memory): say so
                print(f"{spec} {op}: {type(e).__name__}: {str(e)[-600:]}")
                continue
            times = {name: [] for name in cases}
            for _ in range(args.repeats):
                for name, fn in cases.items():
                    try:
                        times[name].append(events(fn))
                    except Exception as e:
                        print(f"{spec} {op} {name}: {type(e).__name__}: {str(e)[-300:]}")
                        times[name].append(float("nan"))
            base = statistics.median(times[list(cases)[1]])
            for name in cases:
                ms = statistics.median(times[name])
                rows.append((spec, op, name, ms, flop / ms / 1e9, ms / base, errs.get(name, "")))
    print("\n| shape | op | method | ms | TFLOP/s | vs cuBLASLt | errors |")
    print("|---|---|---|---|---|---|---|")
    for spec, op, name, ms, tf, ratio, err in rows:
        print(f"| {spec} | {op} | {name} | {ms:.4f} | {tf:.0f} | {ratio:.3f} | {err} |")


if __name__ == "__main__":
    main()
