"""`sparse_mla_attention`: sparse latent (MLA) attention, SEMANTICS §3, and the three paths behind it.

MQA of every query head over one latent K/V head: keys are whole latent rows (512 or 576 dims), values
their first 512 dims; each query attends over the ids of its own top-k slots, with an optional
attention sink. The four public functions take the same arguments and compute the same function:

- `sparse_mla_attention`: picks a path (`select_backend`) and runs it;
- `cudnn_sparse_attention`: FlashMLA's forward and the cuDNN frontend's backward (`cudnn_flashmla.py`),
  wrapped by `canonical.py` (id compaction and padding, head chunks, the sink gradient);
- `sparse_mla_triton`: the Triton kernels (`triton_forward.py`, on Hopper `gluon_forward.py`;
  `triton_backward.py` with its id rows from `triton_sorted_ids.py`; launch configs in
  `triton_launch.py`, `triton_chain_break.py` the identity that keeps the dots out of a dot chain);
- `sparse_mla_reference`: the oracle of `reference.py`.

This module validates the arguments once, at the public boundary (the paths behind it assume what it
checked), chooses the backend and holds the Triton path's `autograd.Function`.
"""

import math
import numbers
from dataclasses import dataclass

import torch

from sa_kernels.backend import resolve_backend

from .canonical import ids_as_int32, sink_gradient
from .cudnn_flashmla import (
    CUDNN_DTYPES,
    cudnn_fused_attention,
    is_cudnn_sparse_attention_available,
    unavailable_reason,
)
from .reference import HEAD_DIMS, REFERENCE_DTYPES, sparse_mla_reference_with_lse
from .triton_backward import sparse_mla_backward
from .triton_forward import sparse_mla_forward

__all__ = [
    "cudnn_sparse_attention",
    "is_cudnn_sparse_attention_available",
    "sparse_mla_attention",
    "sparse_mla_reference",
    "sparse_mla_triton",
]

INDEX_DTYPES = (torch.int32, torch.int64)
TRITON_DTYPES = (torch.bfloat16, torch.float32)
BACKENDS = ("auto", "cudnn", "triton", "reference")
BACKEND_DTYPES = {"cudnn": CUDNN_DTYPES, "triton": TRITON_DTYPES, "reference": REFERENCE_DTYPES}


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


def lse_with_sink(lse: torch.Tensor, attn_sink: torch.Tensor | None) -> torch.Tensor:
    """Natural-log lse [T, H] of the keys and the sink together (+inf stays +inf for empty rows)."""
    if attn_sink is None:
        return lse
    return torch.logaddexp(lse, attn_sink.float()[None, :])


