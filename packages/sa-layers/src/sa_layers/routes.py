"""The seam between routing and attention: what a routed layer selects once and replays.

A routed layer's forward asks its replay channel for routes (`channel.select_or_replay(select)`):
in the forward the router runs and the routes are recorded; when activation checkpointing reruns the
layer, the recorded routes (ids and the block mask built from them) come back unchanged, so the
recompute neither runs the router nor rebuilds the mask and needs no host synchronisation.
"""

from dataclasses import dataclass

import torch

from sa_kernels import RouteBlockMask, build_route_block_mask
from sa_kernels.sparse_gqa.block_mask import FLEX_MIN_OCCUPANCY, TILE

ATTENTION_BACKENDS = ("auto", "flex", "gather", "fa4", "reference")
INDEXER_TRAINING = ("off", "dense_warmup", "sparse")
"""Indexer training stages: frozen routing; a dense warm-up that trains only the indexers by
distillation from dense attention; sparse training with the distillation loss on the selected units."""
# What each backend needs of the route mask (`build_route_block_mask(build_flex=...)`): None builds
# the tile statistics `auto` decides from, False a gather-only mask.
_BUILD_FLEX = {"auto": None, "flex": True, "fa4": True, "gather": False}
# "auto" first estimates the occupancy on this many evenly spaced query tiles of 128 rows; routes
# whose estimate is below half of FLEX_MIN_OCCUPANCY get a gather-only mask.
SAMPLED_QUERY_TILES = 16


@dataclass(frozen=True)
class TokenRoutes:
    """One layer's token routes and, for the fused backends, their block mask.

    Attributes:
        token_ids: int32 [batch, queries, W] (shared by every KV head) or [batch, kv_heads, queries, W]:
            global key ids, valid ids first, −1 padding.
        block_mask: the `RouteBlockMask` of `token_ids`, or None where the backend reads the ids
            (the reference backend, "auto" on CPU).
    """

    token_ids: torch.Tensor
    block_mask: RouteBlockMask | None


def token_routes(
    token_ids: torch.Tensor, kv_length: int, query_heads: int, backend: str
) -> TokenRoutes:
    """`TokenRoutes` of `token_ids` with the block mask `backend` needs (built once, here).

    "gather" builds no Flex mask. "auto" (on CUDA) estimates the occupancy on a sample of query
    tiles first (`sampled_occupancy`): routes clearly too scattered for Flex (estimate below
    FLEX_MIN_OCCUPANCY / 2) get the gather-only mask, skipping the tile binning of every route
    entry; the others are built with their exact tile statistics, which decide between Flex, FA4
    and gather. Each build reads the device once or twice (the canonical-order check, the
    statistics or the estimate).
    """
    needs_mask = backend != "reference" and not (
        backend == "auto" and token_ids.device.type != "cuda"
    )
    if not needs_mask:
        return TokenRoutes(token_ids, None)
    mask = build_route_block_mask(
        token_ids, kv_length, query_heads, build_flex=flex_build(token_ids, kv_length, backend)
    )
    return TokenRoutes(token_ids, mask)


def flex_build(token_ids: torch.Tensor, kv_length: int, backend: str) -> bool | None:
    """The `build_flex` argument of `build_route_block_mask` for `backend`: True for "flex" and
    "fa4", False for "gather" and for "auto" on routes whose sampled occupancy is below
    FLEX_MIN_OCCUPANCY / 2, otherwise None (the exact statistics decide)."""
    build = _BUILD_FLEX[backend]
    if build is None:
        estimate = sampled_occupancy(token_ids, kv_length)
        if estimate is not None and estimate < FLEX_MIN_OCCUPANCY / 2:
            return False
    return build


def sampled_occupancy(
    token_ids: torch.Tensor, kv_length: int, tiles: int = SAMPLED_QUERY_TILES
) -> float | None:
    """The routes' occupancy (selected pairs / area of the 128×128 tiles they touch, as
    `RouteBlockMask.occupancy`) estimated on `tiles` evenly spaced full query tiles.

    Args:
        token_ids: int [batch, queries, W] or [batch, route_heads, queries, W]; ids outside
            [0, kv_length) are padding. Ids are taken as distinct within a row (what the routers
            emit); repeats would raise the estimate.
        kv_length: keys the ids address.
    Returns:
        The estimate (one host read), or None when the routes hold no more than `tiles` full query
        tiles (then the exact statistics cost as little).
    """
    routes = token_ids.unsqueeze(1) if token_ids.dim() == 3 else token_ids
    batch, heads, queries, width = routes.shape
    full_tiles = queries // TILE
    if full_tiles <= tiles:
        return None
    device = routes.device
    picked = [round(i * (full_tiles - 1) / (tiles - 1)) for i in range(tiles)]
    rows = (
        torch.tensor(picked, device=device)[:, None] * TILE + torch.arange(TILE, device=device)
    ).flatten()
    ids = routes.index_select(2, rows).view(batch * heads, tiles, TILE * width)
    valid = (ids >= 0) & (ids < kv_length)
    key_tiles = -(-kv_length // TILE)
    cell = (torch.arange(batch * heads * tiles, device=device).view(-1, tiles, 1)) * key_tiles
    flat = torch.where(valid, cell + ids.div(TILE, rounding_mode="floor"), -1).flatten()
    pairs = torch.bincount(flat + 1, minlength=batch * heads * tiles * key_tiles + 1)[1:]
    columns = (kv_length - torch.arange(key_tiles, device=device) * TILE).clamp(max=TILE)
    touched = (pairs.view(-1, key_tiles) > 0) * (columns * TILE)
    selected, area = torch.stack((pairs.sum(), touched.sum())).tolist()  # one host read
    return selected / area if area else 1.0
