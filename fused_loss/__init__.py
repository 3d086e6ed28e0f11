"""The fast paths: Triton and cuBLASLt code that the model and the optimizer call.

    linear_cross_entropy.py  fused_linear_cross_entropy: the final linear layer + cross-entropy
                             without the (tokens x vocab) logits (launchers, autograd, custom ops)
    triton_kernels.py        its Triton row kernels, with the math
    exp_gemm.py              its logits GEMM with the row pass in the epilogue (Hopper)
    reference.py             linear_cross_entropy_reference: the torch path it is tested against
    checks.py                input checks shared by both
    cublaslt.py              a ctypes binding of cuBLASLt matmuls with epilogues
    mlp.py                   the MLP with its GELU in cuBLASLt GEMM epilogues (model.py)
    attention.py             c_attn + cuDNN attention as one op, its backward's qkv pass (model.py)
    colsum.py                bias-gradient column sums, the qkv gradient's layout in the same pass
    adamw.py                 AdamW over all parameters in one Triton launch (optim.py)
    gemv.py                  a decoding step's linear layers at batch 1 (model.py, generate.py)

On CPU the kernels run under the Triton interpreter when TRITON_INTERPRET=1, else the torch path.
"""

from fused_loss.linear_cross_entropy import fused_linear_cross_entropy
from fused_loss.reference import linear_cross_entropy_reference

__all__ = ["fused_linear_cross_entropy", "linear_cross_entropy_reference"]
