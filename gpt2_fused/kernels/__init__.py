"""The model's and the optimizer's fast ops, one file per op with its torch reference beside it,
and the cuBLASLt binding they share with the loss (fused_loss/):

    cublaslt.py      ctypes binding of cuBLASLt matmuls with epilogues, algorithms picked by timing
    mlp.py           the MLP with its GELU in cuBLASLt GEMM epilogues (model.py); mlp_reference
    attention.py     c_attn + cuDNN attention as one op, c_proj with the residual add (model.py)
    colsum.py        bias-gradient column sums, the qkv gradient's layout in the same pass
    adamw.py         AdamW over all parameters in one Triton launch (gpt2_fused/core/optim.py)
    gemv.py          a decoding step's linear layers at batch 1 (model.Block's decoding step)
    interpreter.py   to_dtype: the fp32 -> bf16 rounding the Triton CPU interpreter gets wrong

On CPU the Triton kernels run under the Triton interpreter when TRITON_INTERPRET=1 (the tests).
Importing this package or a module of it loads no library and queries no device.
"""
