"""Rotary tables: `cat(cos, sin)` at integer positions, computed once per model forward."""

import torch


def rotary_table(
    positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0, *, device=None
) -> torch.Tensor:
    """The NeoX half-split rotary table of `positions`, as `sa_routing.apply_qsa_rope` reads it.

    Args:
        positions: int [...] token positions (document-relative for packed documents).
        rotary_dim: rotated dims `r` per head (even, > 0).
        theta: the RoPE base.
    Returns:
        float32 [..., r]: `cat(cos(p · f), sin(p · f))` with `f_i = theta ** (-2i / r)`, i < r / 2,
        computed in float64 and rounded once.
    Raises:
        TypeError: positions is not an integer tensor.
        ValueError: rotary_dim is not a positive even int or theta is not positive.
    """
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point():
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(f"rotary_table: positions must be an integer tensor; got {got}")
    if (
        isinstance(rotary_dim, bool)
        or not isinstance(rotary_dim, int)
        or rotary_dim < 2
        or rotary_dim % 2
    ):
        raise ValueError(
            f"rotary_table: rotary_dim must be a positive even int; got {rotary_dim!r}"
        )
    if not theta > 0:
        raise ValueError(f"rotary_table: theta must be > 0; got {theta!r}")
    device = positions.device if device is None else device
    inverse = theta ** (
        -torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    )
    angle = positions.to(device=device, dtype=torch.float64)[..., None] * inverse
    return torch.cat((angle.cos(), angle.sin()), dim=-1).float()
