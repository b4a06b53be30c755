"""Synthetic causal routes and region selections, for benchmarks, examples and tests.

Public: the inputs `sparse_gqa_attention` and `sparse_region_attention` take, drawn at random with
the structure the routing layers emit, to time or try the ops without a model.

Token routes (`sparse_gqa_attention`'s `token_ids`):
- `scattered_routes`: QSA-like; random complete `block`-token blocks before each query plus its tail
  tokens (the gather kernels' case).
- `clustered_routes`: each 128-query tile shares whole 128-key tiles, its own causally cut (the
  Flex / FA4 case).

Regions (`sparse_region_attention`'s `region_ids` and `region_sources`):
- `region_layout` lays documents out one after another in each batch row (padding after them) and
  cuts each document into regions of `region_size` tokens restarting at its start (SEMANTICS §1.2),
  so a document's last region may be short.
- `csa_selection` draws, per (batch, group, query), what the Step-5 indexer would emit: every
  region of the query's document up to its own when at most `topk` precede it (dense-equivalent),
  else `topk` random earlier regions of the document plus its own; ascending, unused slots = the
  region count.
- `clustered_csa_selection` draws the same rows with the structure of an indexer that learned
  locality: every query of a 128-query tile shares whole runs of 16 regions (one 128-key tile at
  region size 8 when the document starts on a tile edge), plus the regions of its own run up to
  its own (the Flex / block-sparse case).

Every function takes an optional `torch.Generator` for reproducible draws.
"""

import torch

__all__ = [
    "clustered_csa_selection",
    "clustered_routes",
    "csa_selection",
    "region_layout",
    "scattered_routes",
]

# Rows drawn per step of `scattered_routes` (bounds its [rows, blocks] random scores).
_ROWS_PER_STEP = 4096


def _ascending(tokens: torch.Tensor) -> torch.Tensor:
    """Valid ids ascending, then the −1 padding: the layout the route selectors emit."""
    big = torch.iinfo(tokens.dtype).max
    tokens = torch.where(tokens >= 0, tokens, big).sort(dim=-1).values
    return torch.where(tokens == big, -1, tokens)


