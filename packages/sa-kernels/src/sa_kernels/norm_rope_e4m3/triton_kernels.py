"""The Step-5 indexer's query epilogue in one pass: RMSNorm, RoPE and E4M3 rounding per row.

Each program normalises `ROWS` (token, head) rows of `C` channels and writes the channels past
the rotary ones; the rotary channels are then re-read (L1 hits) as two `[ROWS, half]` halves, so
that each pair `(d, d + half)` meets in one thread without a register shuffle. The kernel is compiled without floating-point contraction: `a * b - c * d` must round
each product as PyTorch's separate kernels do, not as one fused multiply-add.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.e4m3.triton_kernels import e4m3_round_fp32
from sa_kernels.rms_norm.triton_kernels import _layout, _scale


@triton.jit
def _rounded(x, ROUND_E4M3: tl.constexpr):
    """x rounded to E4M3 (always, but where a test checks the rotation's own bits)."""
    if ROUND_E4M3:
        return e4m3_round_fp32(x)
    return x


@triton.jit
def _load(x_rows, cols, mask):
    """Columns `cols` of the rows, as FP32."""
    return tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _normalised(x, cols, mask, rstd, w_ptr, act):
    """x (columns `cols` of the rows) RMS-normalised and rounded to `act`, as FP32."""
    w = _scale(w_ptr, cols[None, :], mask, act, True, True)
    return (x * rstd[:, None] * w).to(act).to(tl.float32)


@triton.jit
def _rms_norm_rope_e4m3_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    n_rows,
    heads,
    stride_t,
    stride_h,
    C,
    HALF,
    eps,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROUND_E4M3: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    tokens = rows // heads
    x_rows = (
        x_ptr + tokens.to(tl.int64) * stride_t + (rows - tokens * heads).to(tl.int64) * stride_h
    )
    y_rows = y_ptr + rows.to(tl.int64) * C
    act = x_ptr.dtype.element_ty

    cols = tl.arange(0, BLOCK_C)
    mask = row_ok[:, None] & (cols < C)[None, :]
    x = _load(x_rows, cols, mask)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / C + eps)
    y = _normalised(x, cols, mask, rstd, w_ptr, act)
    plain = mask & (cols >= 2 * HALF)[None, :]
    tl.store(y_rows[:, None] + cols[None, :], _rounded(y, ROUND_E4M3).to(act), mask=plain)

    # the rotated channels, re-read (L1 hits) as the two halves of each pair
    pair = tl.arange(0, BLOCK_HALF)
    rope_mask = row_ok[:, None] & (pair < HALF)[None, :]
    y1 = _normalised(_load(x_rows, pair, rope_mask), pair, rope_mask, rstd, w_ptr, act)
    halves = pair + HALF
    y2 = _normalised(_load(x_rows, halves, rope_mask), halves, rope_mask, rstd, w_ptr, act)
    angle_at = tokens.to(tl.int64)[:, None] * HALF + pair[None, :]
    cos = tl.load(cos_ptr + angle_at, mask=rope_mask, other=0.0)
    sin = tl.load(sin_ptr + angle_at, mask=rope_mask, other=0.0)
    r1 = (y1 * cos - y2 * sin).to(act).to(tl.float32)
    r2 = (y2 * cos + y1 * sin).to(act).to(tl.float32)
    tl.store(y_rows[:, None] + pair[None, :], _rounded(r1, ROUND_E4M3).to(act), mask=rope_mask)
    tl.store(
        y_rows[:, None] + (pair + HALF)[None, :], _rounded(r2, ROUND_E4M3).to(act), mask=rope_mask
    )


def rms_norm_rope_e4m3(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    _round_e4m3: bool = True,
) -> torch.Tensor:
    """x [tokens, heads, dim] (channel stride 1); cos, sin contiguous [tokens, half] FP32.
    `_round_e4m3=False` (tests only) stops before the E4M3 rounding, whose coarse steps would hide
    a one-ulp difference of the rotation."""
    x, n_rows, heads, stride_t, stride_h = _layout(x)
    channels = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return y
    half = cos.shape[-1]
    if half == 0:  # nothing to rotate; the kernel still takes (unread) pointers
        cos = sin = torch.zeros(1, dtype=torch.float32, device=x.device)
    # about 4096 elements and 32 per thread: 16 rows of 256 channels in 4 warps took 102 us for
    # 16384 x 16 rows on the H200, 112 us in 8 warps (2.6 and 2.4 TB/s)
    block_c = triton.next_power_of_2(channels)
    rows = max(1, 4096 // block_c)
    warps = max(1, min(8, rows * block_c // 1024))
    _rms_norm_rope_e4m3_kernel[(triton.cdiv(n_rows, rows),)](
        x,
        weight,
        cos,
        sin,
        y,
        n_rows,
        heads,
        stride_t,
        stride_h,
        channels,
        half,
        eps,
        ROWS=rows,
        BLOCK_C=block_c,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        ROUND_E4M3=_round_e4m3,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return y
