"""Clamped SwiGLU kernels: forward and fused backward over [rows, features] with arbitrary row strides."""

import torch
import triton
import triton.language as tl

BLOCK_F = 2048


@triton.jit
def _clamped_swiglu_fwd_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    F,
    stride_g,
    stride_u,
    limit,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g)
    if CLAMP:
        a = tl.minimum(a, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + row * F + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _clamped_swiglu_bwd_kernel(
    dout_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    F,
    stride_g,
    stride_u,
    limit,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    a = g * s
    da = s * (1.0 + g * (1.0 - s))
    du = dout
    if CLAMP:
        da = tl.where(a <= limit, da, 0.0)
        a = tl.minimum(a, limit)
        du = tl.where((u >= -limit) & (u <= limit), dout, 0.0)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(dgate_ptr + row * F + cols, (dout * u * da).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * F + cols, (du * a).to(dup_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A [rows, F] view with feature stride 1 (a copy only when no such view exists)."""
    features = x.shape[-1] if x.dim() else 1
    if x.dim() > 0 and x.stride(-1) == 1:
        try:
            return x.view(-1, features)
        except RuntimeError:
            pass
    return x.reshape(-1, features).contiguous()


def clamped_swiglu_forward(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g2, u2 = _rows(gate), _rows(up)
    rows, features = g2.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    grid = (rows, triton.cdiv(features, BLOCK_F))
    _clamped_swiglu_fwd_kernel[grid](
        g2,
        u2,
        out,
        features,
        g2.stride(0),
        u2.stride(0),
        limit,
        CLAMP=limit > 0,
        BLOCK=BLOCK_F,
        num_warps=8,
    )
    return out


def clamped_swiglu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    g2, u2 = _rows(gate), _rows(up)
    rows, features = g2.shape
    grad_out = grad_out.contiguous()
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if d_gate.numel() == 0:
        return d_gate, d_up
    grid = (rows, triton.cdiv(features, BLOCK_F))
    _clamped_swiglu_bwd_kernel[grid](
        grad_out,
        g2,
        u2,
        d_gate,
        d_up,
        features,
        g2.stride(0),
        u2.stride(0),
        limit,
        CLAMP=limit > 0,
        BLOCK=BLOCK_F,
        num_warps=8,
    )
    return d_gate, d_up
