"""gpt2_fused/kernels/gemv.py: the batch-1 decoding GEMV (LayerNorm prologue, bias, GELU, residual
add) against gemv_reference in fp64, alone and as model.Block's decoding step."""

import pytest
import torch
from sm90 import compile_for_sm90, needs_nvidia_backend

from gpt2_fused.kernels import gemv
from gpt2_fused.training import generate
from model import GPT, GPTConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(device, n, k, dtype, bias, ln, residual, seed=0):
    g = torch.Generator().manual_seed(n + k + seed)
    x = (3 * torch.randn(1, 1, k, generator=g) + 1).to(device, dtype)  # LN must matter
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    lnp = None
    if ln:
        lnp = (1 + 0.5 * torch.randn(k, generator=g)).to(device, dtype)
        lnp = (lnp, torch.randn(k, generator=g).to(device, dtype) if bias else None, 1e-5)
    r = torch.randn(1, 1, n, generator=g).to(device, dtype) if residual else None
    return x, w, b, lnp, r


def _double(t):
    if isinstance(t, tuple):
        return tuple(_double(u) for u in t)
    return t.double() if isinstance(t, torch.Tensor) else t


def _check(device, n, k, dtype, bias, gelu, ln=False, residual=False, out_dtype=None):
    """gemv's error against fp64 no worse than torch's own calls in dtype (+ a rounding)."""
    x, w, b, lnp, r = _inputs(device, n, k, dtype, bias, ln, residual)
    kw = dict(gelu=gelu)
    ref = gemv.gemv_reference(*_double((x, w, b)), ln=_double(lnp), residual=_double(r), **kw)
    got = gemv.gemv(x, w, b, ln=lnp, residual=r, out_dtype=out_dtype, **kw)
    assert got.shape == (1, 1, n) and got.dtype == (out_dtype or dtype)
    torch_err = (gemv.gemv_reference(x, w, b, ln=lnp, residual=r, **kw).double() - ref).abs()
    err = (got.double() - ref).abs().max()
    ulp = ref.abs().max() * torch.finfo(dtype).eps
    assert err <= 1.2 * torch_err.max() + ulp, (err, torch_err.max())
    return got


