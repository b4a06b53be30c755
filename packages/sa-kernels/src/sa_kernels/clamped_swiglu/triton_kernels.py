"""Clamped SwiGLU kernels: forward and fused backward over [rows, features] with arbitrary row strides.

Two grids compute the same elementwise formula: a 2-D grid (row, feature block) for strided halves of a fused
gate/up projection, and a flat 1-D grid over all elements when gate, up and the outputs are contiguous. The launch
config (block, warps, grid, eviction hint) only changes which program computes an element, never the FP32 math,
so every config gives bit-identical outputs; the H200 sweep (`bench_clamped_swiglu.py --sweep`) picks the default.
"""

import torch
import triton
import triton.language as tl

# Forward and backward keep separate defaults: the best of each in `bench_clamped_swiglu.py --sweep` on
# the H200 ([65536, 4096] bf16: fwd 0.3718 ms, bwd 0.6235 ms).
DEFAULT_FORWARD_CONFIG = {"BLOCK": 2048, "num_warps": 8, "FLAT": True, "EVICT": False}
DEFAULT_BACKWARD_CONFIG = {"BLOCK": 4096, "num_warps": 8, "FLAT": False, "EVICT": False}
SWEEP_CONFIGS = [
    {"BLOCK": block, "num_warps": warps, "FLAT": flat, "EVICT": evict}
    for block, warps, flat, evict in [
        (2048, 8, False, False),
        (1024, 4, False, False),
        (4096, 8, False, False),
        (4096, 16, False, False),
        (2048, 8, False, True),
        (512, 4, True, False),
        (1024, 4, True, False),
        (1024, 4, True, True),
        (2048, 8, True, False),
        (4096, 8, True, False),
        (8192, 16, True, False),
        (2048, 8, True, True),
        (4096, 8, True, True),
    ]
]


@triton.jit
def _offsets(F, stride_g, stride_u, n, FLAT: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """(gate offsets, up offsets, output offsets, mask) of this program's elements; int64 only when WIDE."""
    if FLAT:
        pid = tl.program_id(0)
        if WIDE:
            pid = pid.to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
        return offs, offs, offs, offs < n
    else:
        row = tl.program_id(0)
        if WIDE:
            row = row.to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK), BLOCK)
        return row * stride_g + cols, row * stride_u + cols, row * F + cols, cols < F


@triton.jit
def _load(ptr, offs, mask, EVICT: tl.constexpr):
    if EVICT:
        x = tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _clamped_swiglu_fwd_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    F,
    n,
    stride_g,
    stride_u,
    limit,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
    FLAT: tl.constexpr,
    EVICT: tl.constexpr,
    WIDE: tl.constexpr,
):
    g_offs, u_offs, o_offs, mask = _offsets(F, stride_g, stride_u, n, FLAT, BLOCK, WIDE)
    g = _load(gate_ptr, g_offs, mask, EVICT)
    u = _load(up_ptr, u_offs, mask, EVICT)
    a = g * tl.sigmoid(g)
    if CLAMP:
        a = tl.minimum(a, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + o_offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _clamped_swiglu_bwd_kernel(
    dout_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    F,
    n,
    stride_g,
    stride_u,
    limit,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
    FLAT: tl.constexpr,
    EVICT: tl.constexpr,
    WIDE: tl.constexpr,
):
    g_offs, u_offs, o_offs, mask = _offsets(F, stride_g, stride_u, n, FLAT, BLOCK, WIDE)
    g = _load(gate_ptr, g_offs, mask, EVICT)
    u = _load(up_ptr, u_offs, mask, EVICT)
    dout = _load(dout_ptr, o_offs, mask, EVICT)
    s = tl.sigmoid(g)
    a = g * s
    da = s * (1.0 + g * (1.0 - s))
    du = dout
    if CLAMP:
        da = tl.where(a <= limit, da, 0.0)
        a = tl.minimum(a, limit)
        du = tl.where((u >= -limit) & (u <= limit), dout, 0.0)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(dgate_ptr + o_offs, (dout * u * da).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + o_offs, (du * a).to(dup_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A [rows, F] view with feature stride 1 (a copy only when no such view exists)."""
    features = x.shape[-1] if x.dim() else 1
    if x.dim() > 0 and x.stride(-1) == 1:
        try:
            return x.view(-1, features)
        except RuntimeError:
            pass
    return x.reshape(-1, features).contiguous()


def _launch(kernel, tensors, g2, u2, limit, cfg):
    rows, features = g2.shape
    n = rows * features
    # The flat grid needs densely packed rows; otherwise (strided halves) the config runs on the 2-D grid.
    flat = cfg["FLAT"] and g2.stride(0) == features and u2.stride(0) == features
    block = cfg["BLOCK"]
    # int32 offsets (fewer address instructions) whenever every element offset fits in them.
    span = max((rows - 1) * max(g2.stride(0), u2.stride(0)) + features, n) + block
    grid = (triton.cdiv(n, block),) if flat else (rows, triton.cdiv(features, block))
    kernel[grid](
        *tensors,
        features,
        n,
        g2.stride(0),
        u2.stride(0),
        limit,
        CLAMP=limit > 0,
        BLOCK=block,
        FLAT=flat,
        EVICT=cfg["EVICT"],
        WIDE=span >= 2**31 or cfg.get("WIDE", False),
        num_warps=cfg["num_warps"],
    )


def clamped_swiglu_forward(
    gate: torch.Tensor, up: torch.Tensor, limit: float, *, _config: dict | None = None
) -> torch.Tensor:
    """`_config` ({"BLOCK", "num_warps", "FLAT", "EVICT"}, optional "WIDE": force int64 offsets) is for the
    benchmark sweep and the tests."""
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    _launch(
        _clamped_swiglu_fwd_kernel, (g2, u2, out), g2, u2, limit, _config or DEFAULT_FORWARD_CONFIG
    )
    return out


def clamped_swiglu_backward(
    grad_out: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    limit: float,
    *,
    _config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    g2, u2 = _rows(gate), _rows(up)
    grad_out = grad_out.contiguous()
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if d_gate.numel() == 0:
        return d_gate, d_up
    tensors = (grad_out, g2, u2, d_gate, d_up)
    _launch(_clamped_swiglu_bwd_kernel, tensors, g2, u2, limit, _config or DEFAULT_BACKWARD_CONFIG)
    return d_gate, d_up
