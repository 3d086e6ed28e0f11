"""gpt2_fused/kernels/fast_paths.py: which GPUs and dtypes each fast path runs on, the override
that makes every capability check report another GPU, the choices that follow it (model, AdamW,
the loss in fp16), the start-up notice; the Triton kernels compiled for sm_80 and sm_86 at their
launch settings fit those cards; on the GPU, training under a forced sm_80, sm_86 and sm_89."""

import pytest
import torch
from sm90 import compile_for_sm90, needs_nvidia_backend

import model as model_module
import train
from conftest import read_log
from fused_loss import linear_cross_entropy as fl
from gpt2_fused.kernels import fast_paths
from gpt2_fused.kernels.adamw import MultiTensorAdamW
from gpt2_fused.kernels.launch import FORCE_CAPABILITY, capability
from gpt2_fused.training import optim
from gpt2_fused.training.config import TrainConfig
from gpt2_fused.training.hardware import fast_path_notes
from model import GPT, GPTConfig

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


@pytest.fixture
def force(monkeypatch):
    """force("8.6"): every capability check of the package reports sm_86 for the test."""
    return lambda cc: monkeypatch.setenv(FORCE_CAPABILITY, cc)


def test_forced_capability_is_what_every_check_reports(force):
    force("8.6")
    assert capability() == (8, 6) and capability(CUDA) == (8, 6)
    assert not fast_paths.gpu_runs("attention") and not fast_paths.gpu_runs("loss epilogue")
    assert fast_paths.gpu_runs("mlp") and fast_paths.gpu_runs("loss")
    force("9.0")
    assert fast_paths.gpu_runs("attention") and fast_paths.gpu_runs("gemv pdl")
    force("10.0")  # B200: Hopper-only paths off, the rest on
    assert not fast_paths.gpu_runs("attention") and fast_paths.gpu_runs("adamw")
    force("7.5")  # T4: no Triton kernels, no fp8
    assert not any(fast_paths.gpu_runs(name) for name in fast_paths.FAST_PATHS)
    force("sm86")
    with pytest.raises(ValueError, match=f"{FORCE_CAPABILITY}='sm86': give major.minor"):
        capability()


@pytest.mark.parametrize(
    "cc, dtype, says",
    [
        ("9.0", torch.bfloat16, None),
        ("8.0", torch.bfloat16, "fast paths off on sm_80 in bfloat16: loss epilogue (needs sm_9x;"),
        ("8.9", torch.float16, "fast paths off on sm_89 in float16: loss epilogue (needs sm_9x;"),
        ("7.5", torch.float16, "mlp (needs sm_80+; F.linear + F.gelu), attention (needs sm_9x;"),
        ("9.0", torch.float32, "mlp (needs bfloat16/float16; F.linear + F.gelu)"),
    ],
)
def test_notice_names_what_this_gpu_and_dtype_rule_out(force, cc, dtype, says):
    force(cc)
    notes = fast_path_notes(TrainConfig(), CUDA, dtype)
    if says is None:
        assert notes == []
    else:
        assert len(notes) == 1 and says in notes[0], notes
    plain = TrainConfig(adamw_impl="torch", sample_interval=0)
    for key in ("loss_impl", "mlp_impl", "attn_impl"):
        setattr(plain.model, key, "torch")
    assert fast_path_notes(plain, CUDA, dtype) == []  # nothing asked for, nothing to say
    assert fast_path_notes(TrainConfig(), torch.device("cpu"), dtype) == []


@pytest.mark.parametrize("cc, ours", [("9.0", True), ("8.6", True), ("7.5", False)])
def test_adamw_kernel_only_where_the_gpu_runs_it(force, cc, ours):
    force(cc)
    model = torch.nn.Linear(4, 4)
    cls, _, kw = optim.adamw_parts(model, TrainConfig(), CUDA)
    assert (cls is MultiTensorAdamW) == ours
    assert ours or kw["fused"] is True  # torch's fused kernel instead


