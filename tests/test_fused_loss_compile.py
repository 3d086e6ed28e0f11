"""The fused loss's Triton kernels compile for Hopper (sm_90) on any machine (tests/sm90.py), with
the code its launches need: the row kernels' loads of the bf16 logits vectorised at the real, odd
vocabulary size (50257; loads masked there compiled to scalar 16-bit loads and cost ~0.6 ms per
124M call on the H200), their registers within what keeps the persistent grid resident, and
exp_gemm's GEMM on wgmma and TMA within shared memory.
"""

from sm90 import PTXAS_V, compile_for_sm90, needs_nvidia_backend

ROW_KERNELS = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_loss import linear_cross_entropy as fl
from fused_loss import triton_kernels as kernels

TARGET = GPUTarget("cuda", 90, 32)
ROW_ARGS = ["z_ptr", "y_ptr", "g_ptr", "loss_ptr"]
ROW_INTS = ["n_rows", "V", "vocab_size", "mask_cols", "stride_z", "ignore_index"]
# As a launch at the 124M shape specialises them: pointers 16-byte aligned, V = mask_cols = 50304,
# D = 768 and the row stride divisible by 16; vocab_size = 50257 and n_rows not.
DIV16 = {"V", "mask_cols", "D", "stride_z", "numel"}


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


# softmax_grad_kernel's options (bias, softcap, ...), after its ints; off unless a key says
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
        out[f"softmax_grad {dt} write_g={write_g}"] = build(
            kernels.softmax_grad_kernel, row_sig(dt, False), dict(c, **OPTIONS_OFF), 8)
        if write_g and dt == "bf16":  # every option on
            on = {k: True for k in OPTIONS_OFF}
            out["softmax_grad bf16 options"] = build(
                kernels.softmax_grad_kernel, row_sig(dt, False), dict(c, **on), 8)
        c["REBASE"] = 60.0
        for hot in (False, True) if write_g else (False,):  # the one-hot out of E or folded in
            out[f"exp_rows {dt} write_g={write_g} hot={hot}"] = build(
                kernels.exp_rows_kernel, row_sig(dt, True), dict(c, HOT=hot), 8)
for src in ("fp32", "bf16"):
    sig = {"src_ptr": f"*{src}", "f_ptr": "*fp32", "out_ptr": "*bf16", "w_ptr": "*bf16",
           "y_ptr": "*i64", "h_ptr": "*fp32", "D": "i32"}
    consts = dict(HOT=src == "fp32", BD=256, INTERPRETED=False)
    out[f"row_scale {src}"] = build(kernels.row_scale_kernel, sig, consts, 4)
hot_cfg = fl.LAUNCH["cuda"]
blk = dict(R=hot_cfg["one_hot_rows"], BD=hot_cfg["one_hot_cols"])
ptrs = {"acc_ptr": "*fp32", "part_ptr": "*fp32", "x_ptr": "*bf16", "ys_ptr": "*i32",
        "order_ptr": "*i64", "h_ptr": "*fp32"}
ints = {n: "i32" for n in ("N", "D", "a", "b")}
out["one_hot pieces"] = build(kernels.one_hot_pieces_kernel, ptrs | ints, blk, 4)
ptrs = {"acc_ptr": "*fp32", "part_ptr": "*fp32", "ys_ptr": "*i32"}
out["one_hot runs"] = build(kernels.one_hot_runs_kernel, ptrs | ints | {"blocks": "i32"},
                            dict(blk, S=hot_cfg["one_hot_steps"]), 4)
for dt in ("bf16", "fp32"):
    sig = {"src_ptr": f"*{dt}", "g_ptr": "*fp32", "dst_ptr": f"*{dt}", "numel": "i32"}
    out[f"scale {dt}"] = build(kernels.scale_kernel, sig, dict(BLOCK=4096, INTERPRETED=False), 4)
