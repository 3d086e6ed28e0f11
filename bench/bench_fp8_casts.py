"""The FP8 casts made where the data is (gpt2_fused/kernels/ln_fp8.py, act_fp8.py) against the
same casts after an unfused producer, compiled by Inductor: what each fusion of issue 56 saves.

    python -m bench.bench_fp8_casts [--tokens 16384] [--width 1600] [--out DIR]

Shapes default to 1558M:16 (16 x 1024 tokens, n_embd 1600, MLP 6400), bf16 inputs. Each row:
GPU time per call (CUDA events, the host hidden), the bytes the variant must move at least, as
GB/s, and its time against the unfused path that makes the same operands. Every fused kernel is
first checked against its torch reference on the same inputs. The unfused paths are
torch.compile'd torch code with dynamic (just-in-time) tensorwise scaling, as torchao's:
    ln:     LayerNorm -> y (bf16), the e4m3 copy of y          (c_attn's and c_fc's input)
    gelu:   gelu(h) -> a8 (e4m3) and a8^T                      (the MLP's c_proj, fwd and dW)
    dgelu:  g * gelu'(h) -> dh8 (e5m2), dh8^T, its column sums  (c_fc's dgrad, dW, db)
    copy:   dout -> e5m2, its transpose, its column sums       (c_proj's dgrad, dW, db)
"""

import functools

import torch
import torch.nn.functional as F

from bench.common import events, write_json, xl_shape_args
from gpt2_fused.kernels.act_fp8 import FP8_MAX, act_fp8, act_fp8_reference
from gpt2_fused.kernels.fp8_gemm import Fp8State
from gpt2_fused.kernels.ln_fp8 import ln_fp8, ln_fp8_reference

EPS = 1e-5
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def dynamic_cast(t, fp8, transposed):
    """torchao-style tensorwise dynamic scaling: the amax of t, then the cast (and transpose)."""
    s = FP8_MAX[fp8] / t.abs().amax().float().clamp(min=1e-12)
    q = (t.float() * s).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    return (q, q.t().contiguous(), 1 / s) if transposed else (q, 1 / s)


def unfused(w, b):
    """name -> compiled torch function of the inputs."""

    def ln(x):
        return F.layer_norm(x, (x.shape[-1],), w, b, EPS).to(x.dtype)

    def gelu(h):
        return F.gelu(h.float(), approximate="tanh").to(h.dtype)

    def dgelu(g, h):
        u = 0.7978845608028654 * (h.float() + 0.044715 * h.float() ** 3)
        t = torch.tanh(u)
        du = 0.7978845608028654 * (1 + 3 * 0.044715 * h.float() ** 2)
        return (g.float() * (0.5 * (1 + t) + 0.5 * h.float() * (1 - t * t) * du)).to(g.dtype)

    return {
        "ln: LayerNorm (bf16 out, no cast)": (torch.compile(ln), "x"),
        "ln: LayerNorm + dynamic e4m3 cast": (
            torch.compile(lambda x: (ln(x), *dynamic_cast(ln(x), E4, False))), "x"),
        "gelu: GELU + dynamic e4m3 cast + transpose": (
            torch.compile(lambda h: dynamic_cast(gelu(h), E4, True)), "h"),
        "dgelu: GELU grad + dynamic e5m2 cast + transpose + bias sum": (
            torch.compile(lambda g, h: (*dynamic_cast(dgelu(g, h), E5, True),
                                        dgelu(g, h).float().sum(0))), "gh"),
        "copy: dynamic e5m2 cast + transpose + bias sum": (
            torch.compile(lambda g: (*dynamic_cast(g, E5, True), g.float().sum(0))), "d"),
    }  # fmt: skip


def check(x, w, b, h, g):
    """Each fused kernel against its reference; AssertionError where an e4m3/e5m2 value is more
    than one step off (beyond a few in 10^4 near rounding ties: bf16 inputs, fp32 math). The
    transposed copy made in the kernel, for each way of storing it (act_fp8.store_transposed)
    and with a given or a delayed scale: {"mode how=H scale|delayed": bytes of qt that are not
    q^T's}, printed, not asserted (Triton's bundled ptxas gets some wrong,
    triton-lang/triton#11111: act_fp8 splits them off, kernel_transposes_right)."""
    s, amax = torch.tensor([8.0], device="cuda"), torch.zeros(1, device="cuda")
    _, y8, *_ = ln_fp8(x, w, b, EPS, scale=s, amax=amax, store_y=False)
    ref = ln_fp8_reference(x, w, b, EPS, scale=s)[1]
    assert (y8.float() != ref.float()).float().mean() < 1e-3
    wrong = {}
    for mode, fp8, kw in (("gelu", E4, dict(h=h)), ("dgelu", E5, dict(h=h, g=g)),
                          ("copy", E5, dict(g=g))):  # fmt: skip
        sc = torch.tensor([4.0 if fp8 == E4 else 2.0**12], device="cuda")
        for how in (0, 2):
            q, qt = act_fp8(mode, sc, torch.zeros(1, device="cuda"), fp8=fp8, transposed=True,
                            how=how, split=False, **kw)  # fmt: skip
            rq = act_fp8_reference(mode, sc, fp8=fp8, **kw)[1]
            assert (q.float() != rq.float()).float().mean() < 1e-3, mode
            bad = (qt.view(torch.uint8) != q.view(torch.uint8).t()).sum().item()
            wrong[f"{mode} how={how} scale"] = bad
            state = Fp8State("cuda", ["t"])  # a delayed scale: the dry run, then two casts
            cast = functools.partial(act_fp8, mode, fp8=fp8, transposed=True, how=how,
                                     split=False, **kw)  # fmt: skip
            for _ in range(2):
                _, (q, qt) = state.cast("t", lambda dl, cast=cast: cast(delayed=dl))
            bad = (qt.view(torch.uint8) != q.view(torch.uint8).t()).sum().item()
            wrong[f"{mode} how={how} delayed"] = bad
    print("bytes of q^T wrong:", wrong)
    return wrong


