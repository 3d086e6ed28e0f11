"""LayerNorm with its output's FP8 copy made in the same pass (gpt2_fused/kernels/ln_fp8.py)
against what a separate cast costs after Inductor's LayerNorm: issue 56's first fusion, timed.

    python -m bench.bench_ln_fp8 [--rows 16384] [--width 1600] [--out DIR]

Rows x width default to 1558M:16 (16 x 1024 tokens, n_embd 1600), bf16 input. Variants, each
GPU time per call (events, the host hidden), and the bytes it moves as GB/s:
    inductor_ln              torch.compile(F.layer_norm): the default path's LayerNorm, bf16 out
    inductor_ln_dynamic8     + amax, scale and e4m3 cast of the output (torchao's tensorwise
                             dynamic scaling, compiled)
    inductor_ln_rowwise8     + a row's amax, scale and cast (rowwise, compiled)
    ln_fp8_tensorwise        ours, bf16 y + e4m3 copy with a given scale + amax, one pass
    ln_fp8_tensorwise_no_y   ours, the e4m3 copy alone (when nothing else reads y)
    ln_fp8_rowwise           ours, bf16 y + e4m3 copy, one scale a row
Each of ours is first checked against ln_fp8_reference on the same input.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

from bench.common import events
from gpt2_fused.kernels.ln_fp8 import E4M3_MAX, ln_fp8, ln_fp8_reference

EPS = 1e-5


def compiled_variants(w, b):
    def ln(x):
        return F.layer_norm(x, (x.shape[-1],), w, b, EPS).to(x.dtype)

    def dynamic8(x):
        y = ln(x)
        s = E4M3_MAX / y.abs().amax().float().clamp(min=1e-12)
        return y, (y.float() * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), 1 / s

    def rowwise8(x):
        y = ln(x)
        s = E4M3_MAX / y.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
        return y, (y.float() * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), 1 / s

    return {
        "inductor_ln": torch.compile(ln),
        "inductor_ln_dynamic8": torch.compile(dynamic8),
        "inductor_ln_rowwise8": torch.compile(rowwise8),
    }


def check(x, w, b):
    """ours against the reference on x; raises where they differ beyond an e4m3 step."""
    scale, amax = torch.tensor([8.0], device=x.device), torch.zeros(1, device=x.device)
    for kw in (dict(scale=scale, amax=amax), {}):
        got = ln_fp8(x, w, b, EPS, **kw)
        ref = ln_fp8_reference(x, w, b, EPS, scale=kw.get("scale"))
        torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)
        step = ref[1].float().abs() * 2**-3 + 2**-9
        assert ((got[1].float() - ref[1].float()).abs() <= step).all(), kw.keys()
    torch.testing.assert_close(amax[0], ref_amax(x, w, b), rtol=1e-5, atol=0)


def ref_amax(x, w, b):
    return ln_fp8_reference(x, w, b, EPS, scale=torch.ones(1, device=x.device))[3]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    M, D = args.rows, args.width
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    w = 1 + 0.1 * torch.randn(D, device="cuda", generator=g)
    b = 0.1 * torch.randn(D, device="cuda", generator=g)
    check(x, w, b)
    scale, amax = torch.tensor([8.0], device="cuda"), torch.zeros(1, device="cuda")
    variants = compiled_variants(w, b) | {
        "ln_fp8_tensorwise": lambda x: ln_fp8(x, w, b, EPS, scale=scale, amax=amax),
        "ln_fp8_tensorwise_no_y": lambda x: ln_fp8(x, w, b, EPS, scale=scale, amax=amax,
                                                   store_y=False),
        "ln_fp8_rowwise": lambda x: ln_fp8(x, w, b, EPS),
    }  # fmt: skip
    written = {  # bytes a call must move at least: read x (2 B), write y (2 B) and/or y8 (1 B)
        "inductor_ln": 4, "inductor_ln_dynamic8": 5, "inductor_ln_rowwise8": 5,
        "ln_fp8_tensorwise": 5, "ln_fp8_tensorwise_no_y": 3, "ln_fp8_rowwise": 5,
    }  # fmt: skip
    rows = {}
    for name, fn in variants.items():
        ms = min(events(lambda fn=fn: fn(x)) for _ in range(3))
        rows[name] = dict(ms=ms, gb_per_s=written[name] * M * D / ms / 1e6)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {M} x {D} bf16")
    print(
        "| variant | ms | GB/s (bytes it must move) | vs inductor_ln_dynamic8 |\n|---|---|---|---|"
    )
    base = rows["inductor_ln_dynamic8"]["ms"]
    for name, r in rows.items():
        print(f"| {name} | {r['ms']:.4f} | {r['gb_per_s']:,.0f} | {base / r['ms']:.2f}x |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_ln_fp8.json"), "w") as f:
            json.dump(dict(rows=M, width=D, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
