"""The oracle: the reference RMSNorm, the half-split RoPE in FP32 with one rounding, E4M3 rounding."""

import torch

from sa_kernels.e4m3.reference import round_to_e4m3
from sa_kernels.rms_norm.reference import rms_norm_forward


def rotate_half_split_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs `(d, d + half)` of x's first `2 * half` dims in place; `half = cos.shape[-1]`.

    `x1 * cos - x2 * sin` and `x2 * cos + x1 * sin` in FP32, each product and sum rounded on its own
    (no fused multiply-add), then one rounding to x's dtype. cos, sin: FP32, broadcastable to
    `x[..., :half]`. Returns x."""
    half = cos.shape[-1]
    if half == 0:
        return x
    x1 = x[..., :half].float()
    x2 = x[..., half : 2 * half].float()
    x[..., : 2 * half] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return x


def rms_norm_rope_e4m3(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [tokens, heads, dim]; cos, sin [tokens, half] FP32 → x's shape and dtype, contiguous."""
    y, _ = rms_norm_forward(
        x, weight, eps, x.dtype, zero_centered=True, weight_in_activation_dtype=True
    )
    return round_to_e4m3(rotate_half_split_(y, cos[:, None], sin[:, None])).contiguous()
