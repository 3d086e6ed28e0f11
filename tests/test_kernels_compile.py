"""The Triton kernels compile for Hopper (sm_90) on any machine, GPU or not.

The Triton wheel ships ptxas, so a CPU-only CI can run the real compiler down to a cubin. That
catches what the interpreter lets through (a kernel reading a plain Python global, say, which the
interpreter allows and the compiler rejects) and checks the generated code: the row kernels'
loads of the bf16 logits must be vectorised at the real, odd vocabulary size (50257). Loads
masked at 50257 compiled to scalar 16-bit loads and cost ~0.6 ms per 124M call on the H200.
The compile runs in a subprocess without TRITON_INTERPRET, which conftest.py sets for this one.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_loss import triton_kernels as kernels

TARGET = GPUTarget("cuda", 90, 32)
ROW_ARGS = ["z_ptr", "y_ptr", "g_ptr", "loss_ptr"]
ROW_INTS = ["n_rows", "V", "vocab_size", "mask_cols", "stride_z", "ignore_index"]
# As a launch at the 124M shape specialises them: pointers 16-byte aligned, V = 50304, D = 768
# and the row stride divisible by 16; vocab_size = mask_cols = 50257 and n_rows not.
DIV16 = {"V", "D", "stride_z", "numel", "K"}


def build(fn, sig, consts, num_warps):
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in DIV16}
    sig = dict(sig, **{k: "constexpr" for k in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps)).asm["ptx"]
    v4 = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx))
    b16 = len(re.findall(r"ld\.global(?:\.\w+)*\.b16 ", ptx))
    return v4, b16


# _softmax_grad_kernel's options (bias, softcap, ...), after its ints; off unless a key says
OPTION_ARGS = {"b_ptr": "*fp32", "lse_ptr": "*fp32", "softcap": "fp32", "z_loss": "fp32",
               "smoothing": "fp32"}
OPTIONS_OFF = dict(HAS_BIAS=False, SOFTCAP=False, Z_LOSS=False, SMOOTH=False, WRITE_LSE=False)


def row_sig(dt, single):
    types = [f"*{dt}", "*i64", "*fp32", "*fp32"] + (["*fp32", "*fp32"] if single else [])
    names = ROW_ARGS + (["f_ptr", "h_ptr"] if single else [])
    sig = dict(zip(names + ROW_INTS, types + ["i32"] * len(ROW_INTS)))
    return sig if single else sig | OPTION_ARGS


out = {}
for write_g in (True, False):
    for dt in ("bf16", "fp32"):
        c = dict(G_PER_ROW=not write_g, WRITE_G=write_g, BV=4096, INTERPRETED=False)
        orders = ("", "pass1_back", "pass2_back") if write_g and dt == "bf16" else ("",)
        for o in orders:
            back = dict(PASS1_BACK=o == "pass1_back", PASS2_BACK=o == "pass2_back")
            out[f"softmax_grad {dt} write_g={write_g} {o}".strip()] = build(
                kernels._softmax_grad_kernel, row_sig(dt, False), dict(c, **back, **OPTIONS_OFF),
                8)
        if write_g and dt == "bf16":  # every option on
            on = {k: True for k in OPTIONS_OFF}
            out["softmax_grad bf16 options"] = build(
                kernels._softmax_grad_kernel, row_sig(dt, False), dict(c, **on, PASS1_BACK=True,
                PASS2_BACK=False), 8)
        c["REBASE"] = 60.0
        for hot in (False, True) if write_g else (False,):  # the one-hot out of E or folded in
            out[f"exp_rows {dt} write_g={write_g} hot={hot}"] = build(
                kernels._exp_rows_kernel, row_sig(dt, True), dict(c, HOT=hot), 8)
for src in ("fp32", "bf16"):
    sig = {"src_ptr": f"*{src}", "f_ptr": "*fp32", "out_ptr": "*bf16", "w_ptr": "*bf16",
           "y_ptr": "*i64", "h_ptr": "*fp32", "D": "i32"}
    consts = dict(HOT=src == "fp32", BD=256, INTERPRETED=False)
    out[f"row_scale {src}"] = build(kernels._row_scale_kernel, sig, consts, 4)
from fused_loss import linear_cross_entropy as fl
hot_cfg = fl.LAUNCH["cuda"]
blk = dict(R=hot_cfg["one_hot_rows"], BD=hot_cfg["one_hot_cols"])
ptrs = {"acc_ptr": "*fp32", "part_ptr": "*fp32", "x_ptr": "*bf16", "ys_ptr": "*i32",
        "order_ptr": "*i64", "h_ptr": "*fp32"}
ints = {n: "i32" for n in ("N", "D", "a", "b")}
out["one_hot pieces"] = build(kernels._one_hot_pieces_kernel, ptrs | ints, blk, 4)
ptrs = {"acc_ptr": "*fp32", "part_ptr": "*fp32", "ys_ptr": "*i32"}
out["one_hot runs"] = build(kernels._one_hot_runs_kernel, ptrs | ints | {"blocks": "i32"},
                            dict(blk, S=hot_cfg["one_hot_steps"]), 4)
for dt in ("bf16", "fp32"):
    sig = {"src_ptr": f"*{dt}", "g_ptr": "*fp32", "dst_ptr": f"*{dt}", "numel": "i32"}
    out[f"scale {dt}"] = build(kernels._scale_kernel, sig, dict(BLOCK=4096, INTERPRETED=False), 4)
from fused_loss import gemv
for k in (1600, 6400):  # the decoding GEMV at 1558M's K (multiples of 16), launched with PDL
    sig = {f"{n}_ptr": "*bf16" for n in ("x", "w", "b", "r", "ln_w", "ln_b", "y", "k", "v")}
    sig |= {"pos_ptr": "*i64", "N": "i32", "eps": "fp32", "stride_head": "i32"}
    consts = dict(K=k, KP=triton.next_power_of_2(k), BLOCK_N=gemv.ELEMENTS // 2048 if k == 1600
                  else 1, HAS_BIAS=True, LN=k == 1600, LN_BIAS=True, GELU=k == 1600,
                  RESIDUAL=k == 6400, KV=k == 1600, HEAD=64, PDL=True, INTERPRETED=False)
    out[f"gemv bf16 K={k}"] = build(gemv._gemv_kernel, sig, consts, gemv.NUM_WARPS)
print(json.dumps(out))
"""


