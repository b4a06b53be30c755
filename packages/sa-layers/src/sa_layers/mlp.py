"""The dense feed-forward of Step-5 decoder layers: a clamped SwiGLU MLP (SEMANTICS §1.1)."""

import math
import numbers

import torch
from torch import nn

from sa_kernels import clamped_swiglu


class ClampedSwiGLUMLP(nn.Module):
    """`down_proj(clamped_swiglu(gate_proj(x), up_proj(x), limit))`, no biases.

    Args:
        hidden_size, intermediate_size: model and feed-forward widths.
        limit: the SwiGLU clamp; `limit <= 0` disables it.
    Shapes:
        x: [..., hidden_size] in the parameters' dtype → [..., hidden_size].
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        limit: float,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"ClampedSwiGLUMLP: {name} must be an int; got {size!r}")
        if hidden_size < 1 or intermediate_size < 1:
            raise ValueError(
                f"ClampedSwiGLUMLP: hidden_size and intermediate_size must be >= 1; got {hidden_size}, {intermediate_size}"
            )
        if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
            raise TypeError(f"ClampedSwiGLUMLP: limit must be a float; got {limit!r}")
        if math.isnan(limit):
            raise ValueError(
                f"ClampedSwiGLUMLP: limit must not be NaN (<= 0 disables the clamp); got {limit!r}"
            )
        factory = {"dtype": dtype, "device": device}
        self.limit = float(limit)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.gate_proj.in_features
        if x.dim() < 1 or x.shape[-1] != hidden:
            raise ValueError(
                f"ClampedSwiGLUMLP: x must be [..., hidden_size={hidden}]; got {tuple(x.shape)}"
            )
        weight_dtype = self.gate_proj.weight.dtype
        if x.dtype != weight_dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"ClampedSwiGLUMLP: x must have the MLP's dtype ({weight_dtype}); got {x.dtype}"
            )
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
