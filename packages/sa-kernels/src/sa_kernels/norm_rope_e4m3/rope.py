"""The half-split (NeoX) rotary embedding in PyTorch ops, as the reference models compute it."""

import torch


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
