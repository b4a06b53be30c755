"""Zero-centred RMSNorm with FP32 statistics: plain rows, rows with their rstd, and strided per-head rows.

`y = x * rstd * (1 + w)` (or `x * rstd * w` with `zero_centered=False`), FP32 math, one rounding to the output
dtype; backward gives dx in x's dtype and dweight in the weight's dtype (FP32 accumulation).
"""

import torch

from sa_kernels.backend import check_eps, resolve_backend
from sa_kernels.rms_norm import reference

__all__ = ["grouped_rms_norm", "rms_norm", "rms_norm_with_rstd"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TRITON_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _RMSNorm(torch.autograd.Function):
    """x is either [rows, C] or a [T, H, C] strided view with channel stride 1."""

    @staticmethod
    def forward(
        ctx, x, weight, eps, output_dtype, zero_centered, weight_in_activation_dtype, backend
    ):
        if backend == "triton":
            from sa_kernels.rms_norm import triton_kernels

            y, rstd = triton_kernels.rms_norm_forward(
                x, weight, eps, output_dtype, zero_centered, weight_in_activation_dtype
            )
        else:
            y, rstd = reference.rms_norm_forward(
                x, weight, eps, output_dtype, zero_centered, weight_in_activation_dtype
            )
        ctx.save_for_backward(x, weight, rstd)
        ctx.options = (zero_centered, weight_in_activation_dtype, backend)
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        zero_centered, weight_in_activation_dtype, backend = ctx.options
        if backend == "triton":
            from sa_kernels.rms_norm import triton_kernels

            dx, dweight = triton_kernels.rms_norm_backward(
                grad_y,
                x,
                weight,
                rstd,
                zero_centered,
                weight_in_activation_dtype,
                ctx.needs_input_grad[1],
            )
        else:
            dx, dweight = reference.rms_norm_backward(
                grad_y, x, weight, rstd, zero_centered, weight_in_activation_dtype
            )
        return dx, dweight if ctx.needs_input_grad[1] else None, None, None, None, None, None


def _check(
    fn: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    output_dtype,
    backend: str,
    min_rank: int = 1,
    name: str = "x",
) -> tuple[str, torch.dtype]:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"{fn}: {name} and weight must be tensors; got {type(x).__name__}, {type(weight).__name__}"
        )
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"{fn}: {name} must be float32, bfloat16, float16 or float64; got {x.dtype}"
        )
    if weight.dtype not in _FLOATS:
        raise TypeError(
            f"{fn}: weight must be a floating tensor (float32 expected); got {weight.dtype}"
        )
    if x.dim() < min_rank:
        raise ValueError(
            f"{fn}: {name} must have at least {min_rank} dims; got shape {tuple(x.shape)}"
        )
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"{fn}: weight must be [channels] with channels == {name}.shape[-1] ({x.shape[-1]}); got {tuple(weight.shape)}"
        )
    if x.shape[-1] == 0:
        raise ValueError(f"{fn}: {name} must have at least one channel; got shape {tuple(x.shape)}")
    check_eps(fn, eps)
    if output_dtype is None:
        output_dtype = x.dtype
    if not isinstance(output_dtype, torch.dtype) or output_dtype not in _FLOATS:
        raise TypeError(
            f"{fn}: output_dtype must be None or a floating dtype; got {output_dtype!r}"
        )
    chosen = resolve_backend(fn, backend, x, weight, compiled_reference=True)
    if chosen == "triton":
        if x.dtype not in _TRITON_FLOATS or output_dtype not in _TRITON_FLOATS:
            raise TypeError(
                f"{fn}: the Triton path takes float32/bfloat16/float16 {name} and output_dtype; "
                f"got {x.dtype} → {output_dtype} (use backend='reference' for float64)"
            )
        if x.shape[-1] > 65536:
            raise ValueError(
                f"{fn}: the Triton path takes at most 65536 channels; got {x.shape[-1]}"
            )
    return chosen, output_dtype