@pytest.mark.parametrize("cc, on", [("8.6", True), ("7.5", False)])
def test_model_takes_the_paths_the_gpu_runs(force, monkeypatch, cc, on):
    """A model built where CUDA is (faked here) decides its fused loss and GEMV by the table;
    the MLP's epilogues too, once libcublasLt loads (faked)."""
    force(cc)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model_module.cublaslt, "available", lambda: True)
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64,
                      padded_vocab_size=64))  # fmt: skip
    block = m.transformer.h[0]
    assert m.fused_loss == on and block.use_gemv == on and block.mlp.use_cublaslt == on


@pytest.mark.parametrize("dtype, reduction", [(torch.bfloat16, None), (torch.float16, "sum")])
def test_fp16_autocast_asks_the_fused_loss_for_the_sums_gradients(monkeypatch, dtype, reduction):
    """The fused loss under bf16 and fp16 autocast (FAST_PATHS); under fp16 the model asks it
    for the sum (gradients ~1 rather than ~1/tokens, test below) and divides by the count."""
    seen = []

    def fused_loss(*args, **kw):
        seen.append(kw.get("reduction"))
        return model_module.linear_cross_entropy_reference(
            *args, reduction=kw.get("reduction", "mean")
        )

    monkeypatch.setattr(model_module, "fused_linear_cross_entropy", fused_loss)
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64,
                      padded_vocab_size=64))  # fmt: skip
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=dtype):
        loss = m(idx, idx)
    m.config.loss_impl = "torch"
    m.fused_loss = False
    with torch.autocast("cpu", dtype=dtype):
        ref = m(idx, idx)
    assert seen == [reduction] and torch.allclose(loss.float(), ref.float(), rtol=1e-3)


def test_fused_loss_gradient_underflows_in_fp16():
    """Why the model asks the fused loss for the sum's gradients under fp16: it forms
    G = g (softmax - onehot) in the forward with g = 1/tokens for a mean (no loss scale yet) and
    rounds it to the compute dtype. At a flat softmax over 512 columns and g = 1/65536 (a
    64K-token micro-batch) each softmax entry of G is 3e-8, half fp16's least subnormal step: the
    gradient of the non-target rows of dw is lost in fp16, within bf16's rounding in bf16. With
    the sum's g = 1, fp16 keeps it as bf16 does. Against fp64 on the same inputs, interpreted."""
    torch.manual_seed(0)
    N, D, V = 8, 16, 512
    x, w = torch.randn(N, D), torch.randn(V, D) * 1e-3  # logits ~1e-3: p ~ 1 / V
    y = torch.randint(0, 8, (N,))  # targets among the first 8 rows: the rest is softmax only
    errors = {}
    for dt, g in ((torch.bfloat16, 1 / 65536), (torch.float16, 1 / 65536), ("sum", 1.0)):
        xd, wd = (x.half(), w.half()) if dt == "sum" else (x.to(dt), w.to(dt))
        *_, dw, _ = fl.lce_pass(xd, wd, y, torch.full((1,), g), ignore_index=-100, vocab_size=V,
                                want_grad=True, g_per_row=False)  # fmt: skip
        p = (xd.double() @ wd.double().T).softmax(-1)
        p[torch.arange(N), y] -= 1
        ref = (g * p).T @ xd.double()
        rest = slice(8, V)
        errors[dt] = ((dw[rest].double() - ref[rest]).norm() / ref[rest].norm()).item()
    assert errors[torch.bfloat16] < 0.02 and errors["sum"] < 0.02, errors
    assert errors[torch.float16] > 0.5, errors


