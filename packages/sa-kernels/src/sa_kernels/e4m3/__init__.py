"""E4M3 rounding: BF16/FP16/FP32 → float8_e4m3fn (saturating at ±448, round-to-nearest-even) → the input dtype."""

import torch

from sa_kernels.backend import resolve_backend
from sa_kernels.e4m3 import reference

__all__ = ["round_to_e4m3"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def round_to_e4m3(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Round every element to the nearest `float8_e4m3fn` value and widen it back, in one pass.

    Bit for bit `x.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)` for every finite or infinite
    input (±inf saturate to ±448, signed zeros keep their sign); NaN stays NaN. Not differentiable.

    Args:
        x: any shape, bfloat16, float16 or float32; any strides.
        backend: "auto" (Triton on CUDA, reference on CPU), "triton" or "reference".
    Returns:
        x's shape and dtype, contiguous.
    Raises:
        TypeError: x is not a tensor or not bfloat16/float16/float32.
        ValueError: bad backend.
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
    """
    fn = "round_to_e4m3"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a tensor; got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16, float16 or float32; got {x.dtype}")
    if resolve_backend(fn, backend, x) == "reference":
        return reference.round_to_e4m3(x.detach()).contiguous()
    from sa_kernels.e4m3 import triton_kernels

    return triton_kernels.round_to_e4m3(x.detach())
