"""The oracles of `region_metadata`, both plain PyTorch.

- `reference_regions`: every row walked token by token in Python, from SEMANTICS §1.3 alone; slow
  on purpose, the tests compare both paths against it.
- `TorchMetadata`: the PyTorch path (`backend="reference"`, and "auto" off CUDA), cumulative sums
  and reductions over whole rows; the Triton path (`triton_kernels`) must give the same tensors.
"""

import math

import torch


def reference_regions(
    key_positions: torch.Tensor, key_padding: torch.Tensor | None, region_size: int
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Walk every row token by token: per row, each token's global region (-1 padding), each region's
    document, and each region's first region in its document."""
    positions = key_positions.tolist()
    padding = (
        [[False] * len(row) for row in positions] if key_padding is None else key_padding.tolist()
    )
    token_regions, region_documents, region_first = [], [], []
    for row_pos, row_pad in zip(positions, padding, strict=True):
        regions, docs, firsts = [], [], []
        document, doc_first, previous = -1, 0, None
        for p, pad in zip(row_pos, row_pad, strict=True):
            if pad:
                regions.append(-1)
                continue
            if p == 0:
                document += 1
                doc_first = len(docs)
            elif previous is None or p != previous + 1:
                raise ValueError(f"reference_regions: position {p} does not continue its document")
            if p % region_size == 0:
                docs.append(document)
                firsts.append(doc_first)
            regions.append(len(docs) - 1)
            previous = p
        token_regions.append(regions)
        region_documents.append(docs)
        region_first.append(firsts)
    return token_regions, region_documents, region_first


class TorchMetadata:
    """The PyTorch path of `region_metadata` (CPU, `backend="reference"`; the oracle of
    `triton_kernels.DeviceMetadata`): `__init__` derives every tensor the host must read with
    cumulative sums and reductions and holds them in `host` (int64: the flags, the varlen
    statistics, then the [4, B, chunks] tile bounds); `finish` builds the tensors that need the
    region count."""

    def __init__(
        self,
        pos: torch.Tensor,
        key_padding: torch.Tensor | None,
        query_start: int,
        queries: int,
        region_size: int,
        topk: int,
        window: int | None,
        tile_size: int,
    ) -> None:
        batch, length = pos.shape
        device = pos.device
        valid = torch.ones_like(pos, dtype=torch.bool) if key_padding is None else ~key_padding
        token_index = torch.arange(length, device=device).expand(batch, length)

        # Documents and regions of every key token.
        last_valid = torch.cummax(torch.where(valid, token_index, -1), dim=1).values
        previous_valid = torch.nn.functional.pad(last_valid[:, :-1], (1, 0), value=-1)
        previous_pos = torch.where(
            previous_valid >= 0, pos.gather(1, previous_valid.clamp(min=0)), -1
        )
        negative = valid & (pos < 0)
        discontinuous = valid & (pos != 0) & (pos != previous_pos + 1)
        padding_so_far = torch.cumsum(~valid, dim=1)
        padded_before = (padding_so_far - (~valid).to(padding_so_far.dtype)) > 0
        left_padding = valid & padded_before

        region_local = torch.div(pos, region_size, rounding_mode="floor")
        documents = torch.where(valid, torch.cumsum(valid & (pos == 0), dim=1) - 1, -1)
        region_start = valid & (pos % region_size == 0)
        token_regions = torch.where(valid, torch.cumsum(region_start, dim=1) - 1, -1)
        regions_per_row = region_start.sum(dim=1)

        # Queries of this shard.
        rows = slice(query_start, query_start + queries)
        query_valid = valid[:, rows]
        current = token_regions[:, rows]
        history = torch.where(query_valid, region_local[:, rows], -1)
        query_first_region = torch.where(query_valid, current - history, -1)
        sparse = query_valid & (history > topk)

        # Score tiles: per (batch, chunk of tile_size queries) the sparse rows and their regions.
        chunks = math.ceil(queries / tile_size)
        pad = chunks * tile_size - queries
        local = torch.arange(queries, device=device).expand(batch, queries)
        big = 2**62  # exact as a double (F.pad takes its fill value as one)

        def chunk_reduce(values: torch.Tensor, fill: int, reduce: str) -> torch.Tensor:
            padded = torch.nn.functional.pad(
                torch.where(sparse, values, fill), (0, pad), value=fill
            )
            shaped = padded.view(batch, chunks, tile_size)
            return shaped.amin(dim=2) if reduce == "min" else shaped.amax(dim=2)

        tile_info = torch.stack(
            [
                chunk_reduce(local, big, "min"),
                chunk_reduce(local, -1, "max"),
                chunk_reduce(query_first_region, big, "min"),
                chunk_reduce(current, -1, "max"),
            ]
        )
        self.segments = _varlen_segments(pos, valid, query_start, queries, window)
        flags = torch.stack(
            [
                negative.any(),
                discontinuous.any(),
                left_padding.any(),
                query_valid.any(),
                regions_per_row.max(),
            ]
        ).to(torch.int64)
        self.host = torch.cat([flags, self.segments["host"], tile_info.flatten()])
        # what `finish` needs
        self.region_size = region_size
        self.topk = topk
        self.pos = pos
        self.valid = valid
        self.token_index = token_index
        self.documents = documents
        self.token_regions = token_regions
        self.region_local = region_local
        self.region_start = region_start
        self.query_valid = query_valid
        self.sparse = sparse
        self.history = history
        self.query_first_region = query_first_region

    def finish(
        self, count: int, segment_count: int, with_segments: bool
    ) -> dict[str, torch.Tensor | dict[str, torch.Tensor]]:
        """The tensors that need the region count. The varlen segments were built before the sync
        on this path (`segment_count`, `with_segments`: the Triton path's arguments)."""
        region_size, pos, valid = self.region_size, self.pos, self.valid
        batch = pos.shape[0]
        slots = min(self.topk, count) + 1
        scatter_at = torch.where(self.region_start, self.token_regions, count)
        region_documents = _scatter_rows(scatter_at, self.documents, count, fill=-1)
        region_first = _scatter_rows(
            scatter_at, self.token_regions - self.region_local, count, fill=-1
        )
        source_at = torch.where(
            valid, self.token_regions * region_size + pos % region_size, count * region_size
        )
        region_sources = _scatter_rows(
            source_at, self.token_index, count * region_size, fill=-1
        ).to(torch.int32)

        # [B, Q, slots] in int32 from the start: two broadcast passes, no int64 temporaries.
        offsets = torch.arange(slots, dtype=torch.int32, device=pos.device)
        dense_rows = self.query_valid & ~self.sparse
        last_offset = torch.where(dense_rows, self.history, -1).to(torch.int32).unsqueeze(-1)
        first = self.query_first_region.to(torch.int32).unsqueeze(-1)
        return {
            "token_regions": self.token_regions,
            "documents": self.documents,
            "region_documents": region_documents,
            "region_first": region_first,
            "region_sources": region_sources.view(batch, count, region_size),
            "query_padding": ~self.query_valid,
            "query_first_region": self.query_first_region,
            "sparse_queries": self.sparse,
            "dense_region_ids": torch.where(offsets <= last_offset, first + offsets, count),
            "segments": self.segments,
        }


def _scatter_rows(index: torch.Tensor, values: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """`out[b, index[b, t]] = values[b, t]` into `[batch, width]`; index `width` is a discarded dump slot."""
    out = torch.full((index.shape[0], width + 1), fill, dtype=values.dtype, device=values.device)
    return out.scatter_(1, index, values)[:, :width]


def _varlen_segments(
    pos: torch.Tensor, valid: torch.Tensor, query_start: int, queries: int, window: int | None
) -> dict[str, torch.Tensor]:
    """Per (batch row, document) segment of this shard's valid queries, in buffers of B*Q + 1 rows."""
    batch, length = pos.shape
    device = pos.device
    rows = slice(query_start, query_start + queries)
    q_valid = valid[:, rows].reshape(-1)
    q_pos = pos[:, rows]
    q_global = torch.arange(query_start, query_start + queries, device=device).expand(
        batch, queries
    )
    row_offset = (torch.arange(batch, device=device) * length).unsqueeze(1)
    flat_global = (row_offset + q_global).reshape(-1)
    doc_start = (row_offset + q_global - q_pos).reshape(-1)
    total = batch * queries
    flat = torch.arange(total, device=device)
    row_begin = flat % queries == 0
    row_end = flat % queries == queries - 1
    prev_valid = torch.nn.functional.pad(q_valid[:-1], (1, 0), value=False)
    next_valid = torch.nn.functional.pad(q_valid[1:], (0, 1), value=False)
    starts = q_valid & (row_begin | ~prev_valid | (q_pos.reshape(-1) == 0))
    next_start = torch.nn.functional.pad(starts[1:], (0, 1), value=True)
    ends = q_valid & (row_end | ~next_valid | next_start)
    segment = torch.cumsum(starts, dim=0) - 1
    dump = total

    def at(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(total + 1, dtype=torch.int64, device=device)
        return out.scatter_(0, torch.where(mask, segment, dump), values)[:total]

    query_begin = at(starts, flat)
    query_stop = at(ends, flat + 1)
    key_start = at(starts, doc_start)
    key_stop = at(ends, flat_global + 1)
    first_global = at(starts, flat_global)
    window_start = (
        key_start if window is None else torch.maximum(key_start, first_global - (window - 1))
    )
    key_len = torch.where(key_stop > 0, key_stop - key_start, 0)
    window_len = torch.where(key_stop > 0, key_stop - window_start, 0)
    host = torch.stack(
        [starts.sum(), (query_stop - query_begin).max(), key_len.max(), window_len.max()]
    ).to(torch.int64)
    return {
        "host": host,
        "query_start": query_begin,
        "query_stop": query_stop,
        "key_start": key_start,
        "window_start": window_start,
        "key_stop": key_stop,
    }
