"""Fused final linear layer + cross-entropy that never materialises the (tokens x vocab) logits.

Public API: `fused_linear_cross_entropy` (Triton kernels between cuBLASLt GEMMs on CUDA; on CPU
the Triton interpreter when TRITON_INTERPRET=1, else the torch reference) and
`linear_cross_entropy_reference`.
Also here, for model.py: the MLP with its GELU in cuBLASLt GEMM epilogues (`mlp.py`, on the
ctypes binding in `cublaslt.py`); for train.py: AdamW over all parameters in one Triton launch
(`adamw.py`).
"""

from fused_loss.fused import fused_linear_cross_entropy
from fused_loss.reference import linear_cross_entropy_reference

__all__ = ["fused_linear_cross_entropy", "linear_cross_entropy_reference"]
