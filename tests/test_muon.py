"""--optimizer=muon (gpt2_fused/training/muon.py): the Newton-Schulz orthogonalisation against an
SVD, one update against the formulas, and training under torchrun (gloo, CPU) against one
process, with checkpoints that resume exactly and refuse the other optimizer."""

import shutil
import subprocess

import pytest
import torch
from test_ddp import cuda_args, torchrun_2
from test_shard import REPO, shard_args, torchrun

import train
from conftest import read_log, read_norms
from gpt2_fused.training.config import ConfigError, TrainConfig
from gpt2_fused.training.muon import (
    NS_COEFFS,
    NS_STEPS,
    Muon,
    orthogonalize,
    orthogonalize_reference,
)

STEPS = 20


def polar_through_svd(u):
    """What the iteration computes, from an fp64 SVD u = U S V^T: U f(S) V^T, f the quintic
    applied NS_STEPS times to the singular values of u / |u|_F."""
    U, s, Vh = torch.linalg.svd(u.double(), full_matrices=False)
    s = s / torch.linalg.vector_norm(s)
    a, b, c = NS_COEFFS
    for _ in range(NS_STEPS):
        s = a * s + b * s**3 + c * s**5
    return U @ torch.diag(s) @ Vh


def check_orthogonal(o, u):
    """o: the bf16 iteration's result for u. Within bf16's error of the SVD's (~3 % of the norm
    measured; a wrong coefficient, step count or transpose is off by far more), and its singular
    values in the quintic's band (inputs' s / |s| >= 3e-3 end in [0.68, 1.21])."""
    assert o.dtype == torch.bfloat16 and o.shape == u.shape
    ref = polar_through_svd(u)
    err = torch.linalg.matrix_norm(o.double() - ref) / torch.linalg.matrix_norm(ref)
    assert err < 0.06, err
    s_in = torch.linalg.svdvals(u.double())
    assert s_in.min() / torch.linalg.vector_norm(s_in) >= 3e-3  # the band's premise
    s = torch.linalg.svdvals(o.double())
    assert 0.65 <= s.min() and s.max() <= 1.25, (s.min(), s.max())


@pytest.mark.parametrize("shape", [(64, 160), (160, 64), (100, 84), (300, 37), (37, 300)])
def test_orthogonalize_reference_is_the_polar_factors_band(shape):
    torch.manual_seed(0)
    u = torch.randn(*shape) * 1e-3  # a gradient's scale: the normalisation takes it out
    check_orthogonal(orthogonalize_reference(u), u)


def test_orthogonalize_takes_a_batch_as_its_matrices_one_by_one():
    torch.manual_seed(0)
    u = torch.randn(3, 48, 80)
    got = orthogonalize_reference(u)
    for i in range(3):
        assert torch.equal(got[i], orthogonalize_reference(u[i]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1600, 6400), (6400, 1600), (2304, 768), (4, 768, 3072)])
def test_gpu_compiled_orthogonalize_matches_the_reference(shape):
    """The compiled function (CUDA) against the plain loop and the SVD: real GPT-2 shapes,
    1558M's c_fc and MLP c_proj among them, and a batch of 124M's c_fc."""
    torch.manual_seed(0)
    u = torch.randn(*shape, device="cuda")
    got, ref = orthogonalize(u.bfloat16()), orthogonalize_reference(u)  # the step's ns_dtype
    rel = torch.linalg.vector_norm(got.float() - ref.float()) / torch.linalg.vector_norm(ref)
    assert rel < 0.03, rel  # bf16 GEMMs in another order; the loop's own error is ~3 %
    for g, x in zip(got.reshape(-1, *shape[-2:]), u.reshape(-1, *shape[-2:]), strict=True):
        check_orthogonal(g, x)


