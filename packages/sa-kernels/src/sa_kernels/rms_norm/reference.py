"""The oracle for RMSNorm: plain PyTorch, FP32 math (FP64 for FP64 inputs), CPU or CUDA."""

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """FP64 stays FP64 (gradcheck); every other dtype computes in FP32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_scale(
    weight: torch.Tensor,
    activation_dtype: torch.dtype,
    zero_centered: bool,
    weight_in_activation_dtype: bool,
) -> torch.Tensor:
    """The per-channel multiplier: `1 + w` (zero-centred) or `w`, in the compute dtype."""
    if weight_in_activation_dtype:
        weight = weight.to(activation_dtype)
    w = weight.to(compute_dtype(activation_dtype))
    return 1 + w if zero_centered else w


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    output_dtype: torch.dtype,
    zero_centered: bool = True,
    weight_in_activation_dtype: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`y = x * rstd * scale` rounded once to `output_dtype`; `rstd = 1/sqrt(mean(x²) + eps)` over the last dim."""
    xf = x.to(compute_dtype(x.dtype))
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    scale = rms_norm_scale(weight, x.dtype, zero_centered, weight_in_activation_dtype)
    y = xf * rstd.unsqueeze(-1) * scale
    # no `.to()` when the dtype already fits: under torch.compile on torch 2.11 an autograd.Function
    # output that a no-op `.to()` returned gets zero gradients
    return (y if y.dtype == output_dtype else y.to(output_dtype)), rstd


def rms_norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered: bool = True,
    weight_in_activation_dtype: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dx, dweight)`: dx in x's dtype, dweight summed over every row in the weight's dtype (FP32 math)."""
    ct = compute_dtype(x.dtype)
    channels = x.shape[-1]
    xhat = x.to(ct) * rstd.to(ct).unsqueeze(-1)
    g = grad_y.to(ct)
    gs = g * rms_norm_scale(weight, x.dtype, zero_centered, weight_in_activation_dtype)
    dx = rstd.to(ct).unsqueeze(-1) * (gs - xhat * (gs * xhat).mean(-1, keepdim=True))
    dweight = (g * xhat).reshape(-1, channels).sum(0)
    return dx.to(x.dtype), dweight.to(weight.dtype)
