"""float16 training: dtype=auto's choice, the loss scale (gpt2_fused/training/loss_scale.py) in the
clipped step of each AdamW, skipped steps in the log, the scale in checkpoints and resumes, and
the fused loss's gradients under fp16. On CPU through torch's fp16 autocast (and the Triton
interpreter); the GPU cases at the end."""

import types

import pytest
import torch

import train
from conftest import read_log
from gpt2_fused.kernels.adamw import MultiTensorAdamW
from gpt2_fused.training import hardware, loss_scale, optim
from gpt2_fused.training.config import ConfigError
from gpt2_fused.training.loss_scale import LossScaler
from gpt2_fused.training.runlog import read_jsonl

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
SHAPES = [(64, 48), (48,), (33, 17)]


@pytest.mark.parametrize(
    "capability, hip, want",
    [((7, 5), None, torch.float16), ((7, 0), None, torch.float16), ((8, 0), None, torch.bfloat16),
     ((9, 0), None, torch.bfloat16), ((9, 4), "6.2", torch.bfloat16)],
)  # fmt: skip
def test_auto_dtype_is_float16_where_bf16_is_only_emulated(monkeypatch, capability, hip, want):
    """T4 (7.5) and V100 (7.0) get fp16, whatever is_bf16_supported() says by emulation; Ampere
    and later bf16; ROCm bf16; a CPU fp32; a named dtype is kept."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert hardware.resolve_dtype("auto", torch.device("cuda", 0)) == want
    assert hardware.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert hardware.resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_float16_refuses_fp8_and_fsdp2_in_one_line():
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(fp8="tensorwise"), shard="none")
    with pytest.raises(ConfigError, match="--dtype=bfloat16"):
        LossScaler.for_run(cfg, torch.float16, torch.device("cpu"))
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(fp8="off"), shard="full")
    with pytest.raises(ConfigError, match="--shard=optimizer"):
        LossScaler.for_run(cfg, torch.float16, torch.device("cpu"))
    assert not LossScaler.for_run(cfg, torch.bfloat16, torch.device("cpu")).enabled


def _optimizer(kind, params):
    groups = [
        {"params": params[:1], "weight_decay": 0.1},
        {"params": params[1:], "weight_decay": 0},
    ]
    if kind == "multi_tensor":
        return MultiTensorAdamW(groups, **HYPER)
    return torch.optim.AdamW(groups, **HYPER, fused=kind == "torch_fused")


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["multi_tensor", "torch_fused", "torch"])
def test_scaled_step_matches_unscaled_and_skips_inf(device, kind):
    """optim.clipped_step with a loss scale: grads multiplied by the scale give the update and
    the norm that the plain grads give unscaled (clipped at max_norm); then a step with an inf
    in one grad changes nothing (weights, both moments, the fp16 casts), is counted, and halves
    the scale; the next clean step updates again."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
    grads = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    scaled = [torch.nn.Parameter(t.clone()) for t in start]
    opt_plain, opt = _optimizer(kind, plain), _optimizer(kind, scaled)
    casts = {}
    if kind == "multi_tensor":
        casts = {p: p.detach().half() for p in scaled}
        opt.set_weight_casts(casts)
    scaler = LossScaler(torch.device(device), enabled=True)
    scaler.scale.fill_(1024.0)
    max_norm = 0.5 * torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()

    for p, q, g in zip(plain, scaled, grads, strict=True):
        p.grad, q.grad = g.clone(), g * 1024.0
    want = optim.clipped_step(opt_plain, plain, max_norm)
    got = optim.clipped_step(opt, scaled, max_norm, scaler)
    scaler.update()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for p, q in zip(plain, scaled, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    assert scaler.found_inf.item() == 0 and scaler.scale.item() == 1024.0

    before = [t.detach().clone() for t in scaled]
    moments = [[s.clone() for s in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
               for p in scaled]  # fmt: skip
    cast_before = [c.clone() for c in casts.values()]
    for q, g in zip(scaled, grads, strict=True):
        q.grad = g * 1024.0
    scaled[2].grad[3, 5] = float("inf")
    norm = optim.clipped_step(opt, scaled, max_norm, scaler)
    scaler.update()
    assert not torch.isfinite(norm)
    assert scaler.found_inf.item() == 1 and scaler.skipped.item() == 1
    assert scaler.scale.item() == 512.0
    for q, b, (m, v) in zip(scaled, before, moments, strict=True):
        assert torch.equal(q.detach(), b)
        assert torch.equal(opt.state[q]["exp_avg"], m) and torch.equal(
            opt.state[q]["exp_avg_sq"], v
        )
    assert all(torch.equal(c, b) for c, b in zip(casts.values(), cast_before, strict=True))

    for q, g in zip(scaled, grads, strict=True):
        q.grad = g * 512.0
    optim.clipped_step(opt, scaled, max_norm, scaler)
    scaler.update()
    assert scaler.found_inf.item() == 0 and scaler.skipped.item() == 1
    assert not torch.equal(scaled[0].detach(), before[0])


def _fp16_args(tiny_args):
    return [a for a in tiny_args if not a.startswith("--dtype")] + ["--dtype=float16"]


def _scales(skipped, init, interval):
    """The scale each step uses under GradScaler's rule (halve after a skip, double after
    `interval` clean steps in a row), from the steps' skipped flags."""
    scales, scale, clean = [], init, 0
    for skip in skipped:
        scales.append(scale)
        clean = 0 if skip else clean + 1
        if skip:
            scale /= 2
        elif clean == interval:
            scale, clean = scale * 2, 0
    return scales


def test_fp16_run_logs_skipped_steps_and_resumes_bit_identically(
    tiny_args, tmp_path, monkeypatch, capsys
):
    """A CPU fp16 run whose first scale (2^24) overflows the fp16 gradients and that grows it
    after 3 clean steps: the skipped steps are marked in the step line and log.jsonl and
    counted, the scale follows GradScaler's rule, the run trains; resumed from step 8's
    checkpoint in another out_dir it logs the same losses, norms and scales and ends with the
    same weights, AdamW state and loss-scale state."""
    monkeypatch.setattr(loss_scale, "INIT_SCALE", 2.0**24)
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 3)
    args = _fp16_args(tiny_args) + ["--max_steps=24", "--eval_interval=8", "--ckpt_interval=8"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train.main(args + [f"--out_dir={straight}", "--keep_last=0"])
    assert "| skipped 1 (this one)" in capsys.readouterr().out
    recs = [r for r in read_jsonl(straight / "log.jsonl") if "loss" in r]
    skipped = [r["skipped"] for r in recs]
    assert all(skipped[:5]) and not all(skipped)  # 2^20 still overflows here
    counts = [sum(skipped[: i + 1]) for i in range(len(recs))]
    assert [r["skipped_steps"] for r in recs] == counts
    assert [r["loss_scale"] for r in recs] == _scales(skipped, 2.0**24, 3)
    assert max(r["loss_scale"] for r in recs[counts[-1] :]) > recs[counts[-1]]["loss_scale"]
    _, vals = read_log(straight)
    assert vals[24] < vals[0]

    resumed.mkdir()
    (resumed / "ckpt_0000008.pt").write_bytes((straight / "ckpt_0000008.pt").read_bytes())
    train.main(args + [f"--out_dir={resumed}", "--resume"])
    drop = ("ms", "tok_per_s", "startup_s", "mfu")
    again = [
        {k: v for k, v in r.items() if k not in drop} for r in read_jsonl(resumed / "log.jsonl")
    ]
    want = [
        {k: v for k, v in r.items() if k not in drop} for r in read_jsonl(straight / "log.jsonl")
    ]
    assert again == [r for r in want if r["step"] > 8 or (r["step"] == 8 and "loss" in r)]
    a, b = (torch.load(d / "ckpt_0000024.pt", weights_only=True) for d in (straight, resumed))
    assert a["loss_scale"] == b["loss_scale"]
    assert a["loss_scale"]["skipped"] == counts[-1]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    states = (a["optimizer"]["state"].values(), b["optimizer"]["state"].values())
    for sa, sb in zip(*states, strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resume_across_dtypes(tiny_args, tmp_path, capsys):
    """An fp32 run's checkpoint resumes under fp16 (the scale starts afresh, a note says so)
    and an fp16 run's under fp32 (its scale is left, a note says so)."""
    fp32 = tiny_args + [f"--out_dir={tmp_path}", "--eval_interval=0"]
    fp16 = _fp16_args(tiny_args) + [f"--out_dir={tmp_path}", "--eval_interval=0"]
    train.main(fp32 + ["--max_steps=2"])
    train.main(fp16 + ["--max_steps=4", "--resume"])
    out = capsys.readouterr().out
    assert "the checkpoint has no loss scale" in out
    assert torch.load(tmp_path / "ckpt_0000004.pt", weights_only=True)["loss_scale"]["scale"] > 1
    train.main(fp32 + ["--max_steps=6", "--resume"])
    assert "loss scale is not used" in capsys.readouterr().out
    losses, _ = read_log(tmp_path)
    assert sorted(losses) == list(range(6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_fp16_training_follows_bf16(tiny_args, tmp_path, capsys, mode):
    """train.main on the GPU in fp16 (compiled, with and without CUDA graphs, the fused loss, the
    Triton AdamW with fp16 kept casts) against bf16 from the same seed and data: every loss
    finite and within 0.05 of bf16's, no step skipped at the default scale, the scale logged."""
    args = [a for a in tiny_args if not a.startswith(("--device", "--dtype", "--compile"))]
    args += ["--device=cuda", "--loss_impl=fast", f"--compile_mode={mode!r}"]
    args += ["--max_steps=8", "--eval_interval=4"]
    runs = {}
    for dtype in ("bfloat16", "float16"):
        out = tmp_path / dtype
        train.main([*args, f"--dtype={dtype!r}", f"--out_dir={out}"])
        runs[dtype] = read_log(out)
    text = capsys.readouterr().out
    assert "| float16 |" in text and f"compile {mode}" in text
    (bf16, bf16_val), (fp16, fp16_val) = runs["bfloat16"], runs["float16"]
    assert sorted(fp16) == list(range(8))
    for step, loss in fp16.items():
        assert abs(loss - bf16[step]) < 0.05, (step, loss, bf16[step])
    for step, loss in fp16_val.items():
        assert abs(loss - bf16_val[step]) < 0.05, (step, loss, bf16_val[step])
    recs = [r for r in read_jsonl(tmp_path / "float16" / "log.jsonl") if "loss" in r]
    assert all(r["loss_scale"] == loss_scale.INIT_SCALE and not r["skipped"] for r in recs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_loss_gradients_in_fp16_are_not_subnormal():
    """The fused loss forms dx in its forward, before the loss scale: under fp16 autocast the
    model asks it for the sum's gradients, so at 16,384 rows (a mean's dx ~1e-6, in fp16's
    subnormals) the weights' grads (scaled by 1024, then unscaled) stay within 1e-2 of float64
    torch's, as bf16's do."""
    from gpt2_fused.kernels.fast_paths import dtype_runs
    from model import GPT, GPTConfig

    assert dtype_runs("loss", torch.float16)  # the fused loss, not its torch twin, is under test
    torch.manual_seed(0)
    shape = dict(n_layer=1, n_head=2, n_embd=64, block_size=1024, vocab_size=512)
    fused = GPT(GPTConfig(**shape, padded_vocab_size=512, loss_impl="fast")).cuda()
    ref = GPT(GPTConfig(**shape, padded_vocab_size=512, loss_impl="torch")).cuda().double()
    ref.load_state_dict(fused.state_dict())
    idx, y = torch.randint(0, 512, (2, 16, 1024), device="cuda").unbind(0)
    ref(idx, y).backward()
    for dtype in (torch.bfloat16, torch.float16):
        fused.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = fused(idx, y)
        (loss * 1024.0).backward()
        for (name, p), q in zip(fused.named_parameters(), ref.parameters(), strict=True):
            err = ((p.grad.double() / 1024.0 - q.grad).norm() / q.grad.norm()).item()
            assert err < 1e-2, (dtype, name, err)