def test_one_update_follows_the_formulas():
    """Three steps of Muon on a tall matrix (Muon group, weight decay) and a vector (AdamW
    group) against the module docstring's formulas written out, and torch.optim.AdamW."""
    torch.manual_seed(0)
    w, v = torch.randn(48, 16), torch.randn(16)
    w_ref, v_ref = w.clone(), v.clone().requires_grad_()
    w.requires_grad_(), v.requires_grad_()
    lr, mu, wd = 0.05, 0.9, 0.1
    opt = Muon(
        [dict(params=[w], muon=True, lr=lr, weight_decay=wd), dict(params=[v], weight_decay=0.0)],
        lr=1e-2,
        momentum=mu,
        betas=(0.8, 0.95),
    )
    adam = torch.optim.AdamW([v_ref], lr=1e-2, betas=(0.8, 0.95), weight_decay=0.0)
    m = torch.zeros_like(w_ref)
    for _ in range(3):
        gw, gv = torch.randn_like(w), torch.randn_like(v)
        w.grad, v.grad, v_ref.grad = gw, gv, gv.clone()
        opt.step()
        adam.step()
        m = mu * m + (1 - mu) * gw
        o = orthogonalize_reference(mu * m + (1 - mu) * gw).float()
        w_ref = w_ref * (1 - lr * wd) - lr * 3**0.5 * o  # sqrt(48 / 16)
        torch.testing.assert_close(opt.state[w]["momentum_buffer"], m)
        # a bf16 rounding of u that lands the other way moves an entry by ~lr * 1e-2
        torch.testing.assert_close(w.detach(), w_ref, rtol=0, atol=lr * 2e-2)
        torch.testing.assert_close(v.detach(), v_ref.detach(), rtol=0, atol=0)


def muon_args(dataset, out_dir, *extra):
    return shard_args(dataset, out_dir, "--optimizer='muon'", "--muon_weight_decay=0.01", *extra)


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    """One process, 6 micro-steps a step, 20 steps of Muon (checkpoints at 10 and 20)."""
    out_dir = tmp_path_factory.mktemp("muon") / "single"
    train.main(muon_args(tiny_data, out_dir))
    return out_dir


RANKS = [("none", 2), ("optimizer", 3), ("full", 3)]


@pytest.fixture(scope="module")
def ranks(tiny_data, tmp_path_factory):
    """(mode, W) -> out_dir of a 20-step Muon run under torchrun, for each of RANKS."""
    base, done = tmp_path_factory.mktemp("muon_ranks"), {}
    for mode, world in RANKS:
        done[mode, world] = base / f"{mode}_{world}"
        out = torchrun(world, muon_args(tiny_data, done[mode, world], f"--shard={mode}"))
        assert "optimizer = 'muon'" in out
    return done


