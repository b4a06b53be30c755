"""RMSNorm forward and backward kernels over tiles of `ROWS` rows (one row when channels are many).

Rows are addressed as `[T, H, C]` with strides `(stride_t, stride_h, 1)`, so per-head rows of a fused QKV output
are read in place; outputs (y, dx) are written contiguous `[T * H, C]`. The backward runs a fixed number of
programs that stride over row tiles, each accumulating its dweight partial in FP32 registers; the partials
(`[programs, C]`) are summed afterwards.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.backend import triton_interpret


@triton.jit
def _scale(
    w_ptr, cols, mask, ACT_DTYPE: tl.constexpr, ZERO_CENTERED: tl.constexpr, W_ACT: tl.constexpr
):
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if W_ACT:
        w = w.to(ACT_DTYPE)
    w = w.to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
    return w


@triton.jit
def _row_offsets(rows, heads, stride_t, stride_h):
    rows = rows.to(tl.int64)
    return (rows // heads) * stride_t + (rows % heads) * stride_h


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    n_rows,
    heads,
    stride_t,
    stride_h,
    C,
    eps,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    W_ACT: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mask = row_ok[:, None] & col_ok[None, :]
    x_rows = x_ptr + _row_offsets(rows, heads, stride_t, stride_h)
    x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # eps arrives as fp64 when Inductor launches the kernel inside a compiled graph
    rstd = 1.0 / tl.sqrt_rn((tl.sum(x * x, axis=1) / C + eps).to(tl.float32))
    w = _scale(w_ptr, cols[None, :], col_ok[None, :], x_ptr.dtype.element_ty, ZERO_CENTERED, W_ACT)
    y = x * rstd[:, None] * w
    y_rows = y_ptr + rows.to(tl.int64) * C
    tl.store(y_rows[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    n_rows,
    heads,
    stride_t,
    stride_h,
    C,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    W_ACT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    w = _scale(w_ptr, cols[None, :], col_ok[None, :], x_ptr.dtype.element_ty, ZERO_CENTERED, W_ACT)
    dw = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    for i in range(0, tl.cdiv(tl.cdiv(n_rows, ROWS) - pid, programs)):
        rows = (pid + i * programs) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x_rows = x_ptr + _row_offsets(rows, heads, stride_t, stride_h)
        flat = rows.to(tl.int64) * C
        x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + flat[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        gs = dy * w
        c = tl.sum(gs * xhat, axis=1) / C
        dx = rstd[:, None] * (gs - xhat * c[:, None])
        tl.store(dx_ptr + flat[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw += dy * xhat
    if COMPUTE_DW:
        tl.store(dw_ptr + pid.to(tl.int64) * C + cols, tl.sum(dw, axis=0), mask=col_ok)


def _layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """`(x, rows, heads, stride_t, stride_h)` for a [rows, C] or [T, H, C] tensor with channel stride 1."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    return x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def _tile(channels: int) -> tuple[int, int, int]:
    """`(BLOCK_C, ROWS, num_warps)`: about 4096 elements per tile, 8 warps at 4096 channels."""
    block_c = triton.next_power_of_2(channels)
    rows = max(1, 4096 // block_c)
    warps = max(1, min(16, rows * block_c // 512))
    return block_c, rows, warps


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    output_dtype: torch.dtype,
    zero_centered: bool,
    weight_in_activation_dtype: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, C] or [T, H, C] → (y contiguous with x's shape, rstd float32 x.shape[:-1])."""
    x, n_rows, heads, stride_t, stride_h = _layout(x)
    channels = x.shape[-1]
    y = torch.empty(x.shape, dtype=output_dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    block_c, rows, warps = _tile(channels)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
        x,
        weight,
        y,
        rstd,
        n_rows,
        heads,
        stride_t,
        stride_h,
        channels,
        eps,
        ROWS=rows,
        BLOCK_C=block_c,
        ZERO_CENTERED=zero_centered,
        W_ACT=weight_in_activation_dtype,
        num_warps=warps,
    )
    return y, rstd


def _programs(tiles: int, device: torch.device) -> int:
    if triton_interpret() or device.type != "cuda":
        return min(tiles, 4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(tiles, 4 * sms)


def rms_norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered: bool,
    weight_in_activation_dtype: bool,
    compute_dweight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx contiguous with x's shape in x's dtype, dweight in weight's dtype or None)."""
    x, n_rows, heads, stride_t, stride_h = _layout(x)
    channels = x.shape[-1]
    grad_y = grad_y.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, torch.zeros_like(weight) if compute_dweight else None
    block_c, rows, warps = _tile(channels)
    programs = _programs(triton.cdiv(n_rows, rows), x.device)
    partial = torch.empty(
        (programs if compute_dweight else 1, channels), dtype=torch.float32, device=x.device
    )
    _rms_norm_bwd_kernel[(programs,)](
        x,
        weight,
        grad_y,
        rstd,
        dx,
        partial,
        n_rows,
        heads,
        stride_t,
        stride_h,
        channels,
        ROWS=rows,
        BLOCK_C=block_c,
        ZERO_CENTERED=zero_centered,
        W_ACT=weight_in_activation_dtype,
        COMPUTE_DW=compute_dweight,
        num_warps=warps,
    )
    dweight = partial.sum(0).to(weight.dtype) if compute_dweight else None
    return dx, dweight
