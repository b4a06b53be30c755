"""Clamped SwiGLU (SEMANTICS §1.1): `min(silu(gate), limit) * clamp(up, -limit, limit)`, FP32 math in registers."""

import numbers

import torch

from sa_kernels.backend import resolve_backend
from sa_kernels.clamped_swiglu import reference

__all__ = ["clamped_swiglu"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, limit, backend):
        if backend == "triton":
            from sa_kernels.clamped_swiglu import triton_kernels

            out = triton_kernels.clamped_swiglu_forward(gate, up, limit)
        else:
            out = reference.clamped_swiglu_forward(gate, up, limit)
        ctx.save_for_backward(gate, up)
        ctx.options = (limit, backend)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        limit, backend = ctx.options
        if backend == "triton":
            from sa_kernels.clamped_swiglu import triton_kernels

            d_gate, d_up = triton_kernels.clamped_swiglu_backward(grad_out, gate, up, limit)
        else:
            d_gate, d_up = reference.clamped_swiglu_backward(grad_out, gate, up, limit)
        return d_gate, d_up, None, None


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, *, backend: str = "auto"
) -> torch.Tensor:
    """Fused clamped SwiGLU with a fused backward (the activation is recomputed, nothing FP32 is stored).

    Args:
        gate: [..., features] bfloat16, float16 or float32 (float64 on the reference); any strides, e.g. one half
            of a fused gate/up projection (`gate, up = gate_up.chunk(2, -1)`).
        up: same shape and dtype as gate.
        limit: clamp bound; `silu(gate)` is clamped above at `limit` and `up` to `[-limit, limit]`;
            `limit <= 0` disables both clamps. Gradients are zero where a clamp is active.
        backend: "auto" (Triton on CUDA, reference on CPU), "triton" or "reference".
    Returns:
        [..., features] contiguous, gate's dtype; differentiable with respect to gate and up.
    Raises:
        TypeError: non-tensor inputs, mismatched or unsupported dtypes (float64 on Triton), non-numeric limit.
        ValueError: shapes differ, gate is a scalar, limit is NaN, bad backend.
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
    """
    fn = "clamped_swiglu"
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError(
            f"{fn}: gate and up must be tensors; got {type(gate).__name__}, {type(up).__name__}"
        )
    if gate.dtype not in _FLOATS:
        raise TypeError(
            f"{fn}: gate must be bfloat16, float16, float32 or float64; got {gate.dtype}"
        )
    if up.dtype != gate.dtype:
        raise TypeError(f"{fn}: up must have gate's dtype ({gate.dtype}); got {up.dtype}")
    if up.shape != gate.shape:
        raise ValueError(
            f"{fn}: up must have gate's shape {tuple(gate.shape)}; got {tuple(up.shape)}"
        )
    if gate.dim() == 0:
        raise ValueError(f"{fn}: gate must have at least one dim ([..., features]); got a scalar")
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise TypeError(f"{fn}: limit must be a float; got {type(limit).__name__}")
    limit = float(limit)
    if limit != limit:  # NaN (every comparison with it is false: both clamps would vanish silently)
        raise ValueError(f"{fn}: limit must not be NaN (use limit <= 0 to disable the clamps)")
    chosen = resolve_backend(fn, backend, gate, up, compiled_reference=True)
    if gate.numel() == 0:  # nothing to compute; the kernels' launch grid cannot be empty
        chosen = "reference"
    if chosen == "triton" and gate.dtype == torch.float64:
        raise TypeError(
            f"{fn}: the Triton path takes bfloat16, float16 or float32; got {gate.dtype}"
        )
    return _ClampedSwiGLU.apply(gate, up, float(limit), chosen)
