"""`apply_qsa_rope`: NeoX half-split rotary embedding over the leading dims of each head (SEMANTICS §2)."""

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
