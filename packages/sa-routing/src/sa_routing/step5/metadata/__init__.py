"""`region_metadata`: documents, regions, dense selections and score tiles, once per forward.

Every tensor is derived on the device, by PyTorch ops (`reference.TorchMetadata`) or by Triton
kernels on CUDA (`triton_kernels.DeviceMetadata`); everything the host must know (region count,
tile bounds, varlen segment counts, validation flags) comes back in a single `tolist()`, the one
host synchronisation of the forward. `reference.reference_regions` is the token-by-token oracle.
"""

import math

import torch

from sa_kernels.backend import resolve_backend

from ..layouts import CausalDocumentLayout, RegionMetadata, ScoreTile, SummaryRange
from .reference import TorchMetadata

MAX_TILE_QUERIES = 128


def region_metadata(
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    query_start: int,
    queries: int,
    region_size: int,
    topk: int,
    window: int | None = None,
    *,
    require_varlen_layout: bool = False,
    tile_size: int = MAX_TILE_QUERIES,
    backend: str = "auto",
) -> RegionMetadata:
    """Build the Step-5 routing metadata of one forward (SEMANTICS §1.3).

    A document starts wherever a valid token's position is 0; positions of valid tokens must count
    up by one within a document (padding tokens in between are skipped). Regions are runs of
    `region_size` document-local positions, restarting at every document start.

    Args:
        key_positions: int64 [batch, global_length], document-local position of every key token
            (the whole sequence, also on a context-parallel shard).
        key_padding: bool [batch, global_length], True for padding tokens; or None (no padding).
        query_start: global row of this shard's first query (0 without context parallelism).
        queries: number of local queries; global rows `[query_start, query_start + queries)`.
        region_size: tokens per region, >= 1.
        topk: historical regions kept per sparse query, >= 1.
        window: sliding window for `window_layout` (key k visible to q iff `0 <= q - k < window`), or None.
        require_varlen_layout: raise instead of returning `causal_layout=None` when padding is not
            a right-padded tail of every row.
        tile_size: queries per score tile, in [1, 128].
        backend: "auto" (the Triton kernels on CUDA, PyTorch ops on CPU), "triton" (on CPU through
            `TRITON_INTERPRET=1`) or "reference" (PyTorch ops). The same metadata either way.
    Returns:
        `RegionMetadata`.
    Raises:
        TypeError: `key_positions` is not an int64 tensor, `key_padding` not a bool tensor.
        ValueError: a backend other than "auto", "triton" or "reference".
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
        ValueError: ranks or shapes disagree; `query_start`/`queries` outside the global length;
            `region_size`, `topk`, `window` or `tile_size` out of range; a valid position is negative
            or does not continue its document (a document must start at position 0); padding
            precedes a valid token while `require_varlen_layout` is set.
    """
    fn = "region_metadata"
    if not isinstance(key_positions, torch.Tensor) or key_positions.dtype != torch.int64:
        got = (
            key_positions.dtype
            if isinstance(key_positions, torch.Tensor)
            else type(key_positions).__name__
        )
        raise TypeError(f"{fn}: key_positions must be an int64 tensor; got {got}")
    if key_positions.dim() != 2:
        raise ValueError(
            f"{fn}: key_positions must be [batch, global_length]; got shape {tuple(key_positions.shape)}"
        )
    batch, length = key_positions.shape
    if batch == 0 or length == 0:
        raise ValueError(
            f"{fn}: key_positions must hold at least one batch row and one token; got shape "
            f"{tuple(key_positions.shape)}"
        )
    if key_padding is not None:
        if not isinstance(key_padding, torch.Tensor) or key_padding.dtype != torch.bool:
            got = (
                key_padding.dtype
                if isinstance(key_padding, torch.Tensor)
                else type(key_padding).__name__
            )
            raise TypeError(f"{fn}: key_padding must be a bool tensor or None; got {got}")
        if key_padding.shape != key_positions.shape:
            raise ValueError(
                f"{fn}: key_padding must have key_positions' shape {tuple(key_positions.shape)}; "
                f"got {tuple(key_padding.shape)}"
            )
        if key_padding.device != key_positions.device:
            raise ValueError(
                f"{fn}: key_padding must be on key_positions' device {key_positions.device}; got {key_padding.device}"
            )
    for name, value, low in (
        ("region_size", region_size, 1),
        ("topk", topk, 1),
        ("queries", queries, 1),
        ("query_start", query_start, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{fn}: {name} must be an int >= {low}; got {value!r}")
    if query_start + queries > length:
        raise ValueError(
            f"{fn}: query_start + queries must be <= the global length {length}; "
            f"got {query_start} + {queries} = {query_start + queries}"
        )
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"{fn}: window must be None or an int >= 1; got {window!r}")
    if (
        isinstance(tile_size, bool)
        or not isinstance(tile_size, int)
        or not 1 <= tile_size <= MAX_TILE_QUERIES
    ):
        raise ValueError(
            f"{fn}: tile_size must be an int in [1, {MAX_TILE_QUERIES}]; got {tile_size!r}"
        )

    if resolve_backend(fn, backend, key_positions) == "triton":
        from .triton_kernels import DeviceMetadata

        stage = DeviceMetadata(
            key_positions, key_padding, query_start, queries, region_size, topk, window, tile_size
        )
    else:
        stage = TorchMetadata(
            key_positions, key_padding, query_start, queries, region_size, topk, window, tile_size
        )
    host = stage.host.tolist()  # the one host sync
    has_negative, has_discontinuity, has_left_padding, any_valid_query, region_count = host[:5]
    segment_count, max_seqlen_q, max_seqlen_k, max_seqlen_window = host[5:9]
    tile_host = host[9:]

    if has_negative:
        raise ValueError(
            f"{fn}: key_positions of valid tokens must be >= 0; got a negative position"
        )
    if has_discontinuity:
        raise ValueError(
            f"{fn}: key_positions must start every document at 0 and count up by one within it "
            "(padding tokens excluded); got a valid token whose position is neither 0 nor its predecessor's + 1"
        )
    if has_left_padding and require_varlen_layout:
        raise ValueError(
            f"{fn}: key_padding must be a right-padded tail of every row (require_varlen_layout=True); "
            "got padding before a valid token"
        )

    with_layout = bool(any_valid_query) and not has_left_padding
    tensors = stage.finish(region_count, segment_count, with_layout)
    score_tiles = _score_tiles(tile_host, batch, math.ceil(queries / tile_size))
    causal_layout = window_layout = None
    if not any_valid_query:
        causal_layout = window_layout = _singleton_layout(key_positions.device, query_start)
    elif with_layout:
        segments = tensors["segments"]
        causal_layout = _layout(segments, segment_count, max_seqlen_q, max_seqlen_k, "key_start")
        if window is not None:
            window_layout = _layout(
                segments, segment_count, max_seqlen_q, max_seqlen_window, "window_start"
            )

    current = tensors["token_regions"][:, query_start : query_start + queries]
    return RegionMetadata(
        region_size=region_size,
        topk=topk,
        query_start=query_start,
        queries=queries,
        global_length=length,
        window=window,
        region_count=region_count,
        token_regions=tensors["token_regions"],
        documents=tensors["documents"],
        region_documents=tensors["region_documents"],
        region_first=tensors["region_first"],
        query_padding=tensors["query_padding"],
        query_documents=tensors["documents"][:, query_start : query_start + queries],
        current=current,
        query_first_region=tensors["query_first_region"],
        dense_region_ids=tensors["dense_region_ids"],
        sparse_queries=tensors["sparse_queries"],
        score_tiles=score_tiles,
        summary_ranges=merge_summary_ranges(score_tiles),
        region_sources=tensors["region_sources"],
        region_source_valid=tensors["region_sources"] >= 0,
        causal_layout=causal_layout,
        window_layout=window_layout,
        all_padding_key=not any_valid_query,
    )


def merge_summary_ranges(tiles: tuple[ScoreTile, ...]) -> tuple[SummaryRange, ...]:
    """Merge the region intervals of `tiles` per batch row into sorted, disjoint, non-adjacent ranges."""
    merged: list[list[int]] = []
    for b, _, _, first, past in sorted((t[0], 0, 0, t[3], t[4]) for t in tiles):
        if merged and merged[-1][0] == b and first <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], past)
        else:
            merged.append([b, first, past])
    return tuple((b, first, past) for b, first, past in merged)