def _has_nvidia_backend():
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


def _compile_for_sm90(script):
    """Run one of the scripts above in a subprocess without TRITON_INTERPRET (so triton compiles
    for real) and return the JSON its last line prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when unset; 1 is its default
    p = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this Triton has no NVIDIA backend")
def test_kernels_compile_for_sm90_with_vectorised_logit_loads():
    loads = _compile_for_sm90(SCRIPT)
    assert len(loads) == 21
    for name, (v4, b16) in loads.items():
        if name.startswith("gemv"):  # the weight rows: 16-byte loads
            assert v4 >= 1, (name, v4, b16)
        if name.startswith(("softmax_grad bf16", "exp_rows bf16")):
            # every pass over a row of bf16 logits: 8-wide loads, no 16-bit scalar ones left
            # beyond a couple of single-element reads (the target's logit)
            assert v4 >= 2 and b16 <= 4, (name, v4, b16)


# ptxas -v on a PTX text: its report (registers, spills), for the scripts below
PTXAS_V = r"""
import os, subprocess, tempfile
from triton.backends.nvidia.compiler import get_ptxas


def ptxas_v(ptx):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        info = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", path, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True)
    return info.stdout + info.stderr
"""


# The default launch of both row kernels (fused.row_kernel_setup, as lce_pass calls it), compiled
# and assembled by ptxas -v: its registers per thread must let LAUNCH' per_sm programs of
# num_warps warps fit on one SM, the residency the persistent grid is sized for.
RESIDENCY = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import fused_loss.linear_cross_entropy as fl
from fused_loss import triton_kernels as kernels

cfg, V = fl.LAUNCH["cuda"], 50304
ints = ["n_rows", "V", "vocab_size", "mask_cols", "stride_z", "ignore_index"]
out = {}
for vocab in (50304, 50257):
    options, order, fill, mask_cols = fl.row_kernel_setup(cfg, True, vocab, V)
    div16 = {"V": V, "stride_z": V, "vocab_size": vocab, "mask_cols": mask_cols}
    for single in (False, True):
        ptrs = ["*bf16", "*i64", "*fp32", "*fp32"] + (["*fp32", "*fp32"] if single else [])
        names = ["z_ptr", "y_ptr", "g_ptr", "loss_ptr", "f_ptr", "h_ptr"][:len(ptrs)]
        sig = dict(zip(names + ints,
                       ptrs + ["i32"] * len(ints)))
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
                 if sig[n].startswith("*") or div16.get(n, 1) % 16 == 0}
        consts = dict(G_PER_ROW=False, WRITE_G=True, BV=cfg["BV"], INTERPRETED=False)
        consts.update(dict(REBASE=fl.REBASE, HOT=True) if single else order)
        if not single:  # the options, off
            sig |= {"b_ptr": "*fp32", "lse_ptr": "*fp32", "softcap": "fp32", "z_loss": "fp32",
                    "smoothing": "fp32"}
            consts |= dict(HAS_BIAS=False, SOFTCAP=False, Z_LOSS=False, SMOOTH=False,
                           WRITE_LSE=False)
        fn = kernels._exp_rows_kernel if single else kernels._softmax_grad_kernel
        src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}),
                        constexprs=consts, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        info = ptxas_v(ptx)
        regs = re.search(r"Used (\d+) registers", info)
        name = ("exp_rows" if single else "softmax_grad") + f" vocab {vocab}"
        out[name] = int(regs.group(1)) if regs else info[-500:]
limit = 65536 // (32 * cfg["num_warps"] * cfg["per_sm"])
print(json.dumps(dict(registers=out, limit=limit)))
"""


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this Triton has no NVIDIA backend")
def test_default_row_kernel_launch_keeps_its_programs_resident():
    """Above the limit only some of the per_sm programs fit at once and the rest run as a second
    wave: on the H200 that cost 0.4-1.1 ms per 124M call (bench/RESULTS.md, session 12)."""
    res = _compile_for_sm90(PTXAS_V + RESIDENCY)
    assert len(res["registers"]) == 4
    for name, regs in res["registers"].items():
        assert isinstance(regs, int), (name, regs)  # else ptxas's own words
        assert regs <= res["limit"], (name, regs, res["limit"])


