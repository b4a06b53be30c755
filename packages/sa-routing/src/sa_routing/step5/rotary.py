"""`Step5IndexerRotaryEmbedding`: NeoX half-split RoPE over the leading `rope_dim` dims, FP32 math."""

import math
import numbers

import torch
from torch import nn

from sa_kernels.norm_rope_e4m3 import rotate_half_split_


class Step5IndexerRotaryEmbedding(nn.Module):
    """Rotate pairs `(d, d + rope_dim/2)` of the first `rope_dim` dims by `position * theta**(-2d/rope_dim)`.

    `forward(x, positions)`: x [B, S, ..., D] (already rounded to the activation dtype), positions int64
    [B, S] → x's shape and dtype; the rotation runs in FP32, the other dims pass through unchanged.
    """

    def __init__(self, rope_dim: int, theta: float) -> None:
        super().__init__()
        if (
            isinstance(rope_dim, bool)
            or not isinstance(rope_dim, int)
            or rope_dim < 0
            or rope_dim % 2
        ):
            raise ValueError(
                f"Step5IndexerRotaryEmbedding: rope_dim must be an even int >= 0; got {rope_dim!r}"
            )
        if isinstance(theta, bool) or not isinstance(theta, numbers.Real):
            raise TypeError(f"Step5IndexerRotaryEmbedding: theta must be a float; got {theta!r}")
        if not 0 < theta < math.inf:
            raise ValueError(
                f"Step5IndexerRotaryEmbedding: theta must be a finite float > 0; got {theta!r}"
            )
        self.rope_dim = rope_dim
        self.theta = theta
        self._frequencies: dict[tuple, torch.Tensor] = {}

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        """FP32 [rope_dim / 2] `theta ** (-2d / rope_dim)`, computed on `device` (its own pow) once
        per device: four launches that every call of `cos_sin` repeated. The tensor is shared
        between calls: read it, do not modify it."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, self.rope_dim, self.theta)
        frequencies = self._frequencies.get(key)
        if frequencies is None:
            exponent = (
                torch.arange(0, self.rope_dim, 2, dtype=torch.float32, device=device)
                / self.rope_dim
            )
            frequencies = 1.0 / (self.theta**exponent)
            # under CUDA-graph capture the values exist only once the graph replays
            if not (frequencies.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._frequencies[key] = frequencies
        return frequencies

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.rotate_(x.clone(), positions)

    def rotate_(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`forward` in place: only x's first `rope_dim` dims are written (no copy of the others). Returns x."""
        op = "Step5IndexerRotaryEmbedding"
        if not x.is_floating_point():
            raise TypeError(f"{op}: x must be a floating tensor; got {x.dtype}")
        if x.dim() < 3 or x.shape[-1] < self.rope_dim:
            raise ValueError(
                f"{op}: x must be [batch, tokens, ..., D >= rope_dim={self.rope_dim}]; got {tuple(x.shape)}"
            )
        if positions.dtype != torch.int64:
            raise TypeError(f"{op}: positions must be int64; got {positions.dtype}")
        if positions.shape != x.shape[:2]:
            raise ValueError(
                f"{op}: positions must be {tuple(x.shape[:2])}; got {tuple(positions.shape)}"
            )
        if self.rope_dim == 0:
            return x
        cos, sin = self.cos_sin(positions)
        # explicit sizes: a view with -1 is ambiguous when positions hold no element (B or S is 0)
        half, middle = cos.shape[-1], [1] * (x.dim() - 3)
        return rotate_half_split_(
            x, cos.view(*positions.shape, *middle, half), sin.view(*positions.shape, *middle, half)
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` of every position's angles: FP32 [*positions.shape, rope_dim / 2]."""
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inverse_frequencies(
            positions.device
        )
        return angles.cos(), angles.sin()
