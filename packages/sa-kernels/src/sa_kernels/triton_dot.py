"""`fp32_dot`: the FP32-accumulating `tl.dot` shared by Triton kernels here and in sa-routing.

Triton's interpreter multiplies BF16 dot operands wrongly (bit patterns as integers), so kernels that
must also run under `TRITON_INTERPRET=1` widen 16-bit operands first there; the widened products are
exact, as the BF16 × BF16 products of the tensor cores are.
"""

import triton
import triton.language as tl


@triton.jit
def fp32_dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with FP32 accumulation. IEEE: exact FP32 products (FP32 operands, no TF32); UPCAST: widen
    16-bit operands to FP32 first (pass `triton_interpret()` for 16-bit operands)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
