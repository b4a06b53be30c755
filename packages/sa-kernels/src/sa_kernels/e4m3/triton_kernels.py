"""E4M3 rounding in FP32 registers by bit arithmetic (portable: no hardware FP8 conversion needed).

Normal E4M3 values (|x| ≥ 2⁻⁶) keep 3 mantissa bits: round the FP32 bit pattern at bit 20, ties to even.
Subnormals (|x| < 2⁻⁶) are multiples of 2⁻⁹: adding and subtracting 2¹⁴ (whose FP32 ulp is 2⁻⁹) rounds there.
"""

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def e4m3_round_fp32(x):
    """Round FP32 `x` to the nearest float8_e4m3fn value (saturating at ±448, ties to even), still FP32."""
    bits = x.to(tl.uint32, bitcast=True)
    a = tl.minimum(tl.abs(x), 448.0)
    abits = a.to(tl.uint32, bitcast=True)
    half = 0x7FFFF + ((abits >> 20) & 1)
    normal = ((abits + half) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, subnormal, normal)
    signed = (r.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, signed)


@triton.jit
def _round_to_e4m3_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, e4m3_round_fp32(x).to(y_ptr.dtype.element_ty), mask=mask)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    x_flat = x.contiguous().view(-1)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x_flat.numel()
    if n:
        _round_to_e4m3_kernel[(triton.cdiv(n, BLOCK),)](x_flat, y, n, BLOCK=BLOCK, num_warps=8)
    return y