@pytest.mark.parametrize(
    "n,k,bias,gelu,ln,residual",
    [
        (37, 100, True, False, False, False),  # ragged N and K: the masks
        (64, 1600, True, True, True, False),  # c_fc's kind: LN, bias, GELU; KP = 2048
        (512, 48, False, False, True, True),  # LN without weights' bias, residual
        (96, 1100, True, False, False, True),  # a projection's kind: bias and residual
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_fp64_under_the_interpreter(n, k, bias, gelu, ln, residual, dtype):
    _check("cpu", n, k, dtype, bias, gelu, ln, residual)


def test_gemv_fails_without_its_layer_norm_or_residual():
    """The reference differs from the kernel's output once the LN or the residual is dropped:
    the checks above can tell (the inputs are far from normalised, the residual is O(1))."""
    x, w, b, lnp, r = _inputs("cpu", 64, 96, torch.bfloat16, True, True, True)
    got = gemv.gemv(x, w, b, ln=lnp, residual=r).double()
    for kw in (dict(ln=_double(lnp)), dict(residual=_double(r))):  # one of the two left out
        other = gemv.gemv_reference(*_double((x, w, b)), **kw)
        assert (got - other).abs().max() > 0.1


def test_gemv_fp32_output_and_bad_input():
    y = _check("cpu", 40, 64, torch.bfloat16, True, False, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.randn(2, 16, dtype=torch.bfloat16), w)  # two rows
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.randn(1, 16), w)  # dtype mismatch
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv(torch.randn(1, 16, dtype=torch.bfloat16), w, residual=w[0, :4])


def test_applies_only_to_one_row_on_cuda_without_grad():
    x = torch.randn(1, 1, 32, dtype=torch.bfloat16)
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not gemv.applies(x, w)  # CPU
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        with torch.no_grad():
            assert gemv.applies(xc, wc)
            assert not gemv.applies(xc.repeat(2, 1, 1), wc)  # two rows
            assert not gemv.applies(xc.float(), wc.float())
        assert not gemv.applies(xc, wc)  # grad enabled


@pytest.mark.parametrize("n_embd,n_head", [(96, 3), (48, 2)])
def test_block_decoding_step_matches_the_block_forward_under_the_interpreter(n_embd, n_head):
    """Block._decode_row (the four GEMVs with LN prologues, residual epilogues and the key and
    value stores) against the block's plain forward through the same cache, both against fp64:
    the same output and the same cache, changed at pos only. K is no power of two (96, 48: KP
    128, 64; the MLP's projection 512, 256)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=n_head, n_embd=n_embd, block_size=16, vocab_size=64,
                    padded_vocab_size=64)  # fmt: skip
    hs = n_embd // n_head
    model = GPT(cfg).eval()
    block = model.transformer.h[0]
    with torch.no_grad():  # LayerNorms that are not the identity
        for ln in (block.ln_1, block.ln_2):
            ln.weight.normal_(1, 0.3)
            ln.bias.normal_(0, 0.3)
    x = 2 * torch.randn(1, 1, n_embd) + 0.5
    keys = torch.randn(1, n_head, 8, hs, generator=torch.Generator().manual_seed(1))

    def step(blk, dtype, fused):
        cache = generate.StaticKVCache(1, 1, n_head, hs, 8, dtype, "cpu")
        cache.k[0].copy_(keys)  # positions >= pos hold stale values: only pos may change
        cache.v[0].copy_(keys * 0.5)
        cache.pos.fill_(5)
        cache.mask[..., :6] = 0.0
        with torch.no_grad():
            out = (blk._decode_row if fused else blk.forward)(x.to(dtype), cache, 0)
        return out.double(), cache.k[0].double(), cache.v[0].double()

    ref = step(block.double(), torch.float64, False)
    block.to(torch.bfloat16)
    plain, fused = step(block, torch.bfloat16, False), step(block, torch.bfloat16, True)
    for name, r, p, f in zip(("output", "keys", "values"), ref, plain, fused, strict=True):
        if name != "output":  # the cache: written at pos (5) only
            others = [t for t in range(8) if t != 5]
            assert torch.equal(f[:, :, others], p[:, :, others]), name
            r, p, f = r[:, :, 5], p[:, :, 5], f[:, :, 5]
        plain_err, fused_err = (p - r).abs().max(), (f - r).abs().max()
        assert fused_err <= 1.5 * plain_err + r.abs().max() * 2**-8, (name, fused_err, plain_err)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(2304, 768), (768, 3072), (6400, 1600), (1600, 6400)])
def test_gpu_gemv_at_gpt2_shapes(n, k):
    for gelu, ln, residual in ((False, True, False), (True, True, False), (False, False, True)):
        _check("cuda", n, k, torch.bfloat16, True, gelu, ln, residual)


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
    generate.generate(model, idx, 3, temperature=0, decode="eager")
    assert len(calls) == 2 * 4 * 2, calls  # two steps after the prefill (which has 5 rows)
    calls.clear()
    generate.generate(model, idx.repeat(2, 1), 3, temperature=0, decode="eager")
    generate.generate(model.float(), idx, 3, temperature=0, decode="eager")
    assert calls == []


# The kernel at its CUDA launch for 1558M's c_attn (LN prologue, GELU, the key and value stores)
# and mlp c_proj (K = 6400, residual), with PDL: the weight rows must load 16 bytes at a time.
COMPILE = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpt2_fused.kernels import gemv

out = {}
for k in (1600, 6400):
    sig = {f"{n}_ptr": "*bf16" for n in ("x", "w", "b", "r", "ln_w", "ln_b", "y", "k", "v")}
    sig |= {"pos_ptr": "*i64", "N": "i32", "eps": "fp32", "stride_head": "i32"}
    KP = triton.next_power_of_2(k)
    consts = dict(K=k, KP=KP, BLOCK_N=max(1, gemv.ELEMENTS // KP), HAS_BIAS=True, LN=k == 1600,
                  LN_BIAS=True, GELU=k == 1600, RESIDUAL=k == 6400, KV=k == 1600, HEAD=64,
                  PDL=True, INTERPRETED=False)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n][0] == "*"}
    src = ASTSource(fn=gemv.gemv_kernel, signature=dict(sig, **{c: "constexpr" for c in consts}),
                    constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=gemv.NUM_WARPS)).asm["ptx"]
    out[f"K={k}"] = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx))
print(json.dumps(out))
"""


@needs_nvidia_backend
def test_gemv_compiles_for_sm90_with_16_byte_weight_loads():
    loads = compile_for_sm90(COMPILE)
    assert len(loads) == 2 and all(v4 >= 1 for v4 in loads.values()), loads
