"""Metadata is data: the frozen dataclasses that routing hands to attention (SEMANTICS §1.3).

`RegionMetadata` is built once per model forward by `region_metadata` and shared by every CSA layer;
`RegionSelection` is one layer's routing decision. Host fields (ints, tuples) are what the host must
know to launch work; tensors are what the device needs.
"""

from dataclasses import dataclass

import torch

ScoreTile = tuple[int, int, int, int, int]
"""`(batch, q_start, q_stop, first_region, past_last_region)`: local query rows `[q_start, q_stop)`
(at most 128) of batch row `batch`, and the global region interval that holds every candidate of
their sparse queries."""

SummaryRange = tuple[int, int, int]
"""`(batch, first_region, past_last_region)`: a merged interval of regions whose summaries a rank needs."""


@dataclass(frozen=True)
class CausalDocumentLayout:
    """Varlen (FlashAttention-style) description of this shard's queries against the global keys.

    One segment per (batch row, document) that holds at least one valid query of the shard, in batch
    then document order. Queries of segment i are rows `[query_start[i], query_stop[i])` of the
    flattened local queries `[batch * queries]`; its keys are rows `[key_start[i], key_stop[i])` of
    the flattened global keys `[batch * global_length]` (causal: the key range ends at the segment's
    last query; with a window it starts at most `window - 1` tokens before the first query).

    Attributes:
        cu_seqlens_q: int32 [segments + 1], cumulative query counts.
        cu_seqlens_k: int32 [segments + 1], cumulative key counts.
        max_seqlen_q: longest query segment.
        max_seqlen_k: longest key segment.
        query_start: int64 [segments], flat index of each segment's first query.
        query_stop: int64 [segments], flat index one past each segment's last query.
        key_start: int64 [segments], flat index of each segment's first key.
        key_stop: int64 [segments], flat index one past each segment's last key.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    query_start: torch.Tensor
    query_stop: torch.Tensor
    key_start: torch.Tensor
    key_stop: torch.Tensor


@dataclass(frozen=True)
class RegionMetadata:
    """Documents, regions, dense selections and score tiles of one forward (SEMANTICS §1.3).

    `B` batch, `S` the global key length, `Q` this shard's queries (global rows
    `[query_start, query_start + Q)`), `N = region_count`. Global region ids number the regions of a
    batch row consecutively across its documents; padding tokens belong to no document and no region.

    Attributes:
        region_size: tokens per region `R`.
        topk: historical regions kept per sparse query.
        query_start: global row of this shard's first query.
        queries: `Q`.
        global_length: `S`.
        window: sliding window of `window_layout`, or None.
        region_count: `N`, the largest region count of any batch row; also the unused-slot sentinel.
        token_regions: int64 [B, S], global region id of every key token, -1 for padding.
        documents: int64 [B, S], document index of every key token within its row, -1 for padding.
        region_documents: int64 [B, N], document of every region, -1 past the row's last region.
        region_first: int64 [B, N], first region of each region's document, -1 past the row's last region.
        query_padding: bool [B, Q], True where the query token is padding.
        query_documents: int64 [B, Q], document of every query, -1 for padding.
        current: int64 [B, Q], the query's own region, -1 for padding.
        query_first_region: int64 [B, Q], first region of the query's document, -1 for padding.
        dense_region_ids: int32 [B, Q, min(topk, N) + 1], every region of the query's document up to
            and including its own, ascending, unused slots `N` (all `N` for padding queries). For a
            sparse query this is not its selection (the indexer scores those).
        sparse_queries: bool [B, Q], True where more than `topk` historical regions are visible.
        score_tiles: host tuples `(batch, q_start, q_stop, first_region, past_last_region)`, at most
            128 queries each, one per 128-row chunk of the shard that holds a sparse query, trimmed
            to its first and last sparse query.
        summary_ranges: host tuples `(batch, first_region, past_last_region)`, the merged region
            intervals the score tiles need, sorted.
        region_sources: int32 [B, N, R], the key token (row index in `[0, S)`) at each document-local
            offset of each region, -1 where the region has no such token or the token is padding.
        region_source_valid: bool [B, N, R], `region_sources >= 0`.
        causal_layout: varlen causal layout, or None where padding is not a right-padded tail.
        window_layout: the same segments with key ranges trimmed to `window`, or None.
        all_padding_key: True when every query of the shard is padding. Nothing is scored; the varlen
            layouts then hold one singleton segment (the shard's first query against its own key
            row) so that a varlen kernel has defined output, which the caller discards (zeros).
    """

    region_size: int
    topk: int
    query_start: int
    queries: int
    global_length: int
    window: int | None
    region_count: int
    token_regions: torch.Tensor
    documents: torch.Tensor
    region_documents: torch.Tensor
    region_first: torch.Tensor
    query_padding: torch.Tensor
    query_documents: torch.Tensor
    current: torch.Tensor
    query_first_region: torch.Tensor
    dense_region_ids: torch.Tensor
    sparse_queries: torch.Tensor
    score_tiles: tuple[ScoreTile, ...]
    summary_ranges: tuple[SummaryRange, ...]
    region_sources: torch.Tensor
    region_source_valid: torch.Tensor
    causal_layout: CausalDocumentLayout | None
    window_layout: CausalDocumentLayout | None
    all_padding_key: bool

    @property
    def batch_size(self) -> int:
        return self.token_regions.shape[0]


@dataclass(frozen=True)
class RegionSelection:
    """One CSA layer's routing decision.

    Attributes:
        region_ids: int32 [B, G, Q, topk + 1], per (batch, provider group, local query) the selected
            global region ids, ascending, unused slots `region_count`. A sparse query holds its
            `topk` best historical regions plus its current region; a dense query every region of its
            document up to its own; a padding query nothing.
        region_count: the sentinel of unused slots (`RegionMetadata.region_count`).
    """

    region_ids: torch.Tensor
    region_count: int