# Each training-path Triton kernel at the launch settings its launcher picks on CUDA, compiled for
# the card's target: the shared memory a block takes and its threads must fit the card. The CUDA
# C++ Programming Guide's table of compute capabilities: shared memory a block at most 163 KB on
# sm_80, 99 KB on sm_86 and sm_89 (227 KB on sm_90); 1024 threads a block.
SHARED = r"""
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_loss import linear_cross_entropy as fl, triton_kernels as K
from gpt2_fused.kernels import adamw, gemv, grad_sums

CC = int(sys.argv[1])


def build(fn, sig, consts, **options):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n][0] == "*"}
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}),
                    constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", CC, 32), options=options)
    return k.metadata.shared, 32 * k.metadata.num_warps


cfg = fl.LAUNCH["cuda"]
ints = {n: "i32" for n in ("n_rows", "V", "vocab_size", "mask_cols", "stride_z", "ignore_index")}
rows = {"z_ptr": "*bf16", "y_ptr": "*i64", "g_ptr": "*fp32", "loss_ptr": "*fp32"}
feats = {"b_ptr": "*fp32", "lse_ptr": "*fp32", "softcap": "fp32", "z_loss": "fp32",
         "smoothing": "fp32"}
off = dict(HAS_BIAS=False, SOFTCAP=False, Z_LOSS=False, SMOOTH=False, WRITE_LSE=False)
row = dict(G_PER_ROW=False, WRITE_G=True, BV=cfg["BV"], INTERPRETED=False)
row_opts = fl.row_kernel_options(cfg, cuda=True)
out = {}
out["softmax_grad"] = build(K.softmax_grad_kernel, rows | ints | feats, row | off, **row_opts)
out["exp_rows"] = build(K.exp_rows_kernel, rows | {"f_ptr": "*fp32", "h_ptr": "*fp32"} | ints,
                        row | dict(REBASE=fl.REBASE, HOT=True), **row_opts)
out["row_scale"] = build(K.row_scale_kernel, {"src_ptr": "*fp32", "f_ptr": "*fp32",
                         "out_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*i64", "h_ptr": "*fp32",
                         "D": "i32"}, dict(HOT=True, BD=cfg["BD"], INTERPRETED=False))
hot = {n: "i32" for n in ("N", "D", "a", "b")}
blk = dict(R=cfg["one_hot_rows"], BD=cfg["one_hot_cols"])
out["one_hot_pieces"] = build(K.one_hot_pieces_kernel, {"acc_ptr": "*fp32", "part_ptr": "*fp32",
                              "x_ptr": "*bf16", "ys_ptr": "*i32", "order_ptr": "*i64",
                              "h_ptr": "*fp32"} | hot, blk)
out["one_hot_runs"] = build(K.one_hot_runs_kernel, {"acc_ptr": "*fp32", "part_ptr": "*fp32",
                            "ys_ptr": "*i32"} | hot | {"blocks": "i32"},
                            blk | dict(S=cfg["one_hot_steps"]))
out["scale"] = build(K.scale_kernel, {"src_ptr": "*fp32", "g_ptr": "*fp32", "dst_ptr": "*fp32",
                     "numel": "i32"}, dict(BLOCK=4096, INTERPRETED=False))
cs = grad_sums.LAUNCH["cuda"]
BN = 256
out["colsum_partial"] = build(grad_sums.partial_sums_kernel, dict(a_ptr="*bf16", b_ptr="*bf16",
                              c_ptr="*bf16", cat_ptr="*bf16", part_ptr="*fp32", M="i32", C="i32",
                              stride_in="i32"),
                              dict(ROWS=8 * (cs["tile"] // BN), BM=cs["tile"] // BN, BN=BN,
                                   THREE=True), num_warps=cs["num_warps"])
out["colsum_finish"] = build(grad_sums.finish_kernel, dict(part_ptr="*fp32", out_ptr="*fp32",
                             P="i32", N="i32"), dict(BP=16, BN=256))  # row_sum's widest
scalars = ("lr", "beta1", "beta2", "eps", "step_size", "bc2_sqrt")
step = dict(ptrs="*i64", numels="*i64", wds="*fp32", block_tensor="*i32", block_start="*i64",
            scale_ptr="*fp32", found_inf_ptr="*fp32", T="i32") | {k: "fp32" for k in scalars}
for name, casts, skippable in (("adamw", 1, False), ("adamw fp16", 2, True)):
    out[name] = build(adamw.adamw_kernel, step, dict(BLOCK=adamw.BLOCK, ALIGNED=True, CASTS=casts,
                      SKIPPABLE=skippable, INTERPRETED=False), num_warps=adamw.NUM_WARPS)
out["sumsq"] = build(adamw.sumsq_kernel, dict(ptrs="*i64", numels="*i64", block_tensor="*i32",
                     block_start="*i64", partial="*fp32", T="i32"),
                     dict(BLOCK=adamw.BLOCK, ALIGNED=True), num_warps=adamw.NUM_WARPS)
gsig = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "r_ptr", "ln_w_ptr", "ln_b_ptr", "y_ptr",
                             "k_ptr", "v_ptr")} | dict(pos_ptr="*i64", N="i32", eps="fp32",
                                                      stride_head="i32")
for k in (768, 3072):  # c_attn's and the MLP projection's K at 124M: the widest rows a program
    bn = max(1, gemv.ELEMENTS // triton.next_power_of_2(k))
    out[f"gemv K={k}"] = build(gemv.gemv_kernel, gsig, dict(
        K=k, KP=triton.next_power_of_2(k), BLOCK_N=bn, HAS_BIAS=True, LN=True, LN_BIAS=True,
        GELU=True, RESIDUAL=True, KV=k == 768, HEAD=64, PDL=False, INTERPRETED=False),
        num_warps=gemv.NUM_WARPS)
print(json.dumps(out))
"""

