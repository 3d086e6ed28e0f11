"""model.py: sizes, init, padded vocab, loss, errors, generation, checkpoints, HF interop."""

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpt2_fused.training import generate, model_io
from gpt2_fused.training.hardware import pick_device
from gpt2_fused.training.model_io import _read_safetensors, _write_safetensors
from model import GPT, GPTConfig

FIXTURES = Path(__file__).parent / "fixtures"
HF_TINY = FIXTURES / "hf_gpt2_tiny"
V, VP = 50257, 50304


def tiny(seed=0, **kw):
    # loss_impl "torch": on CPU the conftest runs fused_loss in the (slow) Triton interpreter;
    # the tests that want the fused path ask for it with a small vocab.
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=V, padded_vocab_size=VP)
    return GPT(GPTConfig(**{**cfg, "loss_impl": "torch", **kw}))


def gpt2_param_count(L, D, vocab=V, T=1024):
    """Closed form: wte + wpe + L * (attn 4D^2+4D, mlp 8D^2+5D, two LayerNorms 4D) + ln_f."""
    return vocab * D + T * D + L * (12 * D * D + 13 * D) + 2 * D


# ---------------------------------------------------------------- sizes and init


@pytest.mark.parametrize(
    "name,alias,millions",
    [("gpt2", "124M", 124.44), ("gpt2-medium", "350M", 354.82), ("gpt2-large", "774M", 774.03),
     ("gpt2-xl", "1558M", 1557.61)],
)  # fmt: skip
def test_param_counts_match_gpt2(name, alias, millions):
    assert GPTConfig.from_preset(alias) == GPTConfig.from_preset(name)
    cfg = GPTConfig.from_preset(name)
    with torch.device("meta"):
        model = GPT(cfg)
    n = model.num_params(non_embedding=False)
    assert n == gpt2_param_count(cfg.n_layer, cfg.n_embd)
    assert round(n / 1e6, 2) == millions
    assert model.num_params() == n - cfg.block_size * cfg.n_embd
    attn = 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    assert model.flops_per_token() == 6 * model.num_params() + attn


def test_preset_overrides_and_bad_configs():
    cfg = GPTConfig.from_preset("124M", block_size=256, dropout=0.1)
    assert (cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.dropout) == (12, 768, 256, 0.1)
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.from_preset("gpt3")
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPTConfig(vocab_size=100, padded_vocab_size=64)
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="loss_impl"):
        GPTConfig(loss_impl="triton")


def test_init_is_seeded_and_gpt2_like():
    a, b, c = tiny(seed=1, n_layer=4, n_embd=64), tiny(seed=1, n_layer=4, n_embd=64), tiny(seed=2)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.transformer.h[0].mlp.c_fc.weight, c.transformer.h[0].mlp.c_fc.weight)
    assert a.lm_head.weight is a.transformer.wte.weight
    wte = a.transformer.wte.weight
    assert torch.count_nonzero(wte[V:]) == 0
    assert wte[:V].std().item() == pytest.approx(0.02, rel=0.02)
    proj = torch.cat([blk.mlp.c_proj.weight.flatten() for blk in a.transformer.h])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.05)
    assert torch.count_nonzero(a.transformer.h[0].attn.c_attn.bias) == 0


# ---------------------------------------------------------------- forward and loss


