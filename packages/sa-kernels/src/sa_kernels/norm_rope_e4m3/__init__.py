"""The Step-5 indexer's query epilogue: zero-centred RMSNorm, half-split RoPE, E4M3 rounding.

One kernel reads the projected queries once and writes the rounded ones once; composed from
`rms_norm`, a PyTorch RoPE and `round_to_e4m3` it took three passes and about ten small launches.
"""

import torch

from sa_kernels.backend import check_eps, resolve_backend
from sa_kernels.norm_rope_e4m3 import reference
from sa_kernels.norm_rope_e4m3.rope import rotate_half_split_

__all__ = ["rms_norm_rope_e4m3", "rotate_half_split_"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rms_norm_rope_e4m3(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """`round_to_e4m3(rope(rms_norm(x)))` per (token, head) row, rounded to x's dtype after each step.

    1. RMSNorm `x * rstd * (1 + w)` in FP32 with the weight first rounded to x's dtype (the indexer's
       `q_norm`), rounded to x's dtype;
    2. RoPE on the first `2 * half` channels, pairs `(d, d + half)`: `x1 * cos - x2 * sin` and
       `x2 * cos + x1 * sin` in FP32 without fused multiply-adds, rounded to x's dtype;
    3. E4M3 rounding (saturating at ±448, ties to even), kept in x's dtype.

    Args:
        x: [tokens, heads, dim] bfloat16, float16 or float32; channel stride 1, any other strides.
        weight: [dim], float32 in the reference models (any float dtype; rounded to x's anyway).
        eps: added to the mean square, finite and >= 0.
        cos, sin: [tokens, half] float32 with `2 * half <= dim`: the rotation of each token.
        backend: "auto" (Triton on CUDA, the reference on CPU), "triton" or "reference".
    Returns:
        [tokens, heads, dim] in x's dtype, contiguous; every value is an E4M3 value.
    Raises:
        TypeError: a non-tensor argument or a dtype other than the ones above.
        ValueError: shapes that disagree, eps out of range, bad backend.
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
    """
    fn = "rms_norm_rope_e4m3"
    named = {"x": x, "weight": weight, "cos": cos, "sin": sin}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor; got {type(t).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16, float16 or float32; got {x.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"{fn}: weight must be a floating tensor; got {weight.dtype}")
    for name in ("cos", "sin"):
        if named[name].dtype != torch.float32:
            raise TypeError(f"{fn}: {name} must be float32; got {named[name].dtype}")
    if x.dim() != 3 or x.shape[-1] == 0:
        raise ValueError(f"{fn}: x must be [tokens, heads, dim >= 1]; got {tuple(x.shape)}")
    tokens, _, dim = x.shape
    if weight.shape != (dim,):
        raise ValueError(f"{fn}: weight must be [dim={dim}]; got {tuple(weight.shape)}")
    if cos.dim() != 2 or cos.shape[0] != tokens or 2 * cos.shape[1] > dim:
        raise ValueError(
            f"{fn}: cos must be [tokens={tokens}, half] with 2 * half <= dim={dim}; "
            f"got {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape:
        raise ValueError(
            f"{fn}: sin must have cos' shape {tuple(cos.shape)}; got {tuple(sin.shape)}"
        )
    check_eps(fn, eps)
    if resolve_backend(fn, backend, x, weight, cos, sin) == "reference":
        return reference.rms_norm_rope_e4m3(x.detach(), weight, float(eps), cos, sin)
    from sa_kernels.norm_rope_e4m3 import triton_kernels

    return triton_kernels.rms_norm_rope_e4m3(
        x.detach(), weight.contiguous(), float(eps), cos.contiguous(), sin.contiguous()
    )
