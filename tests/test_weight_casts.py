"""gpt2_fused/training/weight_casts.py: the matmul parameters' bf16 casts kept by MultiTensorAdamW,
against the casts the forward makes per call (the path without them)."""

import pytest
import torch

from gpt2_fused.kernels.adamw import MultiTensorAdamW
from gpt2_fused.training import weight_casts
from model import GPT, GPTConfig

KW = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64)


def _model(device="cpu", fast=True, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**KW)).to(device)
    for block in model.transformer.h if fast is not None else []:
        block.attn.use_fast = block.mlp.use_cublaslt = fast  # on CPU the flags say which
    return model


def _linears(model):
    return [
        m
        for b in model.transformer.h
        for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)
    ]


def _step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()


def test_attach_keeps_each_fast_linear_cast_through_steps():
    model = _model()
    opt = MultiTensorAdamW(model.parameters(), lr=1e-2)
    assert weight_casts.attach(model, opt, torch.bfloat16) == 4 * KW["n_layer"] + 1  # + lm_head
    pairs = [
        (p, c) for m in _linears(model) for p, c in zip(m.parameters(), m.weight_casts, strict=True)
    ]
    assert len(pairs) == 8 * KW["n_layer"]  # weights and biases
    assert model.lm_head.weight_casts[1] is None  # no bias
    pairs.append((model.lm_head.weight, model.lm_head.weight_casts[0]))  # the tied embedding
    base = pairs[0][1].untyped_storage().data_ptr()
    for p, c in pairs:
        assert c.dtype == torch.bfloat16 and c.shape == p.shape and c.is_contiguous()
        assert c.untyped_storage().data_ptr() == base  # one buffer
        assert c.data_ptr() % 16 == 0  # the kernel's wide stores
        assert torch.equal(c, p.detach().to(torch.bfloat16))
    for seed in range(2):
        _step(model, opt, seed)
        for p, c in pairs:
            assert torch.equal(c, p.detach().to(torch.bfloat16))
    before = _model().transformer.h[0].attn.c_attn.weight
    assert (pairs[0][1].float() - before).abs().max() > 1e-3
    model.load_state_dict(_model(seed=1).state_dict())  # a later load: the casts follow it
    for p, c in pairs:
        assert torch.equal(c, p.detach().to(torch.bfloat16))


def test_attach_only_where_the_optimizer_keeps_every_update():
    """Nothing for torch's AdamW (it would not write the casts), fp32 compute, Linears off the
    fast paths (they never read a cast) or under FP8 (casts of their own), lm_head without the
    fused loss (torch's loss casts it itself)."""
    model = _model()
    assert weight_casts.attach(model, torch.optim.AdamW(model.parameters()), torch.bfloat16) == 0
    assert weight_casts.attach(model, MultiTensorAdamW(model.parameters()), torch.float32) == 0
    assert all(m.weight_casts == (None, None) for m in _linears(model))
    assert model.lm_head.weight_casts == (None, None)
    off = _model(fast=False)
    assert weight_casts.attach(off, MultiTensorAdamW(off.parameters()), torch.bfloat16) == 1
    assert all(m.weight_casts == (None, None) for m in _linears(off))
    assert off.lm_head.weight_casts[0] is not None  # the fused loss reads it on any path
    torch.manual_seed(0)
    no_bias = GPT(GPTConfig(**KW, bias=False, loss_impl="torch"))  # the fast ops need biases
    for block in no_bias.transformer.h:
        block.attn.use_fast = block.mlp.use_cublaslt = True
    assert weight_casts.attach(no_bias, MultiTensorAdamW(no_bias.parameters()), torch.bfloat16) == 0
    assert no_bias.lm_head.weight_casts == (None, None)
    model.transformer.h[0].mlp.fp8_state = object()
    opt = MultiTensorAdamW(model.parameters())
    assert weight_casts.attach(model, opt, torch.float16) == 4 * KW["n_layer"] - 2 + 1
    assert model.transformer.h[0].mlp.c_fc.weight_casts == (None, None)
    assert model.transformer.h[1].mlp.c_fc.weight_casts[1].dtype == torch.float16
    assert model.lm_head.weight in opt.weight_casts  # the tied embedding, for the fused loss


def _train(model, steps, mode):
    """Losses and final weights of `steps` MultiTensorAdamW steps under bf16 autocast, with
    the weights' casts kept by the optimizer or not (mode: None eager, else torch.compile's)."""
    opt = MultiTensorAdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if mode == "kept":
        assert weight_casts.attach(model, opt, torch.bfloat16) == 4 * KW["n_layer"] + 1
    run = torch.compile(model, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randperm(KW["vocab_size"], generator=gen)[: KW["block_size"] + 1]
        idx = idx.view(1, -1).cuda()
        with torch.autocast("cuda", torch.bfloat16):
            loss = run(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_weight_casts_train_as_per_call_casts():
    """Compiled with CUDA graphs (the casts as static inputs the optimizer rewrites between
    replays), 4 steps: the same losses and weights as the per-call casts. A stale cast would be
    a step's update, ~lr = 3e-3, off. One sequence of distinct tokens a step, so that no
    embedding row takes two atomic adds in an order that varies (with batch 4 and repeated
    tokens, wte and wpe came out 3.7e-9 apart and a loss 3.5e-5)."""
    built = _model("cuda", fast=None).transformer.h
    if not all(b.mlp.use_cublaslt and b.attn.use_fast for b in built):
        pytest.skip("the fast paths do not apply on this GPU")
    kept_losses, kept = _train(_model("cuda", fast=None), 4, "kept")
    ref_losses, ref = _train(_model("cuda", fast=None), 4, "per call")
    assert kept_losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert len(set(kept_losses)) > 1  # it trained
    for a, b in zip(kept, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
