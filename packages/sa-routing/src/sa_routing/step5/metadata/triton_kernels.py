"""`region_metadata`'s device work on CUDA in four Triton kernels, where the PyTorch path
(`reference.TorchMetadata`) launches about 200 small ops: on the H200 that took 2.5 to 5.9 ms at 131 072 tokens,
nearly all of it host launch time (1.2 ms of it on the GPU).

Before the host synchronisation:
- `_token_scan_kernel`, one program per batch row walking it in blocks with carried counts:
  documents and regions of every key token, and the row's validation flags;
- `_query_chunk_kernel`, one program per (chunk of `tile_size` queries, batch row): each query's
  first region and sparsity, the chunk's score-tile bounds, and the varlen segment statistics.
After it (the region count is known):
- `_query_rows_kernel`, per chunk again: the dense region ids and the varlen segments;
- `_region_kernel`, per block of key tokens: region sources, documents and first regions.

Chunks and token blocks go on the grid's first axis (CUDA allows 2**31 - 1 programs there, 65535
on the others), batch rows on the second. The varlen segments assume what the layout requires, padding only as a right-padded tail (a
segment is then a document's run of valid queries, starting at a document start or at the shard's
first row): with padding before a valid token the statistics are not used (no layout).
"""

import torch
import triton
import triton.language as tl

TOKEN_BLOCK = 1024
REGION_BLOCK = 1024
SLOT_BLOCK = 128
SUMMARY = 9
"""int64 host summary: negative, discontinuous, left padding, any valid query, region count (the
largest of the rows), segment count, longest query segment, longest key segment, longest window."""


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _is_padding(pad_ptr, index, in_range, HAS_PADDING: tl.constexpr):
    """Whether each token is padding (tokens out of range count as padding)."""
    if HAS_PADDING:
        return tl.load(pad_ptr + index, mask=in_range, other=1) != 0
    return ~in_range


