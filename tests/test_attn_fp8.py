"""gpt2_fused/kernels/attn_fp8.py: x + c_proj(attention(c_attn(LN(x)))) with FP8 GEMMs and fused
casts, against the same half block in fp32 torch (the Triton interpreter, torch._scaled_mm and
torch's math attention on CPU; cuDNN's on the GPU)."""

import pytest
import torch
from torch import nn

from gpt2_fused.kernels.attn_fp8 import NAMES, attn_fp8, attn_fp8_reference, attn_state

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def half_block(B=2, T=24, C=64, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    ln = nn.LayerNorm(C).to(DEV)
    with torch.no_grad():
        ln.weight.add_(0.1 * torch.randn(C, device=DEV))
        ln.bias.add_(0.1 * torch.randn(C, device=DEV))
    attn, proj = nn.Linear(C, 3 * C).to(DEV), nn.Linear(C, C).to(DEV)
    x = torch.randn(B, T, C, device=DEV).to(dtype).requires_grad_(True)
    return x, ln, attn, proj


def rel(a, b):
    a, b = a.float(), b.float()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def run(x, ln, attn, proj, fn, dout):
    params = (x, *ln.parameters(), *attn.parameters(), *proj.parameters())
    for p in params:
        p.grad = None
    out = fn(x, ln, attn.weight, attn.bias, proj.weight, proj.bias, 2)
    out.backward(dout)
    return out.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_follow_fp32_torch(dtype):
    """The branch's output within 8 % of fp32's, every gradient within 15 % (e5m2's 2 mantissa
    bits), at the first call (dry amax passes) and at a later one (delayed scales)."""
    x, ln, attn, proj = half_block(dtype=dtype)
    dout = torch.randn(x.shape, device=DEV) * 1e-2
    ref_out, ref_grads = run(x, ln, attn, proj, attn_fp8_reference, dout)
    state = attn_state(DEV)
    names = ("x", "ln.w", "ln.b", "attn.w", "attn.b", "proj.w", "proj.b")
    for call in range(2):
        out, grads = run(x, ln, attn, proj, lambda *a: attn_fp8(*a, state), dout)
        assert out.dtype == dtype
        assert rel(out - x.detach(), ref_out - x.detach()) < 0.08, call
        for name, g, r in zip(names, grads, ref_grads, strict=True):
            assert rel(g, r) < 0.15, (call, name, rel(g, r))
    assert sorted(state.seen) == sorted(NAMES)
    assert all(state.last_amax(n) > 0 for n in NAMES)
