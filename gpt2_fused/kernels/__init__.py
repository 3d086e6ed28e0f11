"""The model's and the optimizer's fast ops, one module per op with its torch reference beside
it, and the cuBLASLt binding they share with the loss (fused_loss/). On CPU the Triton kernels
run under the Triton interpreter when TRITON_INTERPRET=1 (the tests). Importing this package or a
module of it loads no library and queries no device.
"""
