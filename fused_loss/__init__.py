"""The fused final linear layer + cross-entropy: the loss without the (tokens x vocab) logits.

    linear_cross_entropy.py  fused_linear_cross_entropy: launchers, autograd, custom ops
    triton_kernels.py        its Triton row kernels, with the math
    exp_gemm.py              its logits GEMM with the row pass in the epilogue (Hopper)
    reference.py             linear_cross_entropy_reference: the torch path it is tested against
    checks.py                input checks shared by both

The chunk GEMMs go through gpt2_fused/kernels/cublaslt.py. On CPU the kernels run under the Triton
interpreter when TRITON_INTERPRET=1, else the torch reference.
"""

from fused_loss.linear_cross_entropy import fused_linear_cross_entropy
from fused_loss.reference import linear_cross_entropy_reference

__all__ = ["fused_linear_cross_entropy", "linear_cross_entropy_reference"]
