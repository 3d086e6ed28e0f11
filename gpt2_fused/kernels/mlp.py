"""GPT-2's MLP with the GELU and its gradient inside the GEMMs (cuBLASLt epilogues, as llm.c).

    out = r + c_proj(gelu_tanh(c_fc(x)))   x (M, D), W_fc (F, D), W_proj (D, F), F = 4 D,
                                           r (M, D) the residual stream, or none

Forward, one opaque op (mlp_gelu):
    h = x @ W_fc.T + b_fc, a = gelu_tanh(h)   one GEMM, GELU_AUX_BIAS epilogue: writes a and h
    out = a @ W_proj.T + b_proj              without r: cuBLAS addmm (bias epilogue)
    out = a @ W_proj.T + r + b_proj          with r: one cuBLASLt GEMM, C = r, BIAS epilogue
Backward (plain torch ops, so under torch.compile Inductor traces and fuses them, e.g. the two
bias sums), but for the GELU gradient:
    dh = (dout @ W_proj) * gelu_tanh'(h)     one GEMM, DGELU epilogue (dgelu_mm)
    dx = dh @ W_fc, dW_fc = dh.T @ x, db_fc = sum_rows dh (grad_sums.py), dW_proj = dout.T @ a,
    db_proj = sum dout
    dr = dout                                (the residual passes the gradient through)
The GEMMs run in the compute dtype (bf16 under autocast, on the caller's casts of the weights)
with fp32 accumulation, and the weight gradients leave them in the parameters' own dtype: fp32
for fp32 master weights, not rounded to bf16 and cast back (so the op takes each weight and bias
twice, as the parameter and as its cast: autograd hands the gradient to the parameter, and the
casts are made outside, where Inductor fuses them or the optimizer keeps them). The bias sums
are fp32 too. Saved for backward: x, h, a and the weights' casts.
What goes against F.linear + F.gelu: the GELU forward and GELU-gradient kernels (each a full
(M, F) read and write) and the casts of dW to fp32. The GELU is evaluated on the fp32
accumulator rather than on h rounded to bf16, so `a` can differ from torch's by a rounding; the
errors against fp64 are no larger (tests/test_mlp.py). Timings: bench/RESULTS.md#mlp.
The residual is added in c_proj's epilogue (no separate add that reads out back; one rounding
of the sum instead of two) only when it comes contiguous in the compute dtype (a bf16 residual
stream); any other residual (an fp32 stream) is added outside the op by torch, as the caller
would, so callers need not know which.

mlp_cublaslt is the entry point: None where it does not apply (no CUDA, no bf16/fp16 compute
dtype, no biases, widths not multiples of 8), and the caller runs the torch path (residual +
mlp_reference). Whether libcublasLt loads at all (`cublaslt.available()`, ctypes) is the
caller's to decide once, outside torch.compile's region: Dynamo cannot trace ctypes, so a
probe inside the forward would break the compiled graph into pieces (model.MLP decides at
construction).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from gpt2_fused.kernels.cublaslt import EPI_DGELU, EPI_GELU_AUX_BIAS, matmul
from gpt2_fused.kernels.gemm import as_compute, half_compute_dtype, linear_add, mm_as
from gpt2_fused.kernels.grad_sums import colsum


@torch.library.custom_op("gpt2_fused::dgelu_mm", mutates_args=())
def dgelu_mm(dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(dy @ w) * gelu_tanh'(h); dy (M, D), w (D, F), h (M, F), one dtype."""
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    matmul(dy.contiguous(), w, dh, aux=h.contiguous(), epilogue=EPI_DGELU)
    return dh