print(json.dumps(out))
"""


@needs_nvidia_backend
def test_row_kernels_compile_for_sm90_with_vectorised_logit_loads():
    loads = compile_for_sm90(ROW_KERNELS)
    assert len(loads) == 17
    for name, (v4, b16) in loads.items():
        if name.startswith(("softmax_grad bf16", "exp_rows bf16")):
            # every pass over a row of bf16 logits: 8-wide loads, no 16-bit scalar ones left
            # beyond a couple of single-element reads (the target's logit)
            assert v4 >= 2 and b16 <= 4, (name, v4, b16)


# The row kernels at their CUDA launch (row_kernel_options, the mask_cols = V that lce_pass
# passes), compiled and assembled by ptxas -v: the registers per thread must let LAUNCH's per_sm
# programs of num_warps warps fit on one SM, the residency the persistent grid is sized for.
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
    options = fl.row_kernel_options(cfg, cuda=True)
    div16 = {"V": V, "stride_z": V, "vocab_size": vocab, "mask_cols": V}
    for single in (False, True):
        ptrs = ["*bf16", "*i64", "*fp32", "*fp32"] + (["*fp32", "*fp32"] if single else [])
        names = ["z_ptr", "y_ptr", "g_ptr", "loss_ptr", "f_ptr", "h_ptr"][:len(ptrs)]
        sig = dict(zip(names + ints, ptrs + ["i32"] * len(ints)))
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
                 if sig[n].startswith("*") or div16.get(n, 1) % 16 == 0}
        consts = dict(G_PER_ROW=False, WRITE_G=True, BV=cfg["BV"], INTERPRETED=False)
        consts.update(dict(REBASE=fl.REBASE, HOT=True) if single else {})
        if not single:  # the options, off
            sig |= {"b_ptr": "*fp32", "lse_ptr": "*fp32", "softcap": "fp32", "z_loss": "fp32",
                    "smoothing": "fp32"}
            consts |= dict(HAS_BIAS=False, SOFTCAP=False, Z_LOSS=False, SMOOTH=False,
                           WRITE_LSE=False)
        fn = kernels.exp_rows_kernel if single else kernels.softmax_grad_kernel
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


@needs_nvidia_backend
def test_row_kernel_launch_keeps_its_programs_resident():
    """Above the limit only some of the per_sm programs fit at once and the rest run as a second
    wave: on the H200 that cost 0.4-1.1 ms per 124M call (bench/RESULTS.md#fused-loss)."""
    res = compile_for_sm90(PTXAS_V + RESIDENCY)
    assert len(res["registers"]) == 4
    for name, regs in res["registers"].items():
        assert isinstance(regs, int), (name, regs)  # else ptxas's own words
        assert regs <= res["limit"], (name, regs, res["limit"])


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
       "e_desc": f"tensordesc<bf16[{BM},{BN // 2}]>", "c_ptr": "*fp32", "y_ptr": "*i64",
       "s_ptr": "*fp32", "k_ptr": "*i32", "b_ptr": "*fp32", "softcap": "fp32"}
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
                  BM=BM, BN=BN, BK=BK, PROGRAMS=132, INTERPRETED=False)
    src = ASTSource(fn=exp_gemm.exp_logits_kernel, constexprs=consts,
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
    triton.compile(ASTSource(fn=exp_gemm.exp_finish_kernel, constexprs=consts,
                             signature=dict(fin, **{k: "constexpr" for k in consts})),
                   target=TARGET)
tgt = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*i64", c_ptr="*fp32", b_ptr="*fp32",
           softcap="fp32", D="i32", vocab_size="i32", ignore_index="i32")
for options in (False, True):
    consts = dict(BD=2048, HAS_BIAS=options, SOFTCAP=options)
    triton.compile(ASTSource(fn=exp_gemm.target_logit_kernel, constexprs=consts,
                             signature=dict(tgt, **{k: "constexpr" for k in consts})),
                   target=TARGET)
print(json.dumps(out))
"""


@needs_nvidia_backend
def test_exp_gemm_compiles_to_wgmma_and_tma_within_shared_memory():
    for name, res in compile_for_sm90(PTXAS_V + EXP_GEMM).items():
        assert res["wgmma"] >= 1 and res["mma_sync"] == 0, (name, res)
        # ptxas keeps a wgmma in flight while the next is issued; an epilogue that reads the
        # accumulators inside a branch of its own makes it wait for each (slower:
        # bench/RESULTS.md#fused-loss)
        assert not res["serialized"], (name, res)
        assert res["tma"] >= 2, (name, res)  # the x and w tiles (and E's store)
        assert res["shared"] <= 227 * 1024, (name, res)
        # the default epilogue spills no register; with a softcap it spills ~100 bytes (tanh
        # and its derivative next to the accumulators), once per tile, outside the K loop
        assert name != "default" or res["spills"] == 0, (name, res)
        # the epilogue runs between the MMAs, not beside them: per element of the tile the
        # padded columns' select, one FMA and one exp, the row max and sum (3.7 fp32
        # instructions an exp in all)
        assert name != "default" or res["fp32_ops_per_exp"] < 4.5, (name, res)
