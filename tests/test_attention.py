"""fused_loss/colsum.py (bias-gradient column sums, the qkv gradient laid out in the same pass)
and fused_loss/attention.py (c_attn + cuDNN attention as one op: model.attn_impl)."""

import pytest
import torch
import torch.nn.functional as F

from fused_loss import attention, colsum
from model import GPT, GPTConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M, C", [(1000, 48), (77, 40), (3, 16)])
def test_qkv_grad_lays_out_and_sums_the_three_parts(M, C, dtype):
    """The concatenation bit for bit; the sums against fp64 within fp32 summation error (M
    terms of size ~1: a few ulps of fp32 at these M), also for parts with a wider row stride."""
    g = torch.Generator(DEV).manual_seed(M + C)
    wide = torch.randn(3, M, C + 8, device=DEV, generator=g).to(dtype)
    parts = [wide[i, :, :C] for i in range(3)]  # row stride C + 8
    cat, sums = colsum.qkv_grad(*parts)
    want = torch.cat(parts, dim=1)
    assert torch.equal(cat, want) and cat.is_contiguous()
    assert sums.dtype == torch.float32 and sums.shape == (3 * C,)
    exact = want.double().sum(0)
    assert (sums.double() - exact).abs().max() <= 1e-6 * M + 1e-6


@pytest.mark.parametrize("N", [1, 37, 300])
def test_colsum_against_fp64(N):
    t = torch.randn(513, N, device=DEV, generator=torch.Generator(DEV).manual_seed(N))
    for dtype in (torch.bfloat16, torch.float32):
        x = t.to(dtype)
        got = colsum.colsum(x)
        assert got.dtype == torch.float32
        assert (got.double() - x.double().sum(0)).abs().max() <= 1e-4, dtype
        assert torch.equal(got, colsum.colsum(x))  # fixed order: the same bits every time


def test_colsum_inputs_are_checked():
    a = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError, match="one shape and dtype"):
        colsum.qkv_grad(a, a, torch.zeros(8, 8, device=DEV))
    with pytest.raises(ValueError, match="one shape and dtype"):
        colsum.qkv_grad(a, a, a.bfloat16())
    with pytest.raises(ValueError, match="row-major"):
        colsum.colsum(a.t())


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


def _torch_attention(x, w, b, n_head):
    """nanoGPT's path: c_attn, the split into heads, causal SDPA, heads merged."""
    B, T, C = x.shape
    q, k, v = F.linear(x, w, b).split(C, dim=2)
    q, k, v = [t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v)]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, C)


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
        ref = _grads(_torch_attention, x.double(), w.double(), b.double(), dy.double(), False)
    theirs = _grads(_torch_attention, x, w, b, dy, True)
    ours = torch.compile(attention.attention_fast, fullgraph=True) if compiled else None
    got = _grads(ours or attention.attention_fast, x, w, b, dy, True)
    for name, o, t, r in zip(("y", "dx", "dW", "db"), got, theirs, ref, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape, name
        err = ((o.double() - r).norm() / r.norm()).item()
        torch_err = ((t.double() - r).norm() / r.norm()).item()
        assert err <= 1.2 * torch_err + 1e-3, (name, err, torch_err)
    assert (got[2] != got[2].bfloat16().float()).float().mean() > 0.5  # dW not a bf16 cast


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M, C", [(32768, 768), (16384, 1600)])
def test_gpu_qkv_grad_at_gpt2_shapes(M, C):
    g = torch.Generator("cuda").manual_seed(C)
    parts = [torch.randn(M, C, device="cuda", generator=g).bfloat16() for _ in range(3)]
    cat, sums = torch.compile(colsum.qkv_grad, fullgraph=True)(*parts)
    want, want_sums = colsum.qkv_grad_reference(*parts)
    assert torch.equal(cat, want)
    torch.testing.assert_close(sums, want_sums, rtol=1e-5, atol=1e-3)
    t = torch.randn(M, 4 * C, device="cuda", generator=g).bfloat16()
    torch.testing.assert_close(colsum.colsum(t), t.float().sum(0), rtol=1e-5, atol=1e-3)


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

    def plain(y, w, b, r):
        return r + F.linear(y, w, b)

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