@pytest.mark.parametrize("loss_impl", ["fast", "torch"])
def test_loss_equals_cross_entropy_of_unpadded_logits(loss_impl):
    vocab = 100  # small: the fused path runs in the Triton interpreter on CPU
    model = tiny(loss_impl=loss_impl, vocab_size=vocab, padded_vocab_size=128)
    with torch.no_grad():  # poisoned padding: a loss that let it into the softmax would be ~1e4
        model.transformer.wte.weight[vocab:] = 1e4
    idx = torch.randint(0, vocab, (3, 17))
    targets = torch.randint(0, vocab, (3, 17))
    targets[0, :5] = -100
    # independent reference: full-vocab logits by hand, real columns only
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(17))
    for block in model.transformer.h:
        x = block(x)
    logits = model.transformer.ln_f(x) @ model.transformer.wte.weight[:vocab].T
    expected = F.cross_entropy(logits.view(-1, vocab), targets.view(-1), ignore_index=-100)
    loss = model(idx, targets)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(idx, all_positions=True), logits, rtol=1e-5, atol=1e-5)
    last = model(idx)
    assert last.shape == (3, 1, vocab)
    torch.testing.assert_close(last, logits[:, -1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_impl,vocab", [("torch", V), ("fast", 100)])
def test_padded_rows_stay_exactly_zero_under_adamw(loss_impl, vocab):
    model = tiny(loss_impl=loss_impl, vocab_size=vocab, padded_vocab_size=(vocab + 63) // 64 * 64)
    wte = model.transformer.wte.weight
    before = wte[:vocab].detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=False)
    for step in range(4):
        idx = torch.randint(0, vocab, (2, 32))
        idx[0, 0] = vocab - 1  # the last real id is read too
        loss = model(idx, torch.randint(0, vocab, (2, 32)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        assert torch.count_nonzero(wte.grad[vocab:]) == 0, step
        opt.step()
    assert torch.count_nonzero(wte[vocab:]) == 0
    assert not torch.equal(wte[:vocab], before)


def test_low_precision_residual():
    """Under autocast the flag makes every block receive the residual stream in bf16 (fp32
    without it), the loss and gradients move only by bf16 rounding, and torch.compile traces it
    in one graph; without autocast it changes nothing."""
    a, b = tiny(seed=3, low_precision_residual=False), tiny(seed=3)
    seen = {"a": set(), "b": set()}
    for key, m in (("a", a), ("b", b)):
        for block in m.transformer.h:
            block.register_forward_pre_hook(lambda _, args, k=key: seen[k].add(args[0].dtype))
    idx = torch.randint(0, V, (2, 64))
    assert torch.equal(a(idx, idx), b(idx, idx))  # no autocast: bitwise no effect
    for dtypes in seen.values():
        dtypes.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        la, lb = a(idx, idx), b(idx, idx)
    assert seen == {"a": {torch.float32}, "b": {torch.bfloat16}}
    assert abs(la.item() - lb.item()) < 1e-2
    la.backward()
    lb.backward()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert pb.grad.dtype == torch.float32 and torch.isfinite(pb.grad).all()
        assert F.cosine_similarity(pa.grad.flatten(), pb.grad.flatten(), dim=0) > 0.99
    torch._dynamo.reset()
    compiled = torch.compile(b, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(idx, idx), lb, rtol=1e-3, atol=1e-3)


def test_int32_idx_is_accepted():
    model = tiny()
    idx = torch.randint(0, V, (2, 9))
    torch.testing.assert_close(model(idx.int()), model(idx))


@pytest.mark.parametrize(
    "idx,match",
    [
        (torch.zeros(2, 8), "int64"),
        (torch.zeros(8, dtype=torch.long), r"\(B, T\)"),
        (torch.zeros(2, 0, dtype=torch.long), r"\(B, T\)"),
        (torch.zeros(1, 65, dtype=torch.long), "block_size=64"),
        (torch.full((1, 4), V, dtype=torch.long), f"token id {V}"),
        (torch.full((1, 4), -1, dtype=torch.long), "token id -1"),
    ],
)
def test_bad_idx_gives_clear_errors(idx, match):
    with pytest.raises((TypeError, ValueError), match=match):
        tiny()(idx)


def test_bad_targets_give_clear_errors():
    model = tiny()
    idx = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="targets shape"):
        model(idx, torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=f"target {V}"):
        model(idx, torch.full((2, 8), V, dtype=torch.long))


# ---------------------------------------------------------------- softcap and z-loss


def softcap_twins(cap, **kw):
    """(plain, capped): the same weights, softcap 0 and softcap=cap. ln_f is scaled up so that
    the logits reach ~4 * cap and the cap binds."""
    plain = tiny(seed=3, **kw)
    with torch.no_grad():
        plain.transformer.ln_f.weight.mul_(12 * cap)
    capped = GPT(GPTConfig(**{**asdict(plain.config), "softcap": cap}))
    capped.load_state_dict(plain.state_dict())
    return plain, capped


def test_softcap_caps_the_returned_logits():
    """forward's and decode's logits (the ones sampled from) are softcap * tanh(z / softcap) of
    the uncapped twin's z, so within (-softcap, softcap)."""
    plain, capped = softcap_twins(2.0)
    idx = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        z = plain(idx, all_positions=True)
        assert z.abs().max() > 6.0
        logits = capped(idx, all_positions=True)
        assert logits.shape == (2, 9, V) and logits.abs().max() < 2.0
        torch.testing.assert_close(logits, 2.0 * torch.tanh(z / 2.0))
        torch.testing.assert_close(capped(idx), logits[:, -1:])
        # the KV-cache path: a prefill of 8 positions, then one decoding step
        cache = generate.StaticKVCache(2, 2, 2, 16, 16, torch.float32, "cpu")
        prefill = capped.decode(idx[:, :8], slice(0, 8), generate.Prefill(cache))
        cache.pos.fill_(8)
        cache.mask[..., :9] = 0.0
        step = capped.decode(idx[:, 8:], cache.pos, cache)
    torch.testing.assert_close(prefill, logits[:, 7])
    torch.testing.assert_close(step, logits[:, 8])


@pytest.mark.parametrize("loss_impl", ["fast", "torch"])
def test_softcap_and_z_loss_in_the_training_loss(loss_impl):
    """The loss and every gradient with softcap and z_loss equal the formula applied by hand to
    the uncapped twin's logits: mean over kept tokens of -log softmax(u)_y + z_loss * lse(u)^2,
    u = softcap * tanh(z / softcap). Both loss paths, so they agree with each other."""
    vocab, cap, z_loss = 100, 3.0, 1e-2  # small vocab: "fast" runs in the Triton interpreter
    plain, capped = softcap_twins(cap, loss_impl=loss_impl, vocab_size=vocab, padded_vocab_size=128)
    idx = torch.randint(0, vocab, (2, 13))
    targets = torch.randint(0, vocab, (2, 13))
    targets[1, 3:8] = -100
    u = cap * torch.tanh(plain(idx, all_positions=True) / cap)
    keep = targets != -100
    nll = -u.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    per_token = nll + z_loss * u.logsumexp(-1).square()
    expected = (per_token * keep).sum() / keep.sum()
    with torch.no_grad():
        without = capped(idx, targets)  # z_loss is 0 by default
    capped.z_loss = z_loss
    loss = capped(idx, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert loss > without + 0.1  # the z term is ~0.2 here
    with torch.no_grad():  # eval mode (validation) leaves it out
        torch.testing.assert_close(capped.eval()(idx, targets), without)
    capped.train()
    expected.backward()
    loss.backward()
    for (name, a), b in zip(capped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_softcap_must_be_finite_and_non_negative():
    assert GPTConfig().softcap == 0.0  # off
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
            GPTConfig(softcap=bad)


# ---------------------------------------------------------------- checkpoints and devices


def save_ckpt(path, model, **extra):
    ckpt = {"model": model.state_dict(), "model_config": asdict(model.config), "step": 0, **extra}
    torch.save(ckpt, path)


def test_from_checkpoint_file_and_newest_in_dir(tmp_path):
    old, new = tiny(seed=1), tiny(seed=2)
    save_ckpt(tmp_path / "ckpt_0000100.pt", old)
    save_ckpt(tmp_path / "ckpt_0001000.pt", new, val_loss=3.5)
    model, ckpt = model_io.from_checkpoint(tmp_path)
    assert ckpt["val_loss"] == 3.5
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p.requires_grad for p in model.parameters())  # resumable: trainer loads this way
    idx = torch.randint(0, V, (2, 10))
    # the logits: a loaded model takes today's fast paths (the fused loss would run in the
    # interpreter here), and the weights are what this checks
    logits = dict(all_positions=True)
    torch.testing.assert_close(model(idx, **logits), new(idx, **logits), rtol=0, atol=0)
    model, _ = model_io.from_checkpoint(tmp_path / "ckpt_0000100.pt")
    torch.testing.assert_close(model(idx, **logits), old(idx, **logits), rtol=0, atol=0)


def test_from_checkpoint_predated_settings(tmp_path):
    """A checkpoint written before a setting existed loads with the value it was trained with
    (model_io.PREDATED), not today's default; one that has the setting keeps its own value."""
    model = tiny()
    assert model.config.low_precision_residual is True  # today's default
    save_ckpt(tmp_path / "new.pt", model)
    loaded, ckpt = model_io.from_checkpoint(tmp_path / "new.pt")
    assert loaded.config.low_precision_residual is True
    del ckpt["model_config"]["low_precision_residual"]
    del ckpt["model_config"]["softcap"]
    torch.save(ckpt, tmp_path / "old.pt")
    loaded, _ = model_io.from_checkpoint(tmp_path / "old.pt")
    assert loaded.config.low_precision_residual is False
    assert loaded.config.softcap == 0.0  # also predates softcap: the default, off


def test_from_checkpoint_takes_todays_fast_paths(tmp_path):
    """The fast-path switches a checkpoint was trained with (here the names they had before,
    "fused" and "cublaslt", and "torch") say how that run computed, not what the model is: a
    loaded model takes today's defaults."""
    save_ckpt(tmp_path / "new.pt", tiny())
    ckpt = torch.load(tmp_path / "new.pt")
    ckpt["model_config"].update(loss_impl="fused", mlp_impl="cublaslt", attn_impl="torch")
    torch.save(ckpt, tmp_path / "old.pt")
    loaded, _ = model_io.from_checkpoint(tmp_path / "old.pt")
    switches = (loaded.config.loss_impl, loaded.config.mlp_impl, loaded.config.attn_impl)
    assert switches == ("fast", "fast", "fast")


def test_from_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ckpt_"):
        model_io.from_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model_io.from_checkpoint(tmp_path / "nope.pt")
    torch.save({"weights": 1}, tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="not a checkpoint"):
        model_io.from_checkpoint(tmp_path / "junk.pt")
    model = tiny()
    sd = model.state_dict()
    sd["transformer.h.9.ln_1.weight"] = sd.pop("transformer.h.1.ln_1.weight")
    torch.save({"model": sd, "model_config": asdict(model.config)}, tmp_path / "keys.pt")
    with pytest.raises(ValueError, match=r"missing keys \['transformer.h.1.ln_1.weight'\]"):
        model_io.from_checkpoint(tmp_path / "keys.pt")
    save_ckpt(tmp_path / "cfg.pt", model)
    ckpt = torch.load(tmp_path / "cfg.pt", weights_only=True)
    ckpt["model_config"]["rope"] = True
    torch.save(ckpt, tmp_path / "cfg.pt")
    with pytest.raises(ValueError, match=r"unknown model_config keys \['rope'\]"):
        model_io.from_checkpoint(tmp_path / "cfg.pt")
    ckpt["model_config"].pop("rope")
    ckpt["model_config"]["n_embd"] = 64
    torch.save(ckpt, tmp_path / "cfg.pt")
    with pytest.raises(ValueError, match="shape"):
        model_io.from_checkpoint(tmp_path / "cfg.pt")


def test_pick_device():
    assert pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device().type == pick_device("auto").type == expected
    with pytest.raises(ValueError, match="unsupported device|bad device"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            pick_device("cuda:0")


# ---------------------------------------------------------------- HF interop


def test_from_hf_matches_transformers_fixture():
    """tests/fixtures/hf_gpt2_tiny was written by transformers, with transformers' own logits."""
    model = model_io.from_hf(HF_TINY).eval()
    assert model.config.vocab_size == 100 and model.config.padded_vocab_size == 128
    assert torch.count_nonzero(model.transformer.wte.weight[100:]) == 0
    expected = torch.load(HF_TINY / "expected_logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model(expected["ids"], all_positions=True)
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)


def test_from_hf_reads_openai_layout_bin(tmp_path):
    """The original uploads: pytorch_model.bin, no "transformer." prefix, causal-mask buffers."""
    ref = model_io.from_hf(HF_TINY).eval()
    weights = _read_safetensors(HF_TINY / "model.safetensors")
    sd = {k.removeprefix("transformer."): v.clone() for k, v in weights.items()}
    for i in range(2):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((HF_TINY / "config.json").read_text())
    model = model_io.from_hf(tmp_path).eval()
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_save_hf_round_trip_without_transformers(tmp_path):
    model = tiny(vocab_size=100, padded_vocab_size=128)
    model_io.save_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["vocab_size"], hf["n_positions"], hf["n_embd"]) == (100, 64, 32)
    weights = _read_safetensors(tmp_path / "model.safetensors")
    assert weights["transformer.wte.weight"].shape == (100, 32)
    # HF Conv1D stores (in, out)
    assert weights["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    back = model_io.from_hf(tmp_path)
    assert back.config.softcap == 0.0
    for (k, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_save_hf_refuses_what_gpt2_cannot_express(tmp_path):
    with pytest.raises(ValueError, match="no logit softcap; cannot export a softcap=30.0 model"):
        model_io.save_hf(tiny(softcap=30.0), tmp_path)
    with pytest.raises(ValueError, match="bias=False"):
        model_io.save_hf(tiny(bias=False), tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_from_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_io.from_hf(tmp_path)
    cfg = json.loads((HF_TINY / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        model_io.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(ValueError, match="activation_function"):
        model_io.from_hf(tmp_path)


def test_safetensors_writer_agrees_with_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).bfloat16(),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "s": torch.tensor(2.5),
    }
    _write_safetensors(tmp_path / "ours.safetensors", tensors)
    theirs = st.load_file(tmp_path / "ours.safetensors")
    st.save_file(tensors, tmp_path / "theirs.safetensors")
    ours = _read_safetensors(tmp_path / "theirs.safetensors")
    for k, v in tensors.items():
        assert torch.equal(theirs[k], v) and torch.equal(ours[k], v), k


def make_hf_model(vocab=100, n_positions=16, n_embd=16, seed=1234):
    """A random transformers GPT-2 whose every tensor matters (the recipe of hf_gpt2_tiny)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    hc = transformers.GPT2Config(
        vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=2, n_head=2,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    hm = transformers.GPT2LMHeadModel(hc).eval()
    with torch.no_grad():
        for n, p in hm.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if ".weight" in n else 0.0))
    return hm


def test_transformers_import_and_export_round_trip(tmp_path):
    hm = make_hf_model(vocab=300, n_positions=32, n_embd=32, seed=5)
    hm.save_pretrained(tmp_path / "hf")
    model = model_io.from_hf(tmp_path / "hf").eval()
    assert model.config.padded_vocab_size == 320
    idx = torch.randint(0, 300, (3, 32))
    with torch.no_grad():
        expected = hm(idx).logits
        ours = model(idx, all_positions=True)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    model_io.save_hf(model, tmp_path / "ours")
    back = type(hm).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_loss():  # generation on the GPU: tests/test_generate.py
    model = tiny(seed=6, loss_impl="fast").cuda().eval()
    idx = torch.randint(0, V, (4, 33), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(idx, idx)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_compiled_model_takes_a_second_shape():
    """A compiled model that meets a new (B, T) recompiles with dynamic shapes; that graph must
    trace in full (it once failed: is_causal got a SymBool) and match eager mode."""
    model = tiny(seed=5)
    torch._dynamo.reset()  # a fresh start: the second shape below is what makes sizes dynamic
    compiled = torch.compile(model, fullgraph=True)
    for shape in [(4, 64), (2, 48), (3, 17)]:
        idx = torch.randint(0, V, shape)
        torch.testing.assert_close(compiled(idx, idx), model(idx, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loss_impl", ["torch", "fast"])
def test_gpu_compiled_training_step_matches_eager(loss_impl):
    """The trainer compiles the model: the forward must compile without graph breaks on CUDA."""
    model = tiny(seed=7, loss_impl=loss_impl).cuda()
    compiled = torch.compile(model, fullgraph=True)
    idx = torch.randint(0, V, (4, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(idx, idx)
        loss = compiled(idx, idx)
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(model.transformer.wte.weight.grad[V:]) == 0