# MultiTensorAdamW's kernels read every tensor through a table of raw addresses, which hides
# their alignment from the compiler: ALIGNED=True restores it (tl.multiple_of). Without it the
# loads are 4 bytes wide; with it they must be 16 (p, g, m, v: 4 per thread each at BLOCK=4096).
ADAMW = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_loss import adamw

def build(fn, sig, aligned):
    consts = dict(BLOCK=adamw.BLOCK, ALIGNED=aligned)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n][0] == "*"}
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}),
                    constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=adamw.NUM_WARPS)).asm["ptx"]
    return [len(re.findall(rf"{op}\.global(?:\.\w+)*\.v4\.b32", ptx)) for op in ("ld", "st")]

tables = dict(ptrs="*i64", numels="*i64")
blocks = dict(block_tensor="*i32", block_start="*i64")
step = dict(tables, wds="*fp32", **blocks, scale_ptr="*fp32", T="i32",
            **{k: "fp32" for k in ("lr", "beta1", "beta2", "eps", "step_size", "bc2_sqrt")})
norm = dict(tables, **blocks, partial="*fp32", T="i32")
print(json.dumps({f"{name} {aligned}": build(fn, sig, aligned)
                  for name, fn, sig in (("adamw", adamw._adamw_kernel, step),
                                        ("sumsq", adamw._sumsq_kernel, norm))
                  for aligned in (True, False)}))
