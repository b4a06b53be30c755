"""Synthetic causal routes for tests and benchmarks: QSA-like scattered blocks and tile-clustered runs."""

import torch

# Rows drawn per step (bounds the [rows, blocks] random scores).
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
