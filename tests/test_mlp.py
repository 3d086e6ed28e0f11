"""fused_loss/mlp.py: GPT-2's MLP with the GELU in cuBLASLt epilogues (model.mlp_impl)."""

import pytest
import torch

from fused_loss import mlp
from model import GPT, GPTConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_mlp_impl_is_checked_and_falls_back_on_cpu():
    with pytest.raises(ValueError, match="mlp_impl"):
        GPTConfig(mlp_impl="triton")
    kw = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**kw, loss_impl="torch"))
    other = GPT(GPTConfig(**kw, loss_impl="torch", mlp_impl="cublaslt"))
    other.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(other(idx, idx), ref(idx, idx))  # CPU: the torch path, bit for bit


def _grads(fn, x, params, dout, autocast, dtype=torch.bfloat16):
    x = x.detach().requires_grad_()
    ps = [p.detach().requires_grad_() for p in params]
    with torch.autocast("cuda", dtype, enabled=autocast):
        out = fn(x, *ps)
    out.backward(dout)
    return [out.detach(), x.grad] + [p.grad for p in ps]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("M, D", [(256, 64), (1000, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mlp_matches_reference(M, D, compiled, dtype):
    """Output and all five gradients against fp64, no worse than torch's own autocast path
    (x @ W.T in bf16/fp16, GELU from the rounded pre-activation) on the same inputs, plus a
    slack of a quarter of the unit roundoff (2^-8 for bf16, 2^-11 for fp16)."""
    g = torch.Generator("cuda").manual_seed(M + D)
    x = torch.randn(M, D, device="cuda", generator=g).to(dtype)
    params = [torch.randn(s, device="cuda", generator=g) * 0.05 for s in ((4 * D, D), (4 * D,))]
    params += [torch.randn(s, device="cuda", generator=g) * 0.05 for s in ((D, 4 * D), (D,))]
    dout = (torch.randn(M, D, device="cuda", generator=g) * 1e-2).to(dtype)
    ref = _grads(mlp.mlp_reference, x.double(), [p.double() for p in params], dout.double(), False)
    theirs = _grads(mlp.mlp_reference, x, params, dout, True, dtype)

    ours = torch.compile(mlp.mlp_cublaslt) if compiled else mlp.mlp_cublaslt
    got = _grads(ours, x, params, dout, True, dtype)
    slack = 1e-3 if dtype == torch.bfloat16 else 1.2e-4
    for name, o, t, r in zip(
        ("out", "dx", "dWfc", "dbfc", "dWproj", "dbproj"), got, theirs, ref, strict=True
    ):
        assert o.dtype == t.dtype and o.shape == t.shape, name
        err = ((o.double() - r).norm() / r.norm()).item()
        torch_err = ((t.double() - r).norm() / r.norm()).item()
        assert err <= 1.2 * torch_err + slack, (name, err, torch_err)
    # the parameters' gradients leave the GEMMs in fp32: torch's (and ours before) are the
    # compute dtype's roundings cast up, every entry representable in bf16/fp16
    for name, o, t in zip(("dWfc", "dbfc", "dWproj"), got[2:5], theirs[2:5], strict=True):
        assert torch.equal(t, t.to(dtype).float()), name
        assert (o != o.to(dtype).float()).float().mean() > 0.5, name
