"""gpt2_fused/kernels/mlp_fp8.py: x + MLP(LN(x)) with FP8 GEMMs and fused casts, against the
same half block in fp32 torch (the Triton interpreter and torch._scaled_mm on CPU)."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from gpt2_fused.kernels.mlp_fp8 import NAMES, mlp_fp8, mlp_fp8_reference, mlp_state

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def half_block(D=64, M=48, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    ln = nn.LayerNorm(D).to(DEV)
    with torch.no_grad():
        ln.weight.add_(0.1 * torch.randn(D, device=DEV))
        ln.bias.add_(0.1 * torch.randn(D, device=DEV))
    fc, proj = nn.Linear(D, 4 * D).to(DEV), nn.Linear(4 * D, D).to(DEV)
    x = torch.randn(M, D, device=DEV).to(dtype).requires_grad_(True)
    return x, ln, fc, proj


def rel(a, b):
    return (
        torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float())
    ).item()


def run(x, ln, fc, proj, fn, dout):
    for p in (x, *ln.parameters(), *fc.parameters(), *proj.parameters()):
        p.grad = None
    out = fn(x, ln, fc.weight, fc.bias, proj.weight, proj.bias)
    out.backward(dout)
    grads = [p.grad.clone() for p in (x, ln.weight, ln.bias, fc.weight, fc.bias, proj.weight,
                                      proj.bias)]  # fmt: skip
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_follow_fp32_torch(dtype):
    """FP8's rounding (2^-4 e4m3, 2^-3 e5m2): the MLP's output within 8 % of fp32's, gradients
    within 15 %, at the first call (dry amax passes) and at a later one (delayed scales)."""
    x, ln, fc, proj = half_block(dtype=dtype)
    dout = torch.randn(x.shape, device=DEV) * 1e-2
    state = mlp_state(DEV)
    ref_out, ref_grads = run(x, ln, fc, proj, mlp_fp8_reference, dout)
    for call in range(2):
        out, grads = run(x, ln, fc, proj, lambda *a: mlp_fp8(*a[:1], a[1], *a[2:], state), dout)
        assert out.dtype == dtype
        assert rel(out - x.detach(), ref_out - x.detach()) < 0.08, call  # the MLP's own share
        for name, g, r in zip(("x", "ln.w", "ln.b", "fc.w", "fc.b", "proj.w", "proj.b"), grads,
                              ref_grads, strict=True):  # fmt: skip
            assert rel(g, r) < 0.15, (call, name, rel(g, r))  # e5m2 gradients: ~7-9 % here
    assert sorted(state.seen) == sorted(NAMES)
    assert all(state.last_amax(n) > 0 for n in NAMES)


def test_delayed_scale_comes_from_the_last_call():
    """Each call leaves its own amaxes for the next call's scales."""
    x, ln, fc, proj = half_block()
    state = mlp_state(DEV)
    with torch.no_grad():
        mlp_fp8(x, ln, fc.weight, fc.bias, proj.weight, proj.bias, state)
        first = {n: state.last_amax(n).clone() for n in NAMES}
        ln.weight.mul_(3)  # the LayerNorm's output range triples
        mlp_fp8(x, ln, fc.weight, fc.bias, proj.weight, proj.bias, state)
        y = torch.nn.functional.layer_norm(x, (64,), ln.weight, ln.bias, ln.eps)
    torch.testing.assert_close(state.last_amax("y")[0], y.abs().max(), rtol=1e-5, atol=1e-6)
    assert state.last_amax("y") > 2 * first["y"] and state.last_amax("a") != first["a"]


def test_fused_recipe_runs_each_blocks_halves_in_fp8():
    """GPTConfig(fp8="fused"), built on the CPU and moved: every block's halves go through
    attn_fp8 and mlp_fp8 (their states fill, on the model's device), the loss and gradients
    follow the plain model's, the state dict's keys are its."""
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=2, n_embd=64,
                    block_size=32)  # fmt: skip
    ref = GPT(cfg).to(DEV)
    model = GPT(replace(cfg, fp8="fused")).to(DEV)
    model.load_state_dict(ref.state_dict())
    assert model.state_dict().keys() == ref.state_dict().keys()
    idx = torch.randint(0, 256, (4, 33), device=DEV)
    losses = []
    for m in (ref, model):
        loss = m(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 0.02, losses
    for block in model.transformer.h:  # both halves ran in FP8
        assert sorted(block.mlp.fp8_state.seen) == sorted(NAMES)
        assert sorted(block.attn.fp8_state.seen) == sorted(block.attn.fp8_state.names)
        assert block.mlp.fp8_state.slots.device == block.attn.fp8_state.slots.device == idx.device
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert rel(p.grad, q.grad) < 0.15, name


@pytest.mark.parametrize("dropout, n_head, n_embd", [(0.1, 2, 64), (0.0, 4, 80), (0.0, 1, 144)])
def test_fused_recipe_needs_no_dropout_and_cudnns_head_sizes(dropout, n_head, n_embd):
    """Dropout; a head size of 20 (not a multiple of 8), of 144 (over 128): the plain model
    takes them, fused refuses each in GPTConfig."""
    from model import GPTConfig

    kw = dict(n_layer=1, n_head=n_head, n_embd=n_embd, block_size=32, dropout=dropout)
    GPTConfig(**kw)
    with pytest.raises(ValueError, match=r"fp8='fused' needs dropout=0.0 and n_embd / n_head in "):
        GPTConfig(**kw, fp8="fused")


def test_fused_recipe_under_torch_compile_matches_eager():
    """torch.compile leaves the FP8 halves eager (torch.compiler.disable) and compiles the rest:
    the compiled model's loss is the eager one's, and gradients reach the FP8 blocks' weights."""
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, padded_vocab_size=256, n_layer=1, n_head=2, n_embd=64,
                    block_size=32, loss_impl="torch", fp8="fused")  # fmt: skip
    with torch.device(DEV):  # as train.py builds it: the FP8 state there from the start
        model = GPT(cfg)
    idx = torch.randint(0, 256, (2, 33), device=DEV)
    want = model(idx[:, :-1], idx[:, 1:]).item()
    loss = torch.compile(model)(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert abs(loss.item() - want) < 1e-4
    assert model.transformer.h[0].mlp.c_fc.weight.grad.abs().sum() > 0
    assert model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0