class _SparseMlaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv_latent, ids, softmax_scale, topk_length, attn_sink):
        kv = kv_latent[:, 0].contiguous()
        out, lse = sparse_mla_forward(q, kv, ids, softmax_scale, topk_length, attn_sink)
        ctx.save_for_backward(q, kv, ids, topk_length, attn_sink, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.kv_shape = kv_latent.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, ids, topk_length, attn_sink, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        lse_total = lse_with_sink(lse, attn_sink)
        dq, dkv, delta = sparse_mla_backward(
            q, kv, ids, ctx.softmax_scale, topk_length, dout, out, lse_total
        )
        d_sink = (
            sink_gradient(attn_sink, lse, delta)
            if attn_sink is not None and ctx.needs_input_grad[5]
            else None
        )
        dkv = dkv.to(q.dtype).view(ctx.kv_shape)
        return dq, dkv, None, None, None, d_sink


def sparse_mla_triton(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse latent attention through the Triton kernels (forward and backward).

    Runs on CUDA tensors (any SM80+ GPU, any head count and top-k width), or on CPU tensors through
    Triton's interpreter when `TRITON_INTERPRET=1`; on SM90 GPUs with bf16 inputs the forward is the
    Gluon kernel of `gluon_forward.py` (`triton_forward.hopper_forward_applies`). Same function as
    `sparse_mla_reference`.
    Arguments, shapes and errors as `cudnn_sparse_attention` (q [tokens, heads, 512 | 576],
    kv_latent [keys, 1, head_dim], topk_indices [tokens, 1, width] int, topk_length [tokens] int,
    attn_sink [heads] fp32), except: q and kv_latent are bf16 or fp32 (fp32 dots may run in TF32 on
    GPU), and all_rows_nonempty/valid_row_indices are validated and otherwise unused.

    Returns:
        [tokens, heads, 512] in q's dtype; rows with no valid id are zero and get zero gradients.
    Raises:
        RuntimeError: CPU tensors without `TRITON_INTERPRET=1`, or Triton is not installed.
        TypeError, ValueError: as `cudnn_sparse_attention`.
    """
    check_sparse_mla_arguments(
        "sparse_mla_triton",
        q,
        kv_latent,
        topk_indices,
        softmax_scale,
        topk_length,
        all_rows_nonempty,
        valid_row_indices,
        attn_sink,
        allowed_dtypes=TRITON_DTYPES,
    )
    return _sparse_mla_triton(q, kv_latent, topk_indices, softmax_scale, topk_length, attn_sink)


def _sparse_mla_triton(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> torch.Tensor:
    """`sparse_mla_triton` on arguments already validated; raises its RuntimeError when Triton cannot run."""
    resolve_backend("sparse_mla_triton", "triton", q, kv_latent, topk_indices)
    if q.stride(-1) != 1:
        q = q.contiguous()
    ids = topk_indices[:, 0]
    if ids.dtype != torch.int32:
        # The kernels treat ids outside [0, keys) as invalid themselves; wider ids are judged
        # before they are narrowed (2**32 + 3 must not become 3).
        ids = ids_as_int32(ids, kv_latent.shape[0])
    ids = ids.contiguous()
    lengths = topk_length.to(torch.int32).contiguous() if topk_length is not None else None
    sink = attn_sink.contiguous() if attn_sink is not None else None
    return _SparseMlaTriton.apply(q, kv_latent, ids, float(softmax_scale), lengths, sink)


def cudnn_sparse_attention(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse latent attention: FlashMLA forward, cuDNN frontend backward (SM90/SM100, bf16).

    MQA over one latent head: keys are whole latent rows, values their first 512 dims. This is the
    contract (SEMANTICS §3) that `sparse_mla_triton`, `sparse_mla_reference` and `sparse_mla_attention`
    share; they differ in the dtypes they take and where they run.

    Args:
        q: [tokens, heads, 512 | 576] bf16, unit last stride. Any head count: heads run in chunks of
            128, each padded to 64 or 128 with zero queries (and -inf sinks) for FlashMLA.
        kv_latent: [keys, 1, head_dim] bf16.
        topk_indices: [tokens, 1, width] int32/int64; ids outside `[0, keys)` (e.g. -1) are ignored,
            a duplicate id counts once per slot. Without `topk_length`, valid ids are compacted into an
            ascending prefix; either way the width is padded with -1 to a multiple of 512.
        softmax_scale: > 0, multiplies q·k.
        topk_length: optional [tokens] int; slots at or past it are ignored (clamped to `[0, width]`).
        all_rows_nonempty: promise that every row has a valid id; the backward then skips finding the
            non-empty rows (a host synchronisation).
        valid_row_indices: optional [rows] int, exactly the rows with a valid id (same purpose).
        attn_sink: optional [heads] fp32 logits added to each head's softmax denominator; its gradient
            is `-sum_q sigmoid(sink - lse) * sum_d dO * O`.
    Returns:
        [tokens, heads, 512] bf16; rows with no valid id are zero and get zero gradients.
    Raises:
        RuntimeError: FlashMLA or the cuDNN frontend is missing, the tensors are not on CUDA, or the GPU
            is not SM90/SM100.
        TypeError: a dtype is not bf16/int/fp32 as listed, or softmax_scale is not a number.
        ValueError: shapes disagree, head_dim is not 512/576, softmax_scale <= 0, or the optional
            arguments contradict each other.
    """
    args = (
        q,
        kv_latent,
        topk_indices,
        softmax_scale,
        topk_length,
        all_rows_nonempty,
        valid_row_indices,
        attn_sink,
    )
    check_sparse_mla_arguments("cudnn_sparse_attention", *args, allowed_dtypes=CUDNN_DTYPES)
    return cudnn_fused_attention(*args)


def sparse_mla_reference(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse latent attention, the PyTorch oracle (CPU or GPU; differentiable in q, kv_latent, attn_sink).

    Arguments, shapes and errors as `cudnn_sparse_attention` (q [tokens, heads, 512 | 576],
    kv_latent [keys, 1, head_dim], topk_indices [tokens, 1, width] int, topk_length [tokens] int,
    attn_sink [heads] fp32), except: q and kv_latent are bf16, fp16, fp32 or fp64 (attn_sink may be
    fp64 with fp64 q), and all_rows_nonempty/valid_row_indices are validated and otherwise unused.
    It runs anywhere, so it raises no RuntimeError.

    Returns:
        [tokens, heads, 512] in q's dtype; rows with no valid id are zero.
    """
    check_sparse_mla_arguments(
        "sparse_mla_reference",
        q,
        kv_latent,
        topk_indices,
        softmax_scale,
        topk_length,
        all_rows_nonempty,
        valid_row_indices,
        attn_sink,
        allowed_dtypes=REFERENCE_DTYPES,
    )
    out, _ = sparse_mla_reference_with_lse(
        q, kv_latent, topk_indices, softmax_scale, topk_length, attn_sink
    )
    return out


def select_backend(
    backend: str, q: torch.Tensor, kv_latent: torch.Tensor, topk_indices: torch.Tensor
) -> str:
    """Resolve `backend` to "cudnn", "triton" or "reference" (auto: fused when it can run, else Triton on
    CUDA, else the oracle); an explicit backend is returned as asked and raises later if it cannot run."""
    fn = "sparse_mla_attention"
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}; got {backend!r}")
    if backend != "auto":
        return backend
    if q.is_cuda and q.dtype == torch.bfloat16 and unavailable_reason(q.device) is None:
        return "cudnn"
    return resolve_backend(fn, "auto", q, kv_latent, topk_indices)


def sparse_mla_attention(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse latent attention through the best path that can run.

    Arguments as `cudnn_sparse_attention` (q [tokens, heads, 512 | 576], kv_latent [keys, 1, head_dim],
    topk_indices [tokens, 1, width] int, topk_length [tokens] int, attn_sink [heads] fp32), validated
    once here; q's dtype must suit the backend that runs (cudnn: bf16; triton: bf16 or fp32;
    reference: bf16, fp16, fp32 or fp64).

    Args:
        backend: keyword-only, as in `sparse_gqa_attention`. "auto" (FlashMLA + cuDNN when both
            import, the GPU is SM90/SM100 and q is bf16; else Triton on CUDA; else the oracle on
            CPU), "cudnn", "triton" or "reference".
    Returns:
        [tokens, heads, 512] in q's dtype.
    Raises:
        RuntimeError: the requested backend cannot run here (the message says why).
        TypeError, ValueError: as `cudnn_sparse_attention`; or an unknown backend (ValueError).
    """
    fn = "sparse_mla_attention"
    args = (
        q,
        kv_latent,
        topk_indices,
        softmax_scale,
        topk_length,
        all_rows_nonempty,
        valid_row_indices,
        attn_sink,
    )
    check_sparse_mla_arguments(fn, *args, allowed_dtypes=REFERENCE_DTYPES)
    chosen = select_backend(backend, q, kv_latent, topk_indices)
    check_q_dtype(fn, q, BACKEND_DTYPES[chosen], chosen)
    if chosen == "cudnn":
        return cudnn_fused_attention(*args)
    if chosen == "triton":
        return _sparse_mla_triton(q, kv_latent, topk_indices, softmax_scale, topk_length, attn_sink)
    out, _lse = sparse_mla_reference_with_lse(
        q, kv_latent, topk_indices, softmax_scale, topk_length, attn_sink
    )
    return out