def main():
    args = xl_shape_args(__doc__)
    M, D = args.tokens, args.width
    F4 = 4 * D
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    h = torch.randn(M, F4, device="cuda", generator=gen).bfloat16()
    g = (torch.randn(M, F4, device="cuda", generator=gen) * 1e-3).bfloat16()
    d = g[:, :D].contiguous()
    w = 1 + 0.1 * torch.randn(D, device="cuda", generator=gen)
    b = 0.1 * torch.randn(D, device="cuda", generator=gen)
    wrong = check(x, w, b, h, g)
    inputs = {"x": (x,), "h": (h,), "gh": (g, h), "d": (d,)}
    s4, s5 = torch.tensor([8.0], device="cuda"), torch.tensor([2.0**12], device="cuda")
    amax = torch.zeros(1, device="cuda")
    fused = {
        "ln: ln_fp8, bf16 y + e4m3 copy": (
            lambda x: ln_fp8(x, w, b, EPS, scale=s4, amax=amax), "x"),
        "ln: ln_fp8, e4m3 copy only": (
            lambda x: ln_fp8(x, w, b, EPS, scale=s4, amax=amax, store_y=False), "x"),
        "ln: ln_fp8 rowwise, bf16 y + e4m3 copy": (lambda x: ln_fp8(x, w, b, EPS), "x"),
        "gelu: act_fp8 gelu, e4m3 + transpose": (
            lambda h: act_fp8("gelu", s4, amax, h=h, transposed=True, how=0, split=False), "h"),
        "gelu: the same, 128 x 64 tiles": (
            lambda h: act_fp8("gelu", s4, amax, h=h, transposed=True, block=(128, 64)), "h"),
        "gelu: the same, 64 x 128 tiles": (
            lambda h: act_fp8("gelu", s4, amax, h=h, transposed=True, block=(64, 128)), "h"),
        "gelu: the same, read back (how=2)": (
            lambda h: act_fp8("gelu", s4, amax, h=h, transposed=True, how=2, split=False), "h"),
        "gelu: the same, split (transpose_fp8 after)": (
            lambda h: act_fp8("gelu", s4, amax, h=h, transposed=True, split=True), "h"),
        "gelu: act_fp8 gelu, e4m3, no transpose": (
            lambda h: act_fp8("gelu", s4, amax, h=h), "h"),
        "dgelu: act_fp8 dgelu, e5m2 + transpose + bias sum": (
            lambda g, h: act_fp8("dgelu", s5, amax, h=h, g=g, fp8=E5, transposed=True, sums=True,
                                 how=0, split=False), "gh"),
        "dgelu: the same, read back (how=2)": (
            lambda g, h: act_fp8("dgelu", s5, amax, h=h, g=g, fp8=E5, transposed=True, sums=True,
                                 how=2, split=False), "gh"),
        "dgelu: the same, split (transpose_fp8 after)": (
            lambda g, h: act_fp8("dgelu", s5, amax, h=h, g=g, fp8=E5, transposed=True, sums=True,
                                 split=True), "gh"),
        "copy: act_fp8 copy, e5m2 + transpose + bias sum": (
            lambda d: act_fp8("copy", s5, amax, g=d, fp8=E5, transposed=True, sums=True), "d"),
    }  # fmt: skip
    moved = {  # bytes an element at least: reads of bf16 inputs (2 B each), writes
        "ln: LayerNorm (bf16 out, no cast)": 4, "ln: LayerNorm + dynamic e4m3 cast": 5,
        "ln: ln_fp8, bf16 y + e4m3 copy": 5, "ln: ln_fp8, e4m3 copy only": 3,
        "ln: ln_fp8 rowwise, bf16 y + e4m3 copy": 5,
        "gelu: GELU + dynamic e4m3 cast + transpose": 4, "gelu: act_fp8 gelu, e4m3 + transpose": 4,
        "gelu: the same, 128 x 64 tiles": 4, "gelu: the same, 64 x 128 tiles": 4,
        "gelu: the same, read back (how=2)": 4,
        "gelu: the same, split (transpose_fp8 after)": 4,
        "gelu: act_fp8 gelu, e4m3, no transpose": 3,
        "dgelu: GELU grad + dynamic e5m2 cast + transpose + bias sum": 6,
        "dgelu: act_fp8 dgelu, e5m2 + transpose + bias sum": 6,
        "dgelu: the same, read back (how=2)": 6, "dgelu: the same, split (transpose_fp8 after)": 6,
        "copy: dynamic e5m2 cast + transpose + bias sum": 4,
        "copy: act_fp8 copy, e5m2 + transpose + bias sum": 4,
    }  # fmt: skip
    numel = {"x": M * D, "h": M * F4, "gh": M * F4, "d": M * D}
    rows = {}
    for name, (fn, key) in (unfused(w, b) | fused).items():
        ms = min(events(lambda fn=fn, key=key: fn(*inputs[key])) for _ in range(3))
        rows[name] = dict(ms=ms, gb_per_s=moved[name] * numel[key] / ms / 1e6)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: {M} tokens, width {D}")
    print("| operand: variant | ms | GB/s (least bytes) |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ms']:.4f} | {r['gb_per_s']:,.0f} |")
    write_json(args.out, "bench_fp8_casts.json", dict(tokens=M, width=D, results=rows,
                                                      transposed_bytes_wrong=wrong))  # fmt: skip


if __name__ == "__main__":
    main()