@dgelu_mm.register_fake
def _(dy, w, h):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@torch.library.custom_op("gpt2_fused::mlp_gelu", mutates_args=())
def mlp_gelu(
    x: torch.Tensor,
    w_fc: torch.Tensor,
    w_fc_c: torch.Tensor,
    b_fc: torch.Tensor,
    b_fc_c: torch.Tensor,
    w_proj: torch.Tensor,
    w_proj_c: torch.Tensor,
    b_proj: torch.Tensor,
    b_proj_c: torch.Tensor,
    residual: Optional[torch.Tensor],  # noqa: UP045 (custom_op parses the annotation)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, h, a) of the module docstring. x (M, D) in the compute dtype; w_fc, b_fc, w_proj,
    b_proj the parameters (only their gradients' dtypes are read), the _c tensors their casts to
    the compute dtype; residual None or (M, D), contiguous in the compute dtype."""
    h = x.new_empty((x.shape[0], w_fc_c.shape[0]))
    a = torch.empty_like(h)
    matmul(x, w_fc_c.t(), a, bias=b_fc_c, aux=h, epilogue=EPI_GELU_AUX_BIAS)
    if residual is None:
        return torch.addmm(b_proj_c, a, w_proj_c.t()), h, a
    return linear_add(a, w_proj_c, b_proj_c, residual), h, a


@mlp_gelu.register_fake
def _(x, w_fc, w_fc_c, b_fc, b_fc_c, w_proj, w_proj_c, b_proj, b_proj_c, residual):
    h = x.new_empty((x.shape[0], w_fc_c.shape[0]))
    return x.new_empty((x.shape[0], w_proj_c.shape[0])), h, torch.empty_like(h)


def _setup_context(ctx, inputs, output):
    x, w_fc, w_fc_c, b_fc, _, w_proj, w_proj_c, b_proj, _, residual = inputs
    _, h, a = output
    ctx.dtypes = w_fc.dtype, b_fc.dtype, w_proj.dtype, b_proj.dtype
    ctx.residual = residual is not None
    ctx.save_for_backward(x, w_fc_c, w_proj_c, h, a)


def _backward(ctx, dout, _dh, _da):
    x, w_fc_c, w_proj_c, h, a = ctx.saved_tensors
    dw_fc, db_fc, dw_proj, db_proj = ctx.dtypes
    dh = dgelu_mm(dout, w_proj_c, h)
    return (
        dh @ w_fc_c,
        mm_as(dh.t(), x, dw_fc),
        None,
        colsum(dh).to(db_fc),  # faster than Inductor's column sum here (grad_sums.py)
        None,
        mm_as(dout.t(), a, dw_proj),
        None,
        dout.sum(0, dtype=torch.float32).to(db_proj),
        None,
        dout if ctx.residual else None,  # residual: out's dtype and shape, so dout as it is
    )


mlp_gelu.register_autograd(_backward, setup_context=_setup_context)


def mlp_cublaslt(x, w_fc, b_fc, w_proj, b_proj, residual=None, weight_casts=(None,) * 4):
    """c_proj(gelu_tanh(c_fc(x))), plus residual if given (out's shape), for x (..., D) on CUDA,
    in bf16/fp16 or under such autocast; None where the epilogues do not apply (the caller then
    runs residual + mlp_reference). weight_casts: the parameters' casts to the compute dtype, in
    their order, where the caller keeps them (gpt2_fused/training/weight_casts.py), else None: cast
    here. Only tensor metadata is read here, so that Dynamo traces it into the graph."""
    if not x.is_cuda or b_fc is None or b_proj is None:
        return None
    dt = half_compute_dtype(x)
    if dt is None or x.shape[-1] % 8 or w_fc.shape[0] % 8:
        return None
    shape = (*x.shape[:-1], w_proj.shape[0])  # out's
    x = x.to(dt).reshape(-1, x.shape[-1])
    fused = (
        residual is not None
        and residual.dtype == dt
        and residual.is_contiguous()
        and tuple(residual.shape) == shape
    )
    r = residual.view(-1, shape[-1]) if fused else None  # (M, D)
    params = (w_fc, b_fc, w_proj, b_proj)
    w_fc_c, b_fc_c, w_proj_c, b_proj_c = (
        as_compute(t, c, dt) for t, c in zip(params, weight_casts, strict=True)
    )
    out, _, _ = mlp_gelu(x, w_fc, w_fc_c, b_fc, b_fc_c, w_proj, w_proj_c, b_proj, b_proj_c, r)
    out = out.view(shape)
    return out if residual is None or fused else residual + out


def mlp_reference(x, w_fc, b_fc, w_proj, b_proj):
    """The same MLP in plain torch (nn.Linear's F.linear, GPT-2's tanh GELU)."""
    return F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)
