"""Argument checks shared by every sparse MLA entry point (SEMANTICS §3).

All four public functions take the same arguments, so they validate them here, once, at the boundary:
the kernels behind them assume what this module has checked.
"""

import math
import numbers
from dataclasses import dataclass

import torch

VALUE_DIM = 512
HEAD_DIMS = (512, 576)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class SparseMlaShape:
    """The sizes every backend needs: queries, heads, head dim, keys and top-k width."""

    tokens: int
    heads: int
    head_dim: int
    keys: int
    width: int


def check_q_dtype(
    fn: str, q: torch.Tensor, allowed_dtypes: tuple[torch.dtype, ...], backend: str | None = None
) -> None:
    """Raise TypeError naming `fn` (and `backend`, when given) when q's dtype is not allowed."""
    if q.dtype not in allowed_dtypes:
        names = " or ".join(str(d) for d in allowed_dtypes)
        on = "" if backend is None else f" on the {backend!r} backend"
        raise TypeError(f"{fn}: q must be {names}{on}; got {q.dtype}")


def check_sparse_mla_arguments(
    fn: str,
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    all_rows_nonempty: bool,
    valid_row_indices: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    *,
    allowed_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
) -> SparseMlaShape:
    """Raise TypeError/ValueError naming `fn` and the argument when the inputs break the contract."""
    tensors = {"q": q, "kv_latent": kv_latent, "topk_indices": topk_indices}
    optional = {
        "topk_length": topk_length,
        "valid_row_indices": valid_row_indices,
        "attn_sink": attn_sink,
    }
    for name, value in {**tensors, **optional}.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor; got {type(value).__name__}")
    check_q_dtype(fn, q, allowed_dtypes)
    if kv_latent.dtype != q.dtype:
        raise TypeError(f"{fn}: kv_latent must have q's dtype ({q.dtype}); got {kv_latent.dtype}")
    if topk_indices.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"{fn}: topk_indices must be torch.int32 or torch.int64; got {topk_indices.dtype}"
        )
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"{fn}: softmax_scale must be a real number; got {type(softmax_scale).__name__}"
        )
    if not math.isfinite(float(softmax_scale)) or float(softmax_scale) <= 0:
        raise ValueError(f"{fn}: softmax_scale must be finite and > 0; got {softmax_scale}")
    if not isinstance(all_rows_nonempty, bool):
        raise TypeError(
            f"{fn}: all_rows_nonempty must be a bool; got {type(all_rows_nonempty).__name__}"
        )

    if q.dim() != 3:
        raise ValueError(f"{fn}: q must be [tokens, heads, head_dim]; got shape {tuple(q.shape)}")
    tokens, heads, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{fn}: q's head_dim must be 512 or 576; got {head_dim}")
    if heads < 1:
        raise ValueError(f"{fn}: q must have at least one head; got shape {tuple(q.shape)}")
    if (
        kv_latent.dim() != 3
        or kv_latent.shape[0] < 1
        or kv_latent.shape[1] != 1
        or kv_latent.shape[2] != head_dim
    ):
        raise ValueError(
            f"{fn}: kv_latent must be [keys >= 1, 1, {head_dim}] (one latent head, q's head_dim); "
            f"got shape {tuple(kv_latent.shape)}"
        )
    if topk_indices.dim() != 3 or topk_indices.shape[0] != tokens or topk_indices.shape[1] != 1:
        raise ValueError(
            f"{fn}: topk_indices must be [{tokens}, 1, width] (q's tokens, one latent head); "
            f"got shape {tuple(topk_indices.shape)}"
        )
    width = topk_indices.shape[2]
    if width < 1:
        raise ValueError(
            f"{fn}: topk_indices must have at least one slot; got shape {tuple(topk_indices.shape)}"
        )

    if topk_length is not None:
        if topk_length.dtype not in INDEX_DTYPES:
            raise TypeError(
                f"{fn}: topk_length must be torch.int32 or torch.int64; got {topk_length.dtype}"
            )
        if tuple(topk_length.shape) != (tokens,):
            raise ValueError(
                f"{fn}: topk_length must be [{tokens}] (one length per query); got {tuple(topk_length.shape)}"
            )
    if attn_sink is not None:
        if attn_sink.dtype != torch.float32 and not (
            q.dtype == torch.float64 and attn_sink.dtype == torch.float64
        ):
            raise TypeError(f"{fn}: attn_sink must be torch.float32; got {attn_sink.dtype}")
        if tuple(attn_sink.shape) != (heads,):
            raise ValueError(
                f"{fn}: attn_sink must be [{heads}] (one logit per head); got {tuple(attn_sink.shape)}"
            )
    if valid_row_indices is not None:
        if all_rows_nonempty:
            raise ValueError(
                f"{fn}: valid_row_indices and all_rows_nonempty=True are exclusive (the latter says every row "
                "is valid); give one of them"
            )
        if valid_row_indices.dtype not in INDEX_DTYPES:
            raise TypeError(
                f"{fn}: valid_row_indices must be torch.int32 or torch.int64; got {valid_row_indices.dtype}"
            )
        if valid_row_indices.dim() != 1 or valid_row_indices.shape[0] > tokens:
            raise ValueError(
                f"{fn}: valid_row_indices must be 1-D with at most {tokens} rows; got shape {tuple(valid_row_indices.shape)}"
            )

    devices = {
        t.device
        for t in (q, kv_latent, topk_indices, topk_length, valid_row_indices, attn_sink)
        if t is not None
    }
    if len(devices) > 1:
        raise ValueError(
            f"{fn}: all tensors must be on one device; got {sorted(str(d) for d in devices)}"
        )
    return SparseMlaShape(tokens, heads, head_dim, kv_latent.shape[0], width)
