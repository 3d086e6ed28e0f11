"""What the Triton CPU interpreter (TRITON_INTERPRET=1, the tests' CPU path) gets wrong, put right
for the kernels of this repo; the compiled GPU path is untouched.

    to_dtype(v, dtype, INTERPRETED)   v.to(dtype), rounded to nearest-even for bf16 where the
                                      interpreter truncates fp32 -> bf16 (seen with triton 3.9),
                                      and for float8_e4m3fn / e5m2, where its rounding loses a
                                      carry into the exponent (127.3 -> 64; triton 3.7)

The interpreter's bf16 tl.dot is wrong too; the matrix kernels widen their operands to fp32
under INTERPRETED themselves (fused_loss/exp_gemm.py).
"""

import triton
import triton.language as tl


@triton.jit
def to_dtype(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """v.to(dtype), rounding to nearest-even for bf16 under the interpreter (which truncates)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    if INTERPRETED and dtype == tl.float8e4nv:  # 3 of fp32's 23 mantissa bits kept: exact
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)  # for e4m3's normal range (>= 2^-6)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        v = bits.to(tl.float32, bitcast=True)
    if INTERPRETED and dtype == tl.float8e5:  # 2 mantissa bits (normal range >= 2^-14)
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0xFFFFF + ((bits >> 21) & 1)) & 0xFFE00000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)