"""


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this Triton has no NVIDIA backend")
def test_adamw_kernels_compile_with_16_byte_accesses():
    got = _compile_for_sm90(ADAMW)
    assert got == {
        "adamw True": [16, 12],  # p, g, m, v loaded; p, m, v stored
        "adamw False": [0, 0],
        "sumsq True": [4, 0],
        "sumsq False": [0, 0],
    }


# exp_gemm's logits GEMM at its CUDA launch: a Hopper matrix kernel must issue wgmma (mma.sync
# would be the slower path) and load its tiles through TMA; its shared memory (the pipeline's
# stages and the staging of E's TMA store) must fit the 227 KiB a Hopper block may take.
EXP_GEMM = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_loss import exp_gemm

TARGET = GPUTarget("cuda", 90, 32)
cfg = exp_gemm.LAUNCH["cuda"]
BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
sig = {"x_desc": f"tensordesc<bf16[{BM},{BK}]>", "w_desc": f"tensordesc<bf16[{BN},{BK}]>",
       "e_desc": f"tensordesc<bf16[{BM},{BN}]>", "e_ptr": "*bf16", "c_ptr": "*fp32",
       "y_ptr": "*i64", "s_ptr": "*fp32", "k_ptr": "*i32", "b_ptr": "*fp32", "softcap": "fp32"}
sig |= {n: "i32" for n in ("n_rows", "V", "D", "vocab_size", "ignore_index")}


def assembled(ptx):
    # ptxas -v's spill counts (spilled registers go to local memory, slow in the epilogue) and
    # whether it serialised the wgmmas (C7514: each MMA waited for before the next is issued)
    info = ptxas_v(ptx)
    found = re.findall(r"(\d+) bytes spill stores", info)
    return (sum(int(v) for v in found) if found else info[-300:]), "serialized" in info


out = {}
for options in (False, True):  # the default, and a bias and softcap in the epilogue
    consts = dict(REBASE=exp_gemm.REBASE, HAS_BIAS=options, SOFTCAP=options, ALL_ROWS=options,
                  BM=BM, BN=BN, BK=BK,
                  PROGRAMS=132, FLATTEN=cfg["flatten"], TMA_STORE=cfg["tma_store"],
                  INTERPRETED=False)
    src = ASTSource(fn=exp_gemm._exp_logits_kernel, constexprs=consts,
                    signature=dict(sig, **{k: "constexpr" for k in consts}))
    k = triton.compile(src, target=TARGET,
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    ptx = k.asm["ptx"]
    count = lambda pattern: len(re.findall(pattern, ptx))
    ops = ("add", "sub", "mul", "fma", "selp", "max")
    fp32_ops = sum(count(rf"\b{op}(\.\w+)*\.f32\b") for op in ops)
    spills, serialized = assembled(ptx)
    out["options" if options else "default"] = dict(
        wgmma=count(r"wgmma\.mma_async"), mma_sync=count(r"mma\.sync"), serialized=serialized,
        tma=count(r"cp\.async\.bulk\.tensor"), shared=k.metadata.shared, spills=spills,
        fp32_ops_per_exp=fp32_ops / max(count(r"\bex2\.approx"), 1))
fin = dict(e_ptr="*bf16", y_ptr="*i64", g_ptr="*fp32", s_ptr="*fp32", k_ptr="*i32",
           loss_ptr="*fp32", f_ptr="*fp32", h_ptr="*fp32", c_ptr="*fp32", lse_ptr="*fp32",
           softcap="fp32", z_loss="fp32")
fin |= {n: "i32" for n in ("V", "T", "stride_e", "vocab_size", "ignore_index")}
for options, hot in ((False, False), (False, True), (True, True)):
    consts = dict(REBASE=exp_gemm.REBASE, BN=BN, BT=256, G_PER_ROW=False, WRITE_G=True, HOT=hot,
                  SOFTCAP=options, Z_LOSS=options, WRITE_LSE=options, INTERPRETED=False)
    triton.compile(ASTSource(fn=exp_gemm._exp_finish_kernel, constexprs=consts,
                             signature=dict(fin, **{k: "constexpr" for k in consts})),
                   target=TARGET)
tgt = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*i64", c_ptr="*fp32", b_ptr="*fp32",
           softcap="fp32", D="i32", vocab_size="i32", ignore_index="i32")
for options in (False, True):
    consts = dict(BD=2048, HAS_BIAS=options, SOFTCAP=options)
    triton.compile(ASTSource(fn=exp_gemm._target_logit_kernel, constexprs=consts,
                             signature=dict(tgt, **{k: "constexpr" for k in consts})),
                   target=TARGET)
print(json.dumps(out))
"""


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this Triton has no NVIDIA backend")
def test_exp_gemm_compiles_to_wgmma_and_tma_within_shared_memory():
    for name, res in _compile_for_sm90(PTXAS_V + EXP_GEMM).items():
        assert res["wgmma"] >= 1 and res["mma_sync"] == 0, (name, res)
        # ptxas keeps a wgmma in flight while the next is issued; an epilogue that reads the
        # accumulators inside a branch of its own made it wait for each (run 129: 10 % slower)
        assert not res["serialized"], (name, res)
        assert res["tma"] >= 2, (name, res)  # the x and w tiles (and E's store)
        assert res["shared"] <= 227 * 1024, (name, res)
        # the default epilogue spills no register; with a softcap it spills ~100 bytes (tanh
        # and its derivative next to the accumulators), once per tile, outside the K loop
        assert name != "default" or res["spills"] == 0, (name, res)
        # the epilogue runs between the MMAs, not beside them: per element of the tile the
        # padded columns' select, one FMA and one exp, the row max and sum (3.7 fp32
        # instructions an exp in all; 6.6 with the live rows' select on every element and c
        # subtracted apart)
        assert name != "default" or res["fp32_ops_per_exp"] < 4.5, (name, res)


