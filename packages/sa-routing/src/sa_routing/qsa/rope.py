"""`apply_qsa_rope`: NeoX half-split rotary embedding over the leading dims of each head (SEMANTICS §2),
and `rotary_table`, the `cat(cos, sin)` table it reads."""

from __future__ import annotations

import torch


def apply_qsa_rope(states: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate the first `r` dims of every head; the remaining dims pass through.

    Args:
        states: [batch, tokens, heads, head_dim] floating.
        freqs_cis: [batch, tokens, r], laid out `cat(cos[..., :r/2], sin[..., :r/2])`; cast to
            `states.dtype` before use, `r` even and `<= head_dim`.
    Returns:
        [batch, tokens, heads, head_dim] in `states.dtype`: pairs `(d, d + r/2)` for `d < r/2` rotated by
        the angle whose cosine and sine are `freqs_cis[..., d]` and `freqs_cis[..., r/2 + d]`.
    Raises:
        ValueError: `states` is not 4-D, `freqs_cis` is not 3-D, their `[batch, tokens]` differ,
            `r` is odd, zero or larger than `head_dim`.
        TypeError: either tensor is not floating point.
    """
    if states.dim() != 4:
        raise ValueError(
            f"apply_qsa_rope: states must be [batch, tokens, heads, head_dim]; got shape {tuple(states.shape)}"
        )
    if freqs_cis.dim() != 3:
        raise ValueError(
            f"apply_qsa_rope: freqs_cis must be [batch, tokens, r]; got shape {tuple(freqs_cis.shape)}"
        )
    if not states.is_floating_point() or not freqs_cis.is_floating_point():
        raise TypeError(
            f"apply_qsa_rope: states and freqs_cis must be floating point; got {states.dtype} and {freqs_cis.dtype}"
        )
    if tuple(freqs_cis.shape[:2]) != tuple(states.shape[:2]):
        raise ValueError(
            f"apply_qsa_rope: freqs_cis [batch, tokens] must equal states' {tuple(states.shape[:2])}; "
            f"got {tuple(freqs_cis.shape[:2])}"
        )
    rotary = freqs_cis.shape[-1]
    head_dim = states.shape[-1]
    if rotary == 0 or rotary % 2 or rotary > head_dim:
        raise ValueError(
            f"apply_qsa_rope: the rotary dim r = freqs_cis.shape[-1] must be even, positive and <= head_dim "
            f"({head_dim}); got {rotary}"
        )
    half = rotary // 2
    freqs = freqs_cis.to(states.dtype).unsqueeze(2)  # [B, N, 1, r]
    cos, sin = freqs[..., :half], freqs[..., half:]
    x1, x2, rest = states[..., :half], states[..., half:rotary], states[..., rotary:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def rotary_table(
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float = 10000.0,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The NeoX half-split rotary table of `positions`, as `apply_qsa_rope` (and `QSAIndexer`'s
    `freqs_cis`) reads it.

    Args:
        positions: int [...] token positions (document-relative for packed documents).
        rotary_dim: rotated dims `r` per head (even, > 0).
        theta: the RoPE base.
        device: where to build the table; default `positions.device`.
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