def rms_norm_with_rstd(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    output_dtype: torch.dtype | None = None,
    zero_centered: bool = True,
    *,
    weight_in_activation_dtype: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim that also returns the reciprocal RMS.

    Args:
        x: [..., channels] float32 (the residual stream), bfloat16 or float16 (float64 on the reference).
        weight: [channels], float32; the scale is `1 + weight` when `zero_centered`, else `weight`.
        eps: added to the mean square before the reciprocal square root.
        output_dtype: dtype of `y`; None keeps x's dtype. `y` is rounded once from FP32.
        zero_centered: use `1 + weight` (Step5RMSNorm) instead of `weight`.
        weight_in_activation_dtype: round the weight to x's dtype first (the indexer's q_norm).
        backend: "auto" (Triton on CUDA, reference on CPU), "triton" or "reference".
    Returns:
        `(y, rstd)`: y [..., channels] in `output_dtype`; rstd [...] float32 (float64 for float64 x),
        not differentiable. Gradients flow to x (its dtype) and weight (its dtype, FP32 accumulation).
    Raises:
        TypeError: non-tensor inputs, unsupported dtypes (float64 on the Triton path).
        ValueError: weight not [channels], no channels, eps negative or not finite, more than 65536
            channels on Triton, bad backend.
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
    """
    backend, output_dtype = _check("rms_norm", x, weight, eps, output_dtype, backend)
    shape = x.shape
    y, rstd = _RMSNorm.apply(
        x.reshape(-1, shape[-1]),
        weight.contiguous(),  # the kernels read the weight at unit stride
        float(eps),
        output_dtype,
        zero_centered,
        weight_in_activation_dtype,
        backend,
    )
    return y.view(shape), rstd.view(shape[:-1])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    output_dtype: torch.dtype | None = None,
    zero_centered: bool = True,
    *,
    weight_in_activation_dtype: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """RMSNorm over the last dim; `rms_norm_with_rstd` without the rstd. Same arguments, shapes and errors.

    Returns:
        y [..., channels] in `output_dtype` (x's dtype when None).
    """
    return rms_norm_with_rstd(
        x,
        weight,
        eps,
        output_dtype,
        zero_centered,
        weight_in_activation_dtype=weight_in_activation_dtype,
        backend=backend,
    )[0]


def grouped_rms_norm(
    q: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    output_dtype: torch.dtype | None = None,
    *,
    zero_centered: bool = True,
    weight_in_activation_dtype: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-head RMSNorm of rows read in place from a strided view (the Q or K rows of a fused QKV output).

    Args:
        q: [token_groups, heads_per_group, channels], any strides for the first two dims, channel stride 1:
            e.g. `qkv.view(T, G, Hpg + 2, D)[:, :, :Hpg].flatten(0, 1)` for the query heads; read without a copy.
        weight: [channels] float32; the per-head norm weight shared by every head.
        eps, output_dtype, zero_centered, weight_in_activation_dtype, backend: as in `rms_norm_with_rstd`.
    Returns:
        y [token_groups, heads_per_group, channels], contiguous, in `output_dtype` (q's dtype when None);
        differentiable with respect to q and weight.
    Raises:
        TypeError, ValueError, RuntimeError: as `rms_norm_with_rstd`; also ValueError when q is not 3-D or its
        channel stride is not 1.
    """
    fn = "grouped_rms_norm"
    backend, output_dtype = _check(fn, q, weight, eps, output_dtype, backend, min_rank=3, name="q")
    if q.dim() != 3:
        raise ValueError(
            f"{fn}: q must be [token_groups, heads_per_group, channels]; got shape {tuple(q.shape)}"
        )
    if q.stride(-1) != 1 and q.shape[-1] > 1:
        raise ValueError(f"{fn}: q must have channel stride 1; got strides {q.stride()}")
    return _RMSNorm.apply(
        q,
        weight.contiguous(),
        float(eps),
        output_dtype,
        zero_centered,
        weight_in_activation_dtype,
        backend,
    )[0]