# colsum's pass 1 at its CUDA launch (the qkv layout at 124M's C = 768, and the plain column sum):
# LAUNCH's per_sm programs of num_warps warps must fit one SM's registers, so the grid the launch
# sizes runs as one wave; its 16-bit loads and stores must be 16 bytes wide.
COLSUM = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_loss import colsum

cfg = colsum.LAUNCH["cuda"]
sig = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", cat_ptr="*bf16", part_ptr="*fp32",
           M="i32", C="i32", stride_in="i32")
attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
out = {}
for three in (True, False):
    BN = 256  # what _launch picks for C = 768 (three) and N = 3072
    BM = cfg["tile"] // BN
    consts = dict(ROWS=8 * BM, BM=BM, BN=BN, THREE=three)
    src = ASTSource(fn=colsum._partial_sums_kernel,
                    signature=dict(sig, **{k: "constexpr" for k in consts}),
                    constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=cfg["num_warps"])).asm["ptx"]
    info = ptxas_v(ptx)
    regs = re.search(r"Used (\d+) registers", info)
    out[f"three={three}"] = dict(
        regs=int(regs.group(1)) if regs else info[-500:],
        v4=[len(re.findall(rf"{op}\.global(?:\.\w+)*\.v4\.b32", ptx)) for op in ("ld", "st")])
limit = 65536 // (32 * cfg["num_warps"] * cfg["per_sm"])
print(json.dumps(dict(kernels=out, limit=limit)))
"""


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this Triton has no NVIDIA backend")
def test_colsum_launch_keeps_its_programs_resident_with_16_byte_accesses():
    """At 4 warps a program only 4 of the 8 programs a SM the earlier launch sized its grid for
    fitted (~120 registers), so half of them waited for a second wave (bench/RESULTS.md §2i,
    run 123, times the launches)."""
    res = _compile_for_sm90(PTXAS_V + COLSUM)
    for name, k in res["kernels"].items():
        assert isinstance(k["regs"], int), (name, k)  # else ptxas's own words
        assert k["regs"] <= res["limit"], (name, k, res["limit"])
        loads, stores = k["v4"]
        assert loads >= 2 and (stores >= 2 if name == "three=True" else stores == 0), (name, k)
