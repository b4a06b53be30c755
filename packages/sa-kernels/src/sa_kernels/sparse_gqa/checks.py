"""Boundary checks `sparse_gqa_attention` and `sparse_region_attention` share: the query, key and
value tensors, the softmax scale, and whether a fast backend runs on these inputs. Each raises
naming the op (`op`), the argument, what was expected and what came."""

import math
import numbers

import torch

from sa_kernels.backend import triton_unavailable_reason

FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes the gather and Flex backends take (float64 runs on the reference only)."""


def check_tensors(op: str, **named: object) -> None:
    """Raise TypeError unless every argument `named` (name=value) is a torch.Tensor."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor; got {type(t).__name__}")


def check_qkv(op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise unless query, key and value are 4-D [batch, tokens, heads, head_dim] tensors of one
    floating dtype (the shapes' agreement is each op's to check)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(
                f"{op}: {name} must be 4-D [batch, tokens, heads, head_dim]; got shape "
                f"{tuple(t.shape)}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"{op}: query, key and value must share one dtype; got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if not query.dtype.is_floating_point:
        raise TypeError(f"{op}: query must be a floating tensor; got {query.dtype}")


def check_one_device(op: str, tensors: tuple[torch.Tensor, ...]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"{op}: all tensors must be on one device; got {sorted(map(str, devices))}"
        )


def softmax_scale_value(op: str, softmax_scale: object, head_dim: int) -> float:
    """None: head_dim ** -0.5; a real number or a one-element tensor (read once): that number as a
    float, which must be finite and > 0."""
    if softmax_scale is None:
        return head_dim**-0.5
    real = isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
    one_element = isinstance(softmax_scale, torch.Tensor) and softmax_scale.numel() == 1
    if not (real or one_element):
        raise TypeError(f"{op}: softmax_scale must be None or a float; got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op}: softmax_scale must be finite and > 0; got {scale}")
    return scale


def check_fast_backend(op: str, backend: str, query: torch.Tensor) -> None:
    """Raise unless `backend` ("gather", "flex", "fa4" or "auto" on CUDA) can take `query`'s dtype
    and device: the fast backends take bfloat16/float16/float32; Flex needs CUDA tensors; gather
    needs Triton (on CPU its interpreter, TRITON_INTERPRET=1)."""
    if query.dtype not in FAST_DTYPES:
        raise TypeError(
            f"{op}: backend={backend!r} supports bfloat16, float16 and float32; got {query.dtype}"
        )
    if backend == "flex" and query.device.type != "cuda":
        raise RuntimeError(f"{op}: backend='flex' needs CUDA tensors; got {query.device}")
    if backend == "gather" and (reason := triton_unavailable_reason(query.device)) is not None:
        raise RuntimeError(f"{op}: backend='gather' {reason}")
