"""What the fast paths' GEMMs (mlp.py, attention.py) share: the compute dtype they run in, the
parameters' casts into it, a GEMM whose result leaves in the parameter's own dtype, and a linear
layer with the residual added in its cuBLASLt epilogue."""

import torch

from gpt2_fused.kernels.cublaslt import EPI_BIAS, matmul


def half_compute_dtype(x):
    """The dtype x's matmuls run in on CUDA (autocast's, else x's own) when it is bf16 or fp16,
    else None: where the cuBLASLt and cuDNN paths of this package apply (model.py's fast paths)."""
    dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return dt if dt in (torch.bfloat16, torch.float16) else None


def as_compute(w, cast, dt):
    """w in the compute dtype dt: its kept cast when there is one in dt, else w.to(dt)."""
    return cast if cast is not None and cast.dtype == dt else w.to(dt)


def mm_as(a, b, dtype):
    """a @ b with fp32 accumulation, the result in `dtype` (fp32 as the GEMM writes it: CUDA)."""
    if dtype == a.dtype:
        return a @ b
    return torch.mm(a, b, out_dtype=torch.float32).to(dtype)


def linear_add(a, w_c, b_c, residual):
    """residual + a @ w_c.T + b_c as one cuBLASLt GEMM (C = residual, BIAS epilogue; out a new
    buffer): a (M, K), w_c (N, K), b_c (N,) and residual (M, N) contiguous, all in the compute
    dtype. A residual that is not 16-byte aligned (which cublaslt.matmul refuses as C) gets addmm
    + add. The c_proj of the MLP (mlp.mlp_gelu) and of attention (attention.proj_residual)."""
    if residual.data_ptr() % 16:
        return torch.addmm(b_c, a, w_c.t()).add_(residual)
    out = torch.empty_like(residual)
    return matmul(a, w_c.t(), out, bias=b_c, c=residual, beta=1.0, epilogue=EPI_BIAS)
