"""fused_loss/gemv.py: the batch-1 decoding GEMV (bias, GPT-2's GELU) against fp64 torch."""

import pytest
import torch

from fused_loss import gemv
from model import GPT, GPTConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check(device, n, k, dtype, bias, gelu, out_dtype=None):
    """gemv's error against fp64 no worse than torch's own F.linear in dtype (+ a rounding)."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, 1, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    ref = gemv.gemv_reference(x.double(), w.double(), None if b is None else b.double(), gelu).view(
        n
    )
    got = gemv.gemv(x, w, b, gelu, out_dtype).view(n)
    assert got.dtype == (out_dtype or dtype)
    torch_err = (gemv.gemv_reference(x, w, b, gelu).view(n).double() - ref).abs().max()
    err = (got.double() - ref).abs().max()
    ulp = ref.abs().max() * torch.finfo(dtype).eps
    assert err <= 1.2 * torch_err + ulp, (err, torch_err)
    return got


@pytest.mark.parametrize(
    "n,k,bias,gelu",
    [
        (37, 100, True, False),
        (64, 1600, True, True),
        (512, 48, False, False),
        (96, 1100, True, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_fp64_under_the_interpreter(n, k, bias, gelu, dtype):
    """Ragged N and K (masks), K over several BLOCK_K steps, with and without bias and GELU."""
    _check("cpu", n, k, dtype, bias, gelu)


def test_gemv_fp32_output_and_bad_input():
    y = _check("cpu", 40, 64, torch.bfloat16, True, False, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.randn(2, 16, dtype=torch.bfloat16), w)  # two rows
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.randn(1, 16), w)  # dtype mismatch


def test_linear_falls_back_to_f_linear_off_cuda():
    x = torch.randn(1, 1, 32, dtype=torch.bfloat16)
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    b = torch.randn(16, dtype=torch.bfloat16)
    assert not gemv.applies(x, w)  # CPU
    assert torch.equal(gemv.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    gelu = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")
    assert torch.equal(gemv.linear(x, w, b, gelu=True), gelu)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(2304, 768), (768, 3072), (6400, 1600), (1600, 6400)])
def test_gpu_gemv_at_gpt2_shapes(n, k):
    for gelu in (False, True):
        _check("cuda", n, k, torch.bfloat16, True, gelu)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decoding_at_batch_1_runs_the_gemv(monkeypatch):
    """A bf16 model decoding one sequence goes through the GEMV for the 4 linear layers of each
    block in every step (not the classifier); batch 2 and fp32 do not."""
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    model = GPT(cfg).cuda().to(torch.bfloat16).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 5), device="cuda")
    model.generate(idx, 3, temperature=0, decode="eager")
    assert len(calls) == 2 * 4 * 2, calls  # two steps after the prefill (which has 5 rows)
    calls.clear()
    model.generate(idx.repeat(2, 1), 3, temperature=0, decode="eager")
    model.float().generate(idx, 3, temperature=0, decode="eager")
    assert calls == []
