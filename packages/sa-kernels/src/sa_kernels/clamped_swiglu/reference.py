"""The oracle for clamped SwiGLU (SEMANTICS §1.1): FP32 math (FP64 for FP64 inputs), output in the input dtype.

`a = min(silu(gate), limit)`, `u = clamp(up, -limit, limit)`, `out = a * u`; `limit <= 0` disables both clamps.
A clamp passes gradient where its input lies inside the closed interval (as `torch.clamp` does) and zero outside.
"""

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def clamped_swiglu_forward(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    ct = _compute_dtype(gate.dtype)
    g, u = gate.to(ct), up.to(ct)
    a = g * torch.sigmoid(g)
    if limit > 0:
        a = a.clamp(max=limit)
        u = u.clamp(-limit, limit)
    out = a * u
    # no `.to()` when the dtype already fits: under torch.compile on torch 2.11 an autograd.Function
    # output that a no-op `.to()` returned gets zero gradients
    return out if out.dtype == gate.dtype else out.to(gate.dtype)


def clamped_swiglu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d_gate, d_up)` in the input dtype, recomputing the activation from `gate` and `up`."""
    ct = _compute_dtype(gate.dtype)
    g, u, dout = gate.to(ct), up.to(ct), grad_out.to(ct)
    s = torch.sigmoid(g)
    a = g * s
    da = s * (1 + g * (1 - s))
    if limit > 0:
        da = torch.where(a <= limit, da, 0.0)
        a = a.clamp(max=limit)
        du = torch.where((u >= -limit) & (u <= limit), 1.0, 0.0).to(ct)
        u = u.clamp(-limit, limit)
    else:
        du = torch.ones_like(u)
    return (dout * u * da).to(gate.dtype), (dout * a * du).to(up.dtype)
