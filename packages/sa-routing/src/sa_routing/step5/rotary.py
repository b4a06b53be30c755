"""`Step5IndexerRotaryEmbedding`: NeoX half-split RoPE over the leading `rope_dim` dims, FP32 math."""

import torch
from torch import nn


class Step5IndexerRotaryEmbedding(nn.Module):
    """Rotate pairs `(d, d + rope_dim/2)` of the first `rope_dim` dims by `position * theta**(-2d/rope_dim)`.

    `forward(x, positions)`: x [B, S, ..., D] (already rounded to the activation dtype), positions int64
    [B, S] → x's shape and dtype; the rotation runs in FP32, the other dims pass through unchanged.
    """

    def __init__(self, rope_dim: int, theta: float) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.theta = theta

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        exponent = (
            torch.arange(0, self.rope_dim, 2, dtype=torch.float32, device=device) / self.rope_dim
        )
        return 1.0 / (self.theta**exponent)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.rope_dim == 0:
            return x
        if positions.shape != x.shape[:2]:
            raise ValueError(
                f"Step5IndexerRotaryEmbedding: positions must be {tuple(x.shape[:2])}; got {tuple(positions.shape)}"
            )
        half = self.rope_dim // 2
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inverse_frequencies(x.device)
        angles = angles.view(*positions.shape, *([1] * (x.dim() - 3)), half)
        cos, sin = angles.cos(), angles.sin()
        x1 = x[..., :half].float()
        x2 = x[..., half : self.rope_dim].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([rotated, x[..., self.rope_dim :]], dim=-1)