SHARED_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024}


@needs_nvidia_backend
@pytest.mark.parametrize("cc", sorted(SHARED_PER_BLOCK))
def test_triton_kernels_fit_the_shared_memory_of_ampere_cards(cc):
    got = compile_for_sm90(SHARED.replace("sys.argv[1]", str(cc)))
    assert len(got) == 13
    for name, (shared, threads) in got.items():
        assert shared <= SHARED_PER_BLOCK[cc] and threads <= 1024, (cc, name, shared, threads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cc", ["8.0", "8.6", "8.9"])
def test_gpu_training_under_a_forced_capability(
    force, monkeypatch, tiny_args, tmp_path, capsys, cc
):
    """train.main as tests/test_train.py's compiled GPU case runs it (bf16 autocast, the fused
    loss, two micro-batches a step, a sample, checkpoints, a resume) with the GPU reported as an
    sm_80, sm_86 or sm_89 card: it trains, the notice names the Hopper-only paths, and the model
    takes the paths the table gives that card."""
    force(cc)
    args = [a for a in tiny_args if not a.startswith(("--device", "--dtype", "--compile"))]
    args += ["--device=cuda", "--dtype=bfloat16", "--loss_impl=fast", "--compile_mode='default'"]
    args += ["--eval_interval=2", "--sample_interval=3", "--ckpt_interval=3"]
    built = []

    def gpt(config):  # train.py's GPT, kept for a look at the paths it took
        built.append(GPT(config))
        return built[-1]

    monkeypatch.setattr(train, "GPT", gpt)
    train.main([*args, "--max_steps=6", f"--out_dir={tmp_path}"])
    out = capsys.readouterr().out
    train.main([*args, "--max_steps=8", f"--out_dir={tmp_path}", "--resume"])
    assert f"fast paths off on sm_{cc.replace('.', '')} in bfloat16: loss epilogue" in out
    assert "attention (needs sm_9x" in out and "sample at step 3" in out
    losses, vals = read_log(tmp_path)
    assert sorted(vals) == [0, 2, 4, 6, 8] and vals[6] < vals[0]
    for m in built:
        assert m.fused_loss and not m.transformer.h[0].attn.use_fast
        assert m.transformer.h[0].mlp.use_cublaslt and m.transformer.h[0].use_gemv


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cc", ["8.0", "8.6", "8.9", "9.0"])
def test_gpu_step_takes_the_paths_of_the_forced_capability(force, monkeypatch, cc):
    """A bf16-autocast training step of a small model: the loss's logits-GEMM epilogue and the
    cuDNN attention op run under a forced sm_90 only (on an H100: its own paths), the cuBLAS
    GEMM, the row kernels and the MLP's epilogues under every capability."""
    force(cc)
    seen = []
    for mod, name in ((fl.exp_gemm, "start"), (model_module, "mlp_cublaslt"),
                      (model_module.attention, "attention_fast")):  # fmt: skip
        real = getattr(mod, name)
        monkeypatch.setattr(
            mod, name, lambda *a, _r=real, _n=name, **kw: seen.append(_n) or _r(*a, **kw)
        )
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=64)).cuda()
    idx = torch.randint(0, 50257, (4, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(idx, idx)
    loss.backward()
    hopper = cc == "9.0"
    assert torch.isfinite(loss) and m.lm_head.weight.grad.abs().sum() > 0
    assert ("start" in seen) == hopper and ("attention_fast" in seen) == hopper
    assert "mlp_cublaslt" in seen