@pytest.mark.parametrize("mode, world", RANKS)
def test_ranks_train_the_single_process_curve(single, ranks, mode, world):
    """DDP (2 ranks: each orthogonalises half of each shape's matrices, then all-gather), ZeRO-1
    and FSDP2 (3 ranks: FSDP2's dim-0 shards of uneven rows) follow one process's losses, grad
    norms and final weights to float rounding over 20 steps."""
    tmp_path = ranks[mode, world]
    ref, ref_val = read_log(single)
    got, got_val = read_log(tmp_path)
    assert sorted(got) == list(range(STEPS)) and sorted(got_val) == [0, 10, 20]
    assert read_norms(tmp_path) == pytest.approx(read_norms(single), rel=1e-5)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    for step in ref_val:
        assert got_val[step] == pytest.approx(ref_val[step], rel=1e-5), step
    assert got[STEPS - 1] < got[0] - 2  # it trained
    a = torch.load(single / "ckpt_0000020.pt", weights_only=True)
    b = torch.load(tmp_path / "ckpt_0000020.pt", weights_only=True)
    for k, v in a["model"].items():
        torch.testing.assert_close(b["model"][k], v, rtol=1e-4, atol=1e-5)
    for i, s in a["optimizer"]["state"].items():  # the same state, in the same layout
        for key, t in s.items():
            torch.testing.assert_close(b["optimizer"]["state"][i][key], t, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode, world", RANKS)
def test_ranks_resume_exactly(ranks, tiny_data, tmp_path, mode, world):
    """Each mode's step-10 checkpoint (the momentum gathered whole), resumed on as many ranks
    (each taking its part again): the losses, step-20 weights and optimizer state of the run that
    went on, bit for bit. Except DDP's all-reduce over 3 gloo ranks (ZeRO-1 here), which sums in
    an order it does not fix: there the same run twice differs by rounding (~1e-6 in the weights
    after 10 steps, AdamW's as much)."""
    src = ranks[mode, world]
    shutil.copy(src / "ckpt_0000010.pt", tmp_path)
    torchrun(world, muon_args(tiny_data, tmp_path, f"--shard={mode}", "--resume"))
    ref, _ = read_log(src)
    got, _ = read_log(tmp_path)
    assert sorted(got) == list(range(10, STEPS))
    exact = (mode, world) != ("optimizer", 3)
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close([got[s] for s in got], [ref[s] for s in got], **tol)
    a = torch.load(src / "ckpt_0000020.pt", weights_only=True)
    b = torch.load(tmp_path / "ckpt_0000020.pt", weights_only=True)
    torch.testing.assert_close(b["model"], a["model"], **tol)
    torch.testing.assert_close(b["optimizer"]["state"], a["optimizer"]["state"], **tol)


def test_resume_is_exact_and_refuses_the_other_optimizer(single, tiny_data, tmp_path):
    """The step-10 checkpoint holds each matrix's momentum; resumed, steps 10-19 are the same
    bit for bit. Resumed with --optimizer=adamw (and an AdamW checkpoint with muon): one line."""
    ckpt = torch.load(single / "ckpt_0000010.pt", weights_only=True)
    kinds = [set(s) for s in ckpt["optimizer"]["state"].values()]
    assert kinds.count({"momentum_buffer"}) == 8  # 2 layers x 4 matrices
    assert kinds.count({"step", "exp_avg", "exp_avg_sq"}) == len(kinds) - 8
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copy(single / "ckpt_0000010.pt", out)
    train.main(muon_args(tiny_data, out, "--resume"))
    ref, ref_val = read_log(single)
    got, got_val = read_log(out)
    assert sorted(got) == list(range(10, STEPS)) and got_val == {20: ref_val[20]}
    assert all(got[s] == ref[s] for s in got)

    with pytest.raises(ConfigError, match="holds muon's optimizer state.*--optimizer=muon"):
        train.main([*muon_args(tiny_data, out, "--resume"), "--optimizer='adamw'"])
    adamw = tmp_path / "adamw"
    train.main(shard_args(tiny_data, adamw, "--max_steps=1", "--ckpt_interval=1"))
    with pytest.raises(ConfigError, match="holds adamw's optimizer state.*--optimizer=adamw"):
        train.main(muon_args(tiny_data, adamw, "--resume", "--max_steps=2"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [[], ["--fp8='fused'"]], ids=["bf16", "fp8_fused"])
def test_gpu_compiled_graphs_follow_eager(tiny_args, tmp_path, extra):
    """On CUDA: the compiled step replayed as CUDA graphs (compile_mode auto at this size), two
    micro-steps a step, clipping on, the Newton-Schulz compiled and in bf16, trains the curve of
    the same run in eager mode (bf16 rounding apart); with --fp8=fused too."""
    args = [*cuda_args(tiny_args), "--optimizer='muon'", "--max_steps=8", "--eval_interval=4"]
    args += ["--grad_clip=0.5", *extra]
    train.main([*args, f"--out_dir={tmp_path / 'compiled'}"])
    train.main([*args, "--compile=False", f"--out_dir={tmp_path / 'eager'}"])
    a, a_val = read_log(tmp_path / "eager")
    b, b_val = read_log(tmp_path / "compiled")
    assert sorted(b) == list(range(8)) and sorted(b_val) == [0, 4, 8]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-2), step
    assert b[7] < b[0] - 0.5  # it trained (6.22 -> 5.43 on an H100)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("shard", ["none", "optimizer", "full"])
def test_gpu_two_ranks_follow_one_process(tiny_args, tmp_path, shard):
    """torchrun on 2 GPUs (NCCL), each --shard mode, against one process with twice the
    accumulation (bf16: to 1 %)."""
    args = [*cuda_args(tiny_args), "--optimizer='muon'", "--total_batch_size=512"]
    args += ["--max_steps=6", "--eval_interval=3", "--compile_mode='default'"]
    train.main([*args, f"--out_dir={tmp_path / 'single'}"])
    cmd = [*torchrun_2(*args), f"--shard={shard}", f"--out_dir={tmp_path / 'multi'}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    a, _ = read_log(tmp_path / "single")
    b, _ = read_log(tmp_path / "multi")
    assert sorted(b) == list(range(6))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-2), step


@pytest.mark.parametrize(
    "key, value, says",
    [("optimizer", "sgd", "'adamw' or 'muon'"), ("muon_momentum", 1.0, "in \\[0, 1\\)"),
     ("muon_lr", 0.0, "must be > 0"), ("muon_weight_decay", -0.1, "must be >= 0")],
)  # fmt: skip
def test_bad_muon_settings_are_one_line_errors(key, value, says):
    with pytest.raises(ConfigError, match=f"'{key}'.*{says}"):
        TrainConfig(**{key: value})