def scattered_routes(
    batch: int,
    route_heads: int,
    queries: int,
    kv_length: int,
    *,
    block: int,
    blocks_per_query: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """QSA-like routes: random complete `block`-token blocks before the query, then its tail tokens.

    Query row i sits at global position p = kv_length − queries + i. A row with at most
    `blocks_per_query` complete visible blocks takes them all (tokens 0 … p, the dense row); others
    take `blocks_per_query` of them uniformly at random. Then the tail tokens (p+1)//block·block … p.
    Returns:
        int32 [batch, route_heads, queries, blocks_per_query·block + block − 1]: valid ids
        ascending, then −1.
    """
    offset = kv_length - queries
    blocks = max(1, kv_length // block)
    rows = batch * route_heads
    lanes = torch.arange(block, device=device)
    tail_lanes = torch.arange(block - 1, device=device)
    out = torch.empty(
        rows, queries, blocks_per_query * block + block - 1, dtype=torch.int32, device=device
    )
    for start in range(0, queries, _ROWS_PER_STEP):
        stop = min(start + _ROWS_PER_STEP, queries)
        pos = torch.arange(offset + start, offset + stop, device=device)
        visible = ((pos + 1) // block).view(1, -1, 1)
        scores = torch.rand(rows, stop - start, blocks, generator=generator, device=device)
        scores = torch.where(torch.arange(blocks, device=device) < visible, scores, -1.0)
        picked = scores.topk(min(blocks_per_query, blocks), dim=-1).indices
        tokens = picked.unsqueeze(-1) * block + lanes
        tokens = torch.where((picked < visible).unsqueeze(-1), tokens, -1).flatten(-2)
        if tokens.shape[-1] < blocks_per_query * block:
            pad = blocks_per_query * block - tokens.shape[-1]
            tokens = torch.nn.functional.pad(tokens, (0, pad), value=-1)
        tail = visible * block + tail_lanes
        tail = torch.where(tail <= pos.view(1, -1, 1), tail, -1).expand(rows, -1, -1)
        out[:, start:stop] = _ascending(torch.cat([tokens, tail], dim=-1)).to(torch.int32)
    return out.view(batch, route_heads, queries, -1)


def clustered_routes(
    batch: int,
    route_heads: int,
    queries: int,
    kv_length: int,
    *,
    tiles_per_query: int,
    tile: int = 128,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Block-aligned routes: each `tile`-query tile shares `tiles_per_query` key tiles (runs of `tile`).

    Query row i sits at global position p = kv_length − queries + i (kv_length − queries must be a
    multiple of `tile`). Its tile picks its own (diagonal) key tile, causally cut at p, plus
    `tiles_per_query − 1` earlier key tiles at random (all of them when fewer exist).
    Returns:
        int32 [batch, route_heads, queries, tiles_per_query·tile]: valid ids ascending, then −1.
    """
    offset = kv_length - queries
    if offset % tile:
        raise ValueError(f"clustered_routes: kv_length − queries must be a multiple of {tile}")
    q_tiles = -(-queries // tile)
    rows = batch * route_heads
    own = (offset // tile + torch.arange(q_tiles, device=device)).view(1, -1, 1)
    kv_tiles = -(-kv_length // tile)
    scores = torch.rand(rows, q_tiles, kv_tiles, generator=generator, device=device)
    scores = torch.where(torch.arange(kv_tiles, device=device) < own, scores, -1.0)
    earlier = min(tiles_per_query - 1, kv_tiles)
    picked = (
        scores.topk(earlier, dim=-1).indices if earlier else own[..., :0].expand(rows, q_tiles, 0)
    )
    picked = torch.where(picked < own, picked, -1)
    chosen = torch.cat([picked, own.expand(rows, -1, -1)], dim=-1)  # [rows, q_tiles, tiles]
    lanes = torch.arange(tile, device=device)
    tokens = torch.where((chosen >= 0).unsqueeze(-1), chosen.unsqueeze(-1) * tile + lanes, -1)
    tokens = tokens.flatten(-2).repeat_interleave(tile, dim=1)[:, :queries]  # [rows, queries, W]
    pos = (offset + torch.arange(queries, device=device)).view(1, -1, 1)
    tokens = torch.where(tokens <= pos, tokens, -1)
    return _ascending(tokens).to(torch.int32).view(batch, route_heads, queries, -1)


# Score elements per step of `csa_selection` (bounds its [batch, groups, rows, regions] scores).
_SCORE_ELEMENTS = 1 << 25


def region_layout(
    document_lengths: list[list[int]],
    kv_length: int,
    region_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Regions of documents laid out from row 0 of each batch row, padding after them.

    Args:
        document_lengths: per batch row, its documents' token counts (sum <= kv_length).
        kv_length: key rows per batch row.
        region_size: tokens per region.
    Returns:
        region_sources: int32 [batch, regions, region_size], key rows, -1 past a short last region
            and for the regions a batch row does not have (regions = the largest count).
        token_regions: int64 [batch, kv_length], each token's region, -1 for padding.
        first_regions: int64 [batch, kv_length], the first region of each token's document, -1 for
            padding.
    """
    batch = len(document_lengths)
    token_regions = torch.full((batch, kv_length), -1, dtype=torch.int64)
    first_regions = torch.full((batch, kv_length), -1, dtype=torch.int64)
    counts = []
    for b, lengths in enumerate(document_lengths):
        if sum(lengths) > kv_length:
            raise ValueError(
                f"region_layout: documents of row {b} hold {sum(lengths)} tokens; kv_length is "
                f"{kv_length}"
            )
        start, region = 0, 0
        for length in lengths:
            local = torch.arange(length)
            token_regions[b, start : start + length] = region + local // region_size
            first_regions[b, start : start + length] = region
            start += length
            region += -(-length // region_size)
        counts.append(region)
    regions = max(1, *counts)
    region_sources = torch.full((batch, regions + 1, region_size), -1, dtype=torch.int32)
    rows = torch.arange(kv_length).expand(batch, -1)
    valid = token_regions >= 0
    # offset of each token inside its region: tokens of one region are consecutive rows
    first_row = torch.full((batch, regions + 1), kv_length, dtype=torch.int64)
    slot = torch.where(valid, token_regions, regions)
    first_row.scatter_reduce_(1, slot, rows, reduce="amin")
    offset = rows - first_row.gather(1, slot)
    flat = (slot * region_size + torch.where(valid, offset, 0)).view(batch, -1)
    region_sources.view(batch, -1).scatter_(
        1, torch.where(valid.view(batch, -1), flat, regions * region_size), rows.to(torch.int32)
    )
    region_sources[:, regions] = -1
    return (
        region_sources[:, :regions].contiguous().to(device),
        token_regions.to(device),
        first_regions.to(device),
    )


def csa_selection(
    token_regions: torch.Tensor,
    first_regions: torch.Tensor,
    regions: int,
    *,
    groups: int,
    topk: int,
    query_start: int = 0,
    queries: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """CSA-like region ids per (batch, group, query): the query's own region plus up to `topk`
    earlier regions of its document (all of them when at most `topk` precede it).

    Args:
        token_regions: int64 [batch, kv_length], each token's region, -1 for padding
            (`region_layout`'s second result).
        first_regions: int64 [batch, kv_length], the first region of each token's document
            (`region_layout`'s third result).
        regions: the region count (`region_sources.shape[1]`), also the unused-slot id.
        groups: KV groups, one independent draw each.
        topk: earlier regions per query.
        query_start, queries: the queries are global rows query_start … query_start + queries − 1
            (default: to the end), as for a context-parallel shard.
    Returns:
        int32 [batch, groups, queries, min(topk, regions) + 1], ascending, unused slots =
        `regions`; padding queries select nothing.
    """
    batch, kv_length = token_regions.shape
    device = token_regions.device
    queries = kv_length - query_start if queries is None else queries
    keep = min(topk, regions)
    out = torch.full((batch, groups, queries, keep + 1), regions, dtype=torch.int32, device=device)
    step = max(1, _SCORE_ELEMENTS // max(1, batch * groups * regions))
    region = torch.arange(regions, device=device)
    for start in range(0, queries, step):
        stop = min(start + step, queries)
        own = token_regions[:, query_start + start : query_start + stop].view(batch, 1, -1, 1)
        first = first_regions[:, query_start + start : query_start + stop].view(batch, 1, -1, 1)
        candidate = (region >= first) & (region < own)  # earlier regions of the document
        scores = torch.rand(
            batch, groups, stop - start, regions, generator=generator, device=device
        )
        scores = torch.where(candidate, scores, -1.0)
        best, picked = scores.topk(keep, dim=-1) if keep else (scores[..., :0], None)
        ids = torch.where(best >= 0, picked, regions) if keep else best.long()
        ids = torch.cat([ids, torch.where(own >= 0, own, regions).expand(-1, groups, -1, 1)], -1)
        out[:, :, start:stop] = ids.sort(dim=-1).values.to(torch.int32)
    return out


def clustered_csa_selection(
    token_regions: torch.Tensor,
    first_regions: torch.Tensor,
    regions: int,
    *,
    groups: int,
    topk: int,
    run: int = 16,
    query_tile: int = 128,
    query_start: int = 0,
    queries: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Clustered CSA-like region ids per (batch, group, query): whole runs of `run` regions shared by
    every query of a `query_tile`-query tile, as an indexer with local structure would emit.

    A document's regions fall into runs of `run` (run j: its regions first + j·run … first +
    (j + 1)·run − 1). A query with at most `topk` earlier regions in its document selects them all
    plus its own (the dense-equivalent row, as `csa_selection`). Any other query selects
    `topk // run − 1` whole runs before its own run, drawn by scores shared by its (batch, group,
    query tile) — so queries of one tile and document whose own run is the same select the same
    runs — plus the regions of its own run up to and including its own: at most `topk` regions in
    all, one fewer than the indexer's `topk` earlier regions plus its own.

    Args:
        token_regions, first_regions, regions, groups, topk, query_start, queries, generator: as
            `csa_selection`.
        run: regions per shared run, counted from the document's first region (16: one 128-key
            tile at region size 8 where the document starts on a multiple of 128 tokens).
        query_tile: global query rows that share one draw. Each call draws its own scores, so
            separate calls for the shards of one row do not give one row's draw.
    Returns:
        int32 [batch, groups, queries, min(topk, regions) + 1], ascending, unused slots =
        `regions`; padding queries select nothing.
    """
    if run < 1 or topk < 2 * run:
        raise ValueError(
            f"clustered_csa_selection: needs run >= 1 and topk >= 2·run; got run={run}, topk={topk}"
        )
    batch, kv_length = token_regions.shape
    device = token_regions.device
    queries = kv_length - query_start if queries is None else queries
    keep = min(topk, regions)
    picks = topk // run - 1
    runs = -(-regions // run)
    out = torch.full((batch, groups, queries, keep + 1), regions, dtype=torch.int32, device=device)
    first_tile = query_start // query_tile
    tiles = (query_start + queries - 1) // query_tile - first_tile + 1
    scores = torch.rand(batch, groups, tiles, runs, generator=generator, device=device)
    lanes = torch.arange(run, device=device)
    dense_lanes = torch.arange(keep + 1, device=device)
    step = max(query_tile, _SCORE_ELEMENTS // max(1, batch * groups * max(runs, picks * run)))
    for start in range(0, queries, step):
        stop = min(start + step, queries)
        rows = slice(query_start + start, query_start + stop)
        own = token_regions[:, rows].view(batch, 1, -1, 1)
        first = first_regions[:, rows].view(batch, 1, -1, 1)
        earlier = own - first  # regions of the document before the query's own
        own_run = earlier.div(run, rounding_mode="floor")
        tile = (torch.arange(query_start + start, query_start + stop, device=device)) // query_tile
        tile_scores = scores[:, :, tile - first_tile]  # [batch, groups, rows, runs]
        tile_scores = torch.where(torch.arange(runs, device=device) < own_run, tile_scores, -1.0)
        best, picked = tile_scores.topk(min(picks, runs), dim=-1)
        picked = first + picked * run  # first region of each picked run
        runs_ids = torch.where((best >= 0).unsqueeze(-1), picked.unsqueeze(-1) + lanes, regions)
        own_ids = first + own_run * run + lanes
        own_ids = torch.where(own_ids <= own, own_ids, regions).expand(-1, groups, -1, -1)
        sparse = torch.cat([runs_ids.flatten(-2), own_ids], dim=-1)
        width = keep + 1
        if sparse.shape[-1] < width:
            sparse = torch.nn.functional.pad(sparse, (0, width - sparse.shape[-1]), value=regions)
        sparse = sparse.sort(dim=-1).values[..., :width]
        dense = first + dense_lanes
        dense = torch.where(dense <= own, dense, regions).expand(-1, groups, -1, -1)
        ids = torch.where(earlier <= topk, dense, sparse)
        out[:, :, start:stop] = torch.where(own >= 0, ids, regions).to(torch.int32)
    return out
