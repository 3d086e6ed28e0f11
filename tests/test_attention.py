"""gpt2_fused/kernels/attention.py: c_attn + cuDNN attention as one op (model.attn_impl) and c_proj
with the residual add in its epilogue, against attention_reference / proj_residual_reference."""

import pytest
import torch

from gpt2_fused.kernels import attention
from model import GPT, GPTConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_attn_impl_is_checked_and_falls_back_off_hopper():
    with pytest.raises(ValueError, match="attn_impl"):
        GPTConfig(attn_impl="cudnn")
    kw = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**kw, loss_impl="torch", attn_impl="torch"))
    other = GPT(GPTConfig(**kw, loss_impl="torch"))
    assert not ref.transformer.h[0].attn.use_fast
    other.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    if not torch.cuda.is_available():  # CPU: the torch path, bit for bit
        assert not other.transformer.h[0].attn.use_fast
        assert torch.equal(other(idx, idx), ref(idx, idx))
    x = torch.randn(2, 16, 32)
    assert attention.attention_fast(x, torch.randn(96, 32), torch.randn(96), 2) is None  # CPU


def test_attention_reference_is_causal_softmax_attention():
    """The references themselves, in fp64 on CPU, against the attention written out: per head
    softmax(q k^T / sqrt(hs) + causal mask) v, and r + y W^T + b."""
    g = torch.Generator().manual_seed(0)
    B, T, C, nh = 2, 7, 12, 3
    x, w = torch.randn(B, T, C, generator=g).double(), torch.randn(3 * C, C, generator=g).double()
    b = torch.randn(3 * C, generator=g).double()
    q, k, v = (x @ w.T + b).split(C, dim=2)
    q, k, v = [t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v)]
    scores = q @ k.transpose(-1, -2) / (C // nh) ** 0.5
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    want = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
    torch.testing.assert_close(attention.attention_reference(x, w, b, nh), want)
    r, wp, bp = torch.randn_like(x), w[:C], b[:C]
    torch.testing.assert_close(attention.proj_residual_reference(x, wp, bp, r), r + x @ wp.T + bp)


def _grads(fn, x, w, b, dy, autocast, dtype=torch.bfloat16):
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    with torch.autocast("cuda", dtype, enabled=autocast):
        y = fn(x, w, b, 4)
    y.backward(dy)
    return [y.detach(), x.grad, w.grad, b.grad]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not attention.available(), reason="needs cuDNN attention on Hopper")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("B, T, C", [(2, 256, 256), (3, 200, 320)])
def test_gpu_attention_matches_torch(B, T, C, compiled):
    """y and the gradients of x, W (fp32 master) and b under bf16 autocast against fp64 math
    attention on the same inputs: no worse than torch's own bf16 path + a slack of 2^-10. dW and db
    come out in fp32, not as bf16 roundings cast up."""
    g = torch.Generator("cuda").manual_seed(T + C)
    x = torch.randn(B, T, C, device="cuda", generator=g).bfloat16()
    w = torch.randn(3 * C, C, device="cuda", generator=g) * C**-0.5
    b = torch.randn(3 * C, device="cuda", generator=g) * 0.1
    dy = (torch.randn(B, T, C, device="cuda", generator=g) * 1e-2).bfloat16()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = _grads(
            attention.attention_reference, x.double(), w.double(), b.double(), dy.double(), False
        )
    theirs = _grads(attention.attention_reference, x, w, b, dy, True)
    ours = torch.compile(attention.attention_fast, fullgraph=True) if compiled else None
    got = _grads(ours or attention.attention_fast, x, w, b, dy, True)
    for name, o, t, r in zip(("y", "dx", "dW", "db"), got, theirs, ref, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape, name
        err = ((o.double() - r).norm() / r.norm()).item()
        torch_err = ((t.double() - r).norm() / r.norm()).item()
        assert err <= 1.2 * torch_err + 1e-3, (name, err, torch_err)
    assert (got[2] != got[2].bfloat16().float()).float().mean() > 0.5  # dW not a bf16 cast


def _proj_grads(fn, y, w, b, r, dout):
    y, w, b, r = (t.detach().requires_grad_() for t in (y, w, b, r))
    with torch.autocast("cuda", torch.bfloat16):
        out = fn(y, w, b, r)
    out.backward(dout)
    return [out.detach(), y.grad, w.grad, b.grad, r.grad]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_proj_residual_matches_torch(compiled):
    """residual + c_proj(y) in one GEMM, and its gradients (the residual's is dout), against
    fp64 on the same inputs: no worse than torch's bf16 path + 2^-10."""
    g = torch.Generator("cuda").manual_seed(0)
    B, T, C = 2, 300, 256
    y = torch.randn(B, T, C, device="cuda", generator=g).bfloat16()
    w = torch.randn(C, C, device="cuda", generator=g) * C**-0.5
    b = torch.randn(C, device="cuda", generator=g) * 0.1
    r = torch.randn(B, T, C, device="cuda", generator=g).bfloat16()
    dout = (torch.randn(B, T, C, device="cuda", generator=g) * 1e-2).bfloat16()

    plain = attention.proj_residual_reference
    ref = [t.double() for t in (y, w, b, r, dout)]
    ref_y, ref_w, ref_b, ref_r, ref_d = (t.detach().requires_grad_() for t in ref)
    out = plain(ref_y, ref_w, ref_b, ref_r)
    out.backward(ref_d)
    ref = [out.detach(), ref_y.grad, ref_w.grad, ref_b.grad, ref_r.grad]
    theirs = _proj_grads(plain, y, w, b, r, dout)
    fast = attention.proj_residual_fast
    got = _proj_grads(torch.compile(fast, fullgraph=True) if compiled else fast, y, w, b, r, dout)
    for name, o, t, rf in zip(("out", "dy", "dW", "db", "dr"), got, theirs, ref, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape, name
        err = ((o.double() - rf).norm() / rf.norm()).item()
        torch_err = ((t.double() - rf).norm() / rf.norm()).item()
        assert err <= 1.2 * torch_err + 1e-3, (name, err, torch_err)
    assert fast(y.float(), w, b, r.float()) is None  # fp32, no autocast: the caller's add
