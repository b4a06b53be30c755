"""Indexer scoring of one query tile against every region summary: `Σ_h w · relu(q_h · s_r)` in FP32."""

import torch

from sa_kernels.backend import check_out, resolve_backend
from sa_kernels.indexer_score import reference

__all__ = ["indexer_score_tile"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def indexer_score_tile(
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    start: int,
    stop: int,
    *,
    candidate_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Scores of queries `[start, stop)` for every provider group and region, in one fused kernel.

    `score[b, g, i, r] = Σ_h weights[b, start+i, g, h] · relu(Σ_d query[b, start+i, g, h, d] · summary[b, r, d])`,
    products and sums in FP32, no 1/sqrt(D); no `[.., H, R]` intermediate is written. Not differentiable.

    Args:
        query: [batch, queries, groups, heads_per_group, dim] bfloat16 (E4M3-rounded and widened; float16/float32
            accepted, float64 on the reference); last-dim stride 1, other strides free (a head stride
            whose offsets pass 2**31 elements is copied contiguous first).
        weights: [batch, queries, groups, heads_per_group] float32 (float64 with float64 query), signed.
        summary: [batch, regions, dim], query's dtype (E4M3-rounded region summaries); last-dim stride 1.
        start, stop: the query rows to score, `0 <= start <= stop <= queries`.
        candidate_bounds: optional `(first, past)`, int64 [batch, stop − start] each: query `start + i`
            keeps the scores of regions `first[b, i] <= r < past[b, i]` (indices into `summary`) and
            gets −inf elsewhere, in the same kernel (no second pass over the scores).
        out: optional float32 [batch, groups, stop − start, regions] tensor to write into; last-dim
            stride 1, other strides free as long as no two elements overlap (rows padded to a
            multiple of 16 entries let `stable_topk` read them with vector loads; the kernels do not
            specialise out's strides).
        backend: "auto" (Triton on CUDA, reference on CPU), "triton" or "reference".
    Returns:
        float32 [batch, groups, stop − start, regions] (float64 on the reference for float64 inputs).
    Raises:
        TypeError: non-tensors, dtypes other than the above, summary's dtype differs from query's, float64 on Triton,
            `candidate_bounds` not a pair of int64 tensors.
        ValueError: ranks, batch/queries/groups/heads/dim disagree, start/stop out of range, a last-dim stride is
            not 1, dim < 16 or heads_per_group > 128 on Triton, `out` of the wrong shape/dtype, with
            a last-dim stride other than 1 or overlapping elements,
            `candidate_bounds` not [batch, stop − start] on query's device, bad backend.
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
    """
    fn = "indexer_score_tile"
    for name, t in (("query", query), ("weights", weights), ("summary", summary)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor; got {type(t).__name__}")
    if query.dtype not in _FLOATS:
        raise TypeError(
            f"{fn}: query must be bfloat16 (float16/float32/float64 accepted); got {query.dtype}"
        )
    if summary.dtype != query.dtype:
        raise TypeError(
            f"{fn}: summary must have query's dtype ({query.dtype}); got {summary.dtype}"
        )
    if weights.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{fn}: weights must be float32; got {weights.dtype}")
    if query.dim() != 5:
        raise ValueError(
            f"{fn}: query must be [batch, queries, groups, heads_per_group, dim]; got shape {tuple(query.shape)}"
        )
    batch, queries, groups, heads, dim = query.shape
    if heads < 1:
        raise ValueError(
            f"{fn}: query must have heads_per_group >= 1; got shape {tuple(query.shape)}"
        )
    if weights.shape != (batch, queries, groups, heads):
        raise ValueError(
            f"{fn}: weights must be [batch, queries, groups, heads_per_group] = {(batch, queries, groups, heads)}; "
            f"got {tuple(weights.shape)}"
        )
    if summary.dim() != 3 or summary.shape[0] != batch or summary.shape[2] != dim:
        raise ValueError(
            f"{fn}: summary must be [batch, regions, dim] with batch {batch} and dim {dim}; got {tuple(summary.shape)}"
        )
    if (
        isinstance(start, bool)
        or isinstance(stop, bool)
        or not isinstance(start, int)
        or not isinstance(stop, int)
    ):
        raise TypeError(f"{fn}: start and stop must be ints; got {start!r}, {stop!r}")
    if not 0 <= start <= stop <= queries:
        raise ValueError(
            f"{fn}: need 0 <= start <= stop <= queries ({queries}); got start={start}, stop={stop}"
        )
    regions = summary.shape[1]
    candidate_bounds = _checked_bounds(fn, candidate_bounds, (batch, stop - start), query.device)
    chosen = resolve_backend(fn, backend, query, weights, summary)
    out_dtype = (
        torch.float64 if chosen == "reference" and query.dtype == torch.float64 else torch.float32
    )
    shape = (batch, groups, stop - start, regions)
    if chosen != "reference" and (query.dtype == torch.float64 or weights.dtype != torch.float32):
        raise TypeError(
            f"{fn}: the Triton path takes bfloat16/float16/float32 query and float32 weights; "
            f"got {query.dtype}, {weights.dtype}"
        )
    check_out(fn, out, shape, out_dtype, query.device, padded_rows=True)
    if chosen == "reference":
        with torch.no_grad():
            result = reference.indexer_score_tile(
                query, weights, summary, start, stop, candidate_bounds
            )
        if out is None:
            return result
        return out.copy_(result)
    if query.stride(-1) != 1 or summary.stride(-1) != 1:
        raise ValueError(
            f"{fn}: query and summary need last-dim stride 1; got {query.stride()} and {summary.stride()}"
        )
    if dim < 16:
        raise ValueError(f"{fn}: the Triton path needs dim >= 16; got {dim}")
    if heads > 128:
        raise ValueError(f"{fn}: the Triton path takes at most 128 heads_per_group; got {heads}")
    from sa_kernels.indexer_score import triton_kernels

    if (heads - 1) * query.stride(3) >= 2**31:  # the kernels' head offsets are int32 products
        query = query.contiguous()
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=query.device)
    return triton_kernels.indexer_score_tile(
        query, weights, summary, start, stop, out, candidate_bounds
    )


def _checked_bounds(
    fn: str,
    bounds: tuple[torch.Tensor, torch.Tensor] | None,
    shape: tuple[int, int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`candidate_bounds` validated, with query stride 1 and one batch stride for both (the kernels
    index both with first's strides)."""
    if bounds is None:
        return None
    if (
        not isinstance(bounds, (tuple, list))
        or len(bounds) != 2
        or not all(isinstance(t, torch.Tensor) for t in bounds)
    ):
        raise TypeError(
            f"{fn}: candidate_bounds must be a pair of tensors (first, past); got {bounds!r}"
        )
    for name, t in zip(("first", "past"), bounds, strict=True):
        if t.dtype != torch.int64:
            raise TypeError(f"{fn}: candidate_bounds {name} must be int64; got {t.dtype}")
        if tuple(t.shape) != shape or t.device != device:
            raise ValueError(
                f"{fn}: candidate_bounds {name} must be {list(shape)} on {device}; "
                f"got {list(t.shape)} on {t.device}"
            )
    first, past = bounds
    if first.stride(-1) != 1 or first.stride() != past.stride():
        return first.contiguous(), past.contiguous()
    return first, past
