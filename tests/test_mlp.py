"""gpt2_fused/kernels/mlp.py: GPT-2's MLP with the GELU in cuBLASLt epilogues (model.mlp_impl),
against mlp_reference."""

import pytest
import torch

from gpt2_fused.kernels import cublaslt, mlp
from model import GPT, GPTConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_mlp_impl_is_checked_and_falls_back_on_cpu():
    with pytest.raises(ValueError, match="mlp_impl"):
        GPTConfig(mlp_impl="triton")
    kw = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**kw, loss_impl="torch", mlp_impl="torch"))
    other = GPT(GPTConfig(**kw, loss_impl="torch", mlp_impl="fast"))
    assert not ref.transformer.h[0].mlp.use_cublaslt
    other.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(other(idx, idx), ref(idx, idx))  # CPU: the torch path, bit for bit


def _grads(fn, x, params, dout, autocast, dtype=torch.bfloat16, residual=None):
    """[out, dx, the parameters' gradients..., dresidual if given] of fn(x, *params, residual=)."""
    x = x.detach().requires_grad_()
    ps = [p.detach().requires_grad_() for p in params]
    kw = {} if residual is None else dict(residual=residual.detach().requires_grad_())
    with torch.autocast("cuda", dtype, enabled=autocast):
        out = fn(x, *ps, **kw)
    out.backward(dout.to(out.dtype))  # out is fp32 with an fp32 residual: dout's values exactly
    return [out.detach(), x.grad] + [p.grad for p in ps] + [r.grad for r in kw.values()]


def _reference(x, w_fc, b_fc, w_proj, b_proj, residual=None):
    """mlp_reference, with the residual added after it by torch, as the model's torch path does."""
    out = mlp.mlp_reference(x, w_fc, b_fc, w_proj, b_proj)
    return out if residual is None else residual + out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("residual", [None, "compute dtype", "fp32"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("M, D", [(256, 64), (1000, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mlp_matches_reference(M, D, compiled, dtype, residual):
    """Output and all five gradients (six with a residual r: dr too) against fp64, no worse than
    torch's own autocast path (x @ W.T in bf16/fp16, GELU from the rounded pre-activation, then
    r + out) on the same inputs, plus a slack of a quarter of the unit roundoff (2^-8 for bf16,
    2^-11 for fp16). r in the compute dtype is added in c_proj's epilogue; an fp32 r outside."""
    g = torch.Generator("cuda").manual_seed(M + D)
    x = torch.randn(M, D, device="cuda", generator=g).to(dtype)
    params = [torch.randn(s, device="cuda", generator=g) * 0.05 for s in ((4 * D, D), (4 * D,))]
    params += [torch.randn(s, device="cuda", generator=g) * 0.05 for s in ((D, 4 * D), (D,))]
    dout = (torch.randn(M, D, device="cuda", generator=g) * 1e-2).to(dtype)
    res = None
    if residual is not None:
        res = torch.randn(M, D, device="cuda", generator=g)
        res = res if residual == "fp32" else res.to(dtype)
    res64 = None if res is None else res.double()
    ref = _grads(
        _reference, x.double(), [p.double() for p in params], dout.double(), False, residual=res64
    )
    theirs = _grads(_reference, x, params, dout, True, dtype, residual=res)

    if compiled:
        torch._dynamo.reset()  # a fresh cache: the parametrisations would exceed its limit
    ours = torch.compile(mlp.mlp_cublaslt, fullgraph=True) if compiled else mlp.mlp_cublaslt
    cublaslt.ALGOS.clear()
    got = _grads(ours, x, params, dout, True, dtype, residual=res)
    in_epilogue = any(key[3] == cublaslt.EPI_BIAS for _, key, _, _ in cublaslt.ALGOS)
    assert in_epilogue == (residual == "compute dtype")
    slack = 1e-3 if dtype == torch.bfloat16 else 1.2e-4
    names = ("out", "dx", "dWfc", "dbfc", "dWproj", "dbproj") + (("dr",) if res is not None else ())
    for name, o, t, r in zip(names, got, theirs, ref, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape, name
        err = ((o.double() - r).norm() / r.norm()).item()
        torch_err = ((t.double() - r).norm() / r.norm()).item()
        assert err <= 1.2 * torch_err + slack, (name, err, torch_err)
    # the parameters' gradients leave the GEMMs in fp32: torch's are the
    # compute dtype's roundings cast up, every entry representable in bf16/fp16
    for name, o, t in zip(("dWfc", "dbfc", "dWproj"), got[2:5], theirs[2:5], strict=True):
        assert torch.equal(t, t.to(dtype).float()), name
        assert (o != o.to(dtype).float()).float().mean() > 0.5, name
