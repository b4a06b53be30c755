"""The oracle: the reference RMSNorm, the half-split RoPE (FP32, rounded once to x's dtype), the
reference E4M3 rounding."""

import torch

from sa_kernels.e4m3.reference import round_to_e4m3
from sa_kernels.norm_rope_e4m3.rope import rotate_half_split_
from sa_kernels.rms_norm.reference import rms_norm_forward


def rms_norm_rope_e4m3(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [tokens, heads, dim]; cos, sin [tokens, half] FP32 → x's shape and dtype, contiguous."""
    y, _ = rms_norm_forward(
        x, weight, eps, x.dtype, zero_centered=True, weight_in_activation_dtype=True
    )
    return round_to_e4m3(rotate_half_split_(y, cos[:, None], sin[:, None])).contiguous()
