"""The indexer's key LayerNorm: FP32 statistics with variance `E[x²] − E[x]²`, weight/bias in x's dtype."""

import torch

from sa_kernels.backend import check_eps, resolve_backend
from sa_kernels.layer_norm import reference

__all__ = ["layer_norm_e2"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def layer_norm_e2(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, *, backend: str = "auto"
) -> torch.Tensor:
    """`((x − E[x]) / sqrt(E[x²] − E[x]² + eps)) * w + b` over the last dim, FP32 math, rounded once to x's dtype.

    `weight` and `bias` are first rounded to x's dtype (the indexer's `k_norm`). Forward only: the result carries
    no autograd history (the indexer is not trained by the LM loss).

    Args:
        x: [..., channels] bfloat16, float16 or float32 (float64 on the reference).
        weight: [channels], any floating dtype (float32 parameters are rounded to x's dtype).
        bias: [channels], like weight.
        eps: added to the variance.
        backend: "auto" (Triton on CUDA, reference on CPU), "triton" or "reference".
    Returns:
        [..., channels] in x's dtype, contiguous.
    Raises:
        TypeError: non-tensors, unsupported dtypes (float64 on Triton).
        ValueError: weight or bias not [channels], no channels, eps negative or not finite, more than
            65536 channels on Triton, bad backend.
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
    """
    fn = "layer_norm_e2"
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor; got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{fn}: {name} must be a floating tensor; got {t.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{fn}: x must be [..., channels]; got a scalar")
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (x.shape[-1],):
            raise ValueError(
                f"{fn}: {name} must be [channels] with channels == x.shape[-1] ({x.shape[-1]}); got {tuple(t.shape)}"
            )
    if x.shape[-1] == 0:
        raise ValueError(f"{fn}: x must have at least one channel; got shape {tuple(x.shape)}")
    check_eps(fn, eps)
    weight, bias = weight.contiguous(), bias.contiguous()  # the kernel reads them at unit stride
    chosen = resolve_backend(fn, backend, x, weight, bias, compiled_reference=True)
    with torch.no_grad():
        if chosen == "reference":
            return reference.layer_norm_e2(x, weight, bias, float(eps)).contiguous()
        if x.dtype == torch.float64:
            raise TypeError(
                f"{fn}: the Triton path takes bfloat16, float16 or float32 x; got {x.dtype}"
            )
        if x.shape[-1] > 65536:
            raise ValueError(
                f"{fn}: the Triton path takes at most 65536 channels; got {x.shape[-1]}"
            )
        from sa_kernels.layer_norm import triton_kernels

        return triton_kernels.layer_norm_e2(x, weight, bias, float(eps))