@triton.jit
def _token_scan_kernel(
    pos_ptr,
    pad_ptr,
    documents_ptr,
    regions_ptr,
    summary_ptr,
    length,
    region_size,
    HAS_PADDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * length
    documents = tl.zeros([], dtype=tl.int64)
    regions = tl.zeros([], dtype=tl.int64)
    last_valid = tl.full([], -1, dtype=tl.int64)  # index of the row's last valid token so far
    padding_seen = tl.zeros([], dtype=tl.int64)
    negative = tl.zeros([], dtype=tl.int32)
    discontinuous = tl.zeros([], dtype=tl.int32)
    left_padding = tl.zeros([], dtype=tl.int32)
    for start in range(0, length, BLOCK):
        t = start + tl.arange(0, BLOCK).to(tl.int64)
        in_row = t < length
        pos = tl.load(pos_ptr + row + t, mask=in_row, other=0)
        valid = ~_is_padding(pad_ptr, row + t, in_row, HAS_PADDING)
        previous_valid = ~_is_padding(pad_ptr, row + t - 1, in_row & (t >= 1), HAS_PADDING)
        # the last valid token before t: within the block from t - 1 back, else the carried one
        before = tl.associative_scan(tl.where(previous_valid, t - 1, -1), 0, _max)
        before = tl.maximum(before, last_valid)
        previous_pos = tl.load(pos_ptr + row + before, mask=valid & (before >= 0), other=-1)
        negative |= tl.max((valid & (pos < 0)).to(tl.int32), axis=0)
        broken = valid & (pos != 0) & (pos != previous_pos + 1)
        discontinuous |= tl.max(broken.to(tl.int32), axis=0)
        padding = (in_row & ~valid).to(tl.int64)
        padded_before = padding_seen + tl.cumsum(padding, axis=0) - padding
        left_padding |= tl.max((valid & (padded_before > 0)).to(tl.int32), axis=0)
        document_start = (valid & (pos == 0)).to(tl.int64)
        region_start = (valid & (pos % region_size == 0)).to(tl.int64)
        document = documents + tl.cumsum(document_start, axis=0) - 1
        region = regions + tl.cumsum(region_start, axis=0) - 1
        tl.store(documents_ptr + row + t, tl.where(valid, document, -1), mask=in_row)
        tl.store(regions_ptr + row + t, tl.where(valid, region, -1), mask=in_row)
        documents += tl.sum(document_start, axis=0)
        regions += tl.sum(region_start, axis=0)
        padding_seen += tl.sum(padding, axis=0)
        last_valid = tl.maximum(last_valid, tl.max(tl.where(valid, t, -1), axis=0))
    tl.atomic_max(summary_ptr + 0, negative.to(tl.int64))
    tl.atomic_max(summary_ptr + 1, discontinuous.to(tl.int64))
    tl.atomic_max(summary_ptr + 2, left_padding.to(tl.int64))
    tl.atomic_max(summary_ptr + 4, regions)


@triton.jit
def _chunk_queries(
    pos_ptr,
    pad_ptr,
    regions_ptr,
    length,
    query_start,
    queries,
    tile_size,
    region_size,
    HAS_PADDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """This program's batch row b and its chunk's local queries q [BLOCK], which of them exist,
    and per query: its flat token index, position, validity, current region and history (its
    region within its document)."""
    chunk = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    q = chunk * tile_size + tl.arange(0, BLOCK).to(tl.int64)
    in_chunk = (tl.arange(0, BLOCK) < tile_size) & (q < queries)
    token = b * length + query_start + q
    pos = tl.load(pos_ptr + token, mask=in_chunk, other=0)
    valid = ~_is_padding(pad_ptr, token, in_chunk, HAS_PADDING)
    current = tl.load(regions_ptr + token, mask=in_chunk, other=-1)
    history = tl.where(valid, pos // region_size, -1)
    return b, q, in_chunk, token, pos, valid, current, history


@triton.jit
def _segment_marks(pos_ptr, pad_ptr, q, token, pos, valid, queries, HAS_PADDING: tl.constexpr):
    """Which valid queries start a segment (the shard's first row of the batch row, or a document
    start) and which end one (its last row, before padding, or before a document start)."""
    starts = valid & ((q == 0) | (pos == 0))
    has_next = valid & (q + 1 < queries)
    next_valid = ~_is_padding(pad_ptr, token + 1, has_next, HAS_PADDING)
    next_pos = tl.load(pos_ptr + token + 1, mask=has_next, other=0)
    ends = valid & (~next_valid | (next_pos == 0))
    return starts, ends


@triton.jit
def _query_chunk_kernel(
    pos_ptr,
    pad_ptr,
    regions_ptr,
    first_ptr,
    sparse_ptr,
    query_padding_ptr,
    tiles_ptr,
    chunk_starts_ptr,
    summary_ptr,
    length,
    query_start,
    queries,
    chunks,
    tile_size,
    region_size,
    topk,
    window,
    HAS_PADDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b, q, in_chunk, token, pos, valid, current, history = _chunk_queries(
        pos_ptr, pad_ptr, regions_ptr, length, query_start, queries, tile_size, region_size,
        HAS_PADDING, BLOCK,
    )  # fmt: skip
    first = tl.where(valid, current - history, -1)
    sparse = valid & (history > topk)
    local = b * queries + q
    tl.store(first_ptr + local, first, mask=in_chunk)
    tl.store(sparse_ptr + local, sparse.to(tl.int8), mask=in_chunk)
    tl.store(query_padding_ptr + local, (~valid).to(tl.int8), mask=in_chunk)

    # the score tile: rows and region interval of the chunk's sparse queries ([4, B, chunks])
    big = 2**62
    tile = b * chunks + tl.program_id(0)
    plane = tl.num_programs(1).to(tl.int64) * chunks
    tl.store(tiles_ptr + tile, tl.min(tl.where(sparse, q, big), axis=0))
    tl.store(tiles_ptr + plane + tile, tl.max(tl.where(sparse, q, -1), axis=0))
    tl.store(tiles_ptr + 2 * plane + tile, tl.min(tl.where(sparse, first, big), axis=0))
    tl.store(tiles_ptr + 3 * plane + tile, tl.max(tl.where(sparse, current, -1), axis=0))

    # varlen statistics, from each segment's last query e: its first query is max(0, e - pos), its
    # keys the document's first pos + 1, of which a window keeps at most e - first + window
    starts, ends = _segment_marks(pos_ptr, pad_ptr, q, token, pos, valid, queries, HAS_PADDING)
    first_query = tl.maximum(q - pos, 0)
    window_keys = tl.minimum(pos + 1, q - first_query + window)
    started = tl.sum(starts.to(tl.int64), axis=0)
    tl.store(chunk_starts_ptr + tile, started)
    tl.atomic_max(summary_ptr + 3, tl.max(valid.to(tl.int64), axis=0))
    tl.atomic_add(summary_ptr + 5, started)
    tl.atomic_max(summary_ptr + 6, tl.max(tl.where(ends, q - first_query + 1, 0), axis=0))
    tl.atomic_max(summary_ptr + 7, tl.max(tl.where(ends, pos + 1, 0), axis=0))
    tl.atomic_max(summary_ptr + 8, tl.max(tl.where(ends, window_keys, 0), axis=0))


@triton.jit
def _query_rows_kernel(
    pos_ptr,
    pad_ptr,
    regions_ptr,
    first_ptr,
    sparse_ptr,
    chunk_prefix_ptr,
    dense_ptr,
    segments_ptr,
    length,
    query_start,
    queries,
    chunks,
    tile_size,
    region_size,
    count,
    slots,
    window,
    segment_count,
    HAS_PADDING: tl.constexpr,
    SEGMENTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SLOTS: tl.constexpr,
):
    b, q, in_chunk, token, pos, valid, current, history = _chunk_queries(
        pos_ptr, pad_ptr, regions_ptr, length, query_start, queries, tile_size, region_size,
        HAS_PADDING, BLOCK,
    )  # fmt: skip
    local = b * queries + q

    # dense ids: the document's regions up to the query's own, for valid queries that are not sparse
    first = tl.load(first_ptr + local, mask=in_chunk, other=0)
    sparse = tl.load(sparse_ptr + local, mask=in_chunk, other=0) != 0
    last_offset = tl.where(valid & ~sparse, history, -1)
    for slot0 in range(0, slots, SLOTS):
        slot = slot0 + tl.arange(0, SLOTS)
        ids = tl.where(slot[None, :] <= last_offset[:, None], first[:, None] + slot[None, :], count)
        at = dense_ptr + local[:, None] * slots + slot[None, :]
        tl.store(at, ids.to(tl.int32), mask=in_chunk[:, None] & (slot < slots)[None, :])

    if SEGMENTS:  # [5, segments]: query start, query stop, key start, key stop, window start
        starts, ends = _segment_marks(pos_ptr, pad_ptr, q, token, pos, valid, queries, HAS_PADDING)
        before = tl.load(chunk_prefix_ptr + b * chunks + tl.program_id(0))
        segment = before + tl.cumsum(starts.to(tl.int64), axis=0) - 1
        key = token - pos  # the document's first key (flat)
        tl.store(segments_ptr + segment, local, mask=starts)
        tl.store(segments_ptr + 2 * segment_count + segment, key, mask=starts)
        window_start = tl.maximum(key, token - (window - 1))
        tl.store(segments_ptr + 4 * segment_count + segment, window_start, mask=starts)
        tl.store(segments_ptr + segment_count + segment, local + 1, mask=ends)
        tl.store(segments_ptr + 3 * segment_count + segment, token + 1, mask=ends)


@triton.jit
def _region_kernel(
    pos_ptr,
    pad_ptr,
    documents_ptr,
    regions_ptr,
    sources_ptr,
    region_documents_ptr,
    region_first_ptr,
    length,
    region_size,
    count,
    HAS_PADDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1).to(tl.int64)
    in_row = t < length
    token = b * length + t
    valid = ~_is_padding(pad_ptr, token, in_row, HAS_PADDING)
    pos = tl.load(pos_ptr + token, mask=valid, other=0)
    region = tl.load(regions_ptr + token, mask=valid, other=0)
    offset = pos % region_size
    source = (b * count + region) * region_size + offset
    tl.store(sources_ptr + source, t.to(tl.int32), mask=valid)
    starts = valid & (offset == 0)
    document = tl.load(documents_ptr + token, mask=starts, other=0)
    tl.store(region_documents_ptr + b * count + region, document, mask=starts)
    tl.store(region_first_ptr + b * count + region, region - pos // region_size, mask=starts)


class DeviceMetadata:
    """The Triton half of `region_metadata`: `__init__` launches the work before the host
    synchronisation and holds `host` (int64 [SUMMARY + 4 * B * chunks]); `finish` the rest."""

    def __init__(
        self,
        pos: torch.Tensor,
        padding: torch.Tensor | None,
        query_start: int,
        queries: int,
        region_size: int,
        topk: int,
        window: int | None,
        tile_size: int,
    ) -> None:
        batch, length = pos.shape
        device = pos.device
        self.pos = pos.contiguous()
        self.has_padding = padding is not None
        # the padding mask as int8, or (never read without padding) any pointer
        self.pad = padding.contiguous().view(torch.int8) if self.has_padding else self.pos
        self.shape = (batch, length, query_start, queries, region_size, topk, tile_size)
        self.window = length + 1 if window is None else window  # wider than any segment
        self.chunks = triton.cdiv(queries, tile_size)
        self.block = triton.next_power_of_2(tile_size)
        self.documents = torch.empty_like(self.pos)
        self.token_regions = torch.empty_like(self.pos)
        summary = torch.zeros(SUMMARY + 4 * batch * self.chunks, dtype=torch.int64, device=device)
        self.query_first_region = torch.empty(batch, queries, dtype=torch.int64, device=device)
        self.sparse = torch.empty(batch, queries, dtype=torch.bool, device=device)
        self.query_padding = torch.empty(batch, queries, dtype=torch.bool, device=device)
        self.chunk_starts = torch.empty(batch * self.chunks, dtype=torch.int64, device=device)
        _token_scan_kernel[(batch,)](
            self.pos,
            self.pad,
            self.documents,
            self.token_regions,
            summary,
            length,
            region_size,
            HAS_PADDING=self.has_padding,
            BLOCK=TOKEN_BLOCK,
            num_warps=4,
        )
        _query_chunk_kernel[(self.chunks, batch)](
            self.pos,
            self.pad,
            self.token_regions,
            self.query_first_region,
            self.sparse.view(torch.int8),
            self.query_padding.view(torch.int8),
            summary[SUMMARY:],
            self.chunk_starts,
            summary,
            length,
            query_start,
            queries,
            self.chunks,
            tile_size,
            region_size,
            topk,
            self.window,
            HAS_PADDING=self.has_padding,
            BLOCK=self.block,
            num_warps=1,
        )
        self.host = summary

    def finish(
        self, count: int, segment_count: int, with_segments: bool
    ) -> dict[str, torch.Tensor | dict[str, torch.Tensor]]:
        """The tensors that need the region count: dense ids, region sources, documents and first
        regions, and (`with_segments`) the varlen segments' flat bounds."""
        batch, length, query_start, queries, region_size, topk, tile_size = self.shape
        device = self.pos.device
        slots = min(topk, count) + 1
        dense = torch.empty(batch, queries, slots, dtype=torch.int32, device=device)
        segments = torch.empty(5, max(segment_count, 1), dtype=torch.int64, device=device)
        prefix = torch.cumsum(self.chunk_starts, 0) - self.chunk_starts if with_segments else dense
        _query_rows_kernel[(self.chunks, batch)](
            self.pos,
            self.pad,
            self.token_regions,
            self.query_first_region,
            self.sparse.view(torch.int8),
            prefix,
            dense,
            segments,
            length,
            query_start,
            queries,
            self.chunks,
            tile_size,
            region_size,
            count,
            slots,
            self.window,
            segment_count,
            HAS_PADDING=self.has_padding,
            SEGMENTS=with_segments,
            BLOCK=self.block,
            SLOTS=min(SLOT_BLOCK, triton.next_power_of_2(slots)),
            num_warps=4,
        )
        sources = torch.full((batch, count, region_size), -1, dtype=torch.int32, device=device)
        region_documents = torch.full((batch, count), -1, dtype=torch.int64, device=device)
        region_first = torch.full((batch, count), -1, dtype=torch.int64, device=device)
        _region_kernel[(triton.cdiv(length, REGION_BLOCK), batch)](
            self.pos,
            self.pad,
            self.documents,
            self.token_regions,
            sources,
            region_documents,
            region_first,
            length,
            region_size,
            count,
            HAS_PADDING=self.has_padding,
            BLOCK=REGION_BLOCK,
            num_warps=4,
        )
        start, stop, key_start, key_stop, window_start = segments[:, :segment_count]
        return {
            "token_regions": self.token_regions,
            "documents": self.documents,
            "query_padding": self.query_padding,
            "query_first_region": self.query_first_region,
            "sparse_queries": self.sparse,
            "dense_region_ids": dense,
            "region_sources": sources,
            "region_documents": region_documents,
            "region_first": region_first,
            "segments": {
                "query_start": start,
                "query_stop": stop,
                "key_start": key_start,
                "key_stop": key_stop,
                "window_start": window_start,
            },
        }