def _score_tiles(host: list[int], batch: int, chunks: int) -> tuple[ScoreTile, ...]:
    """The score tiles: per (batch row, chunk) holding a sparse query, its rows and region interval."""
    n = batch * chunks
    first_q, last_q, first_region, past_region = (host[i * n : (i + 1) * n] for i in range(4))
    return tuple(
        (i // chunks, first_q[i], last_q[i] + 1, first_region[i], past_region[i])
        for i in range(n)
        if last_q[i] >= 0
    )


def _layout(
    segments: dict[str, torch.Tensor], count: int, max_q: int, max_k: int, start_key: str
) -> CausalDocumentLayout:
    q0, q1 = segments["query_start"][:count], segments["query_stop"][:count]
    k0, k1 = segments[start_key][:count], segments["key_stop"][:count]
    zero = torch.zeros(1, dtype=torch.int32, device=q0.device)
    return CausalDocumentLayout(
        cu_seqlens_q=torch.cat([zero, torch.cumsum(q1 - q0, 0).to(torch.int32)]),
        cu_seqlens_k=torch.cat([zero, torch.cumsum(k1 - k0, 0).to(torch.int32)]),
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        query_start=q0,
        query_stop=q1,
        key_start=k0,
        key_stop=k1,
    )


def _singleton_layout(device: torch.device, query_start: int) -> CausalDocumentLayout:
    def t(value: int) -> torch.Tensor:
        return torch.full((1,), value, dtype=torch.int64, device=device)

    cu_seqlens = torch.arange(2, dtype=torch.int32, device=device)
    return CausalDocumentLayout(
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens.clone(),
        max_seqlen_q=1,
        max_seqlen_k=1,
        query_start=t(0),
        query_stop=t(1),
        key_start=t(query_start),
        key_stop=t(query_start + 1),
    )
