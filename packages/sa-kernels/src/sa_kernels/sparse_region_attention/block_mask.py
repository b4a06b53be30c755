"""`build_region_block_mask`: canonical region routes and, for Flex, their 128×128 tile structure.

Tiles are 128×128 (query tile × key tile) of one (batch, KV group). A tile is *touched* when some
query of the query tile selects a region with a key in the key tile that some query of the tile
can see causally. A touched tile is *full* when it lies wholly below the causal line (its last key
precedes its first query) and every one of its (query, key) pairs is selected; Flex skips the
mask_mod there. Every other touched tile is *partial*: the mask_mod reads the key's region
(`token_regions`, derived from `region_sources`), then that region's bit in the query's packed
region bitmap (`pack_region_bitmap`, one word per 32 regions), and applies causality.

The tile structure is two small products, never a [queries, kv_length] mask: `selections`
[batch, groups, query_tiles, regions] (how many queries of each query tile select each region)
times `incidence` [batch, regions, key_tiles] (how many keys of each region fall in each key tile)
gives the selected pairs of every tile (regions being disjoint). Memory: the bitmap is
queries · regions / 8 bytes per group; the products are O(query_tiles · regions + regions ·
key_tiles) per batch row and group.
"""

import numbers
from dataclasses import dataclass

import torch

from sa_kernels.region_bitmap import MAX_TRITON_SLOTS, pack_region_bitmap
from sa_kernels.sparse_gqa.block_mask import (
    FLEX_MIN_OCCUPANCY,
    TILE,
    _tile_area,
    tiles_block_mask,
)
from sa_kernels.sparse_gqa.routes import canonical_routes

__all__ = [
    "FLEX_MIN_OCCUPANCY",
    "TILE",
    "RegionBlockMask",
    "RegionTileStatistics",
    "build_region_block_mask",
]

# Route entries binned per step of the selection counts (bounds the int64 temporaries).
_BIN_CHUNK = 1 << 25


@dataclass(frozen=True)
class RegionTileStatistics:
    """Host counts of the 128×128 tiles the selected regions touch, over all (batch, KV group).

    selected_pairs counts the keys of every selected region, the current region's keys after the
    query included (at most region_size − 1 per query): a heuristic's numerator, not an exact count.
    """

    touched_tiles: int
    full_tiles: int
    touched_area: int
    selected_pairs: int

    @property
    def occupancy(self) -> float:
        """Selected pairs / area of the touched tiles (1.0: regions filling whole tiles)."""
        return min(1.0, self.selected_pairs / self.touched_area) if self.touched_area else 1.0


@dataclass(frozen=True)
class RegionBlockMask:
    """Canonical region routes plus, when built, the Flex BlockMask; pass it to
    `sparse_region_attention(block_mask=...)` to reuse it (e.g. in the recompute).

    routes: int32 [batch, groups, queries, slots], per row its `counts` distinct valid region ids
        ascending, then the sentinel `region_count`.
    counts: int32 [batch, groups, queries], distinct valid region ids per row.
    region_count: regions N (region_sources.shape[1]); also the sentinel.
    kv_length, query_heads, query_start: the geometry the mask was built for.
    flex: the FlexAttention `BlockMask` ([batch, query_heads or 1, queries, kv_length]) or None.
    statistics: the tile counts when the build computed them (Flex or the auto heuristic).
    """

    routes: torch.Tensor
    counts: torch.Tensor
    region_count: int
    kv_length: int
    query_heads: int
    query_start: int
    flex: object | None = None
    statistics: RegionTileStatistics | None = None

    @property
    def occupancy(self) -> float | None:
        return None if self.statistics is None else self.statistics.occupancy


def token_regions(region_sources: torch.Tensor, kv_length: int) -> torch.Tensor:
    """int32 [batch, kv_length]: the region of every key row, -1 where none lists it."""
    batch, regions, size = region_sources.shape
    sources = region_sources.long()
    valid = (sources >= 0) & (sources < kv_length)
    owner = torch.full((batch, kv_length + 1), -1, dtype=torch.int32, device=sources.device)
    region = torch.arange(regions, dtype=torch.int32, device=sources.device).view(1, -1, 1)
    owner.scatter_(
        1,
        torch.where(valid, sources, kv_length).view(batch, -1),
        region.expand(batch, regions, size).reshape(batch, -1),
    )
    return owner[:, :kv_length].contiguous()


def _selection_counts(routes: torch.Tensor, regions: int) -> torch.Tensor:
    """float32 [batch, groups, query_tiles, regions]: queries of each query tile selecting each region."""
    batch, groups, queries, width = routes.shape
    q_tiles = -(-queries // TILE)
    counts = torch.zeros(batch * groups, q_tiles * (regions + 1), device=routes.device)
    rows_per_step = max(1, _BIN_CHUNK // max(1, batch * groups * width))
    for start in range(0, queries, rows_per_step):
        stop = min(start + rows_per_step, queries)
        ids = routes[:, :, start:stop].reshape(batch * groups, -1, width).long()  # sentinel: N
        q_tile = (torch.arange(start, stop, device=routes.device) // TILE).view(1, -1, 1)
        flat = (q_tile * (regions + 1) + ids).reshape(batch * groups, -1)
        counts.scatter_add_(1, flat, torch.ones(flat.shape, device=routes.device))
    return counts.view(batch, groups, q_tiles, regions + 1)[..., :regions]


def _incidence(region_sources: torch.Tensor, kv_length: int) -> torch.Tensor:
    """float32 [batch, regions, key_tiles]: keys of each region in each key tile."""
    batch, regions, _ = region_sources.shape
    kv_tiles = -(-kv_length // TILE)
    sources = region_sources.long()
    valid = (sources >= 0) & (sources < kv_length)
    tiles = torch.where(valid, sources // TILE, kv_tiles)
    incidence = torch.zeros(batch, regions, kv_tiles + 1, device=sources.device)
    incidence.scatter_add_(2, tiles, torch.ones(tiles.shape, device=sources.device))
    return incidence[..., :kv_tiles]


def region_tiles(
    routes: torch.Tensor,
    region_sources: torch.Tensor,
    kv_length: int,
    query_start: int,
) -> tuple[torch.Tensor, torch.Tensor, RegionTileStatistics]:
    """Full and partial tiles (bool [batch, groups, query_tiles, key_tiles]) and their host counts
    (one host sync)."""
    queries = routes.shape[2]
    regions = region_sources.shape[1]
    device = routes.device
    # Exact integer sums in FP32 (products of counts <= 128, sums <= 128 · 128), TF32 included.
    pairs = _selection_counts(routes, regions) @ _incidence(region_sources, kv_length).unsqueeze(1)
    q_first = query_start + torch.arange(0, queries, TILE, device=device)
    q_last = query_start + (torch.arange(0, queries, TILE, device=device) + TILE - 1).clamp(
        max=queries - 1
    )
    k_first = torch.arange(0, kv_length, TILE, device=device)
    k_last = (k_first + TILE - 1).clamp(max=kv_length - 1)
    visible = k_first[None, :] <= q_last[:, None]  # some pair of the tile is causally visible
    below = k_last[None, :] <= q_first[:, None]  # every pair of the tile is causally visible
    area = _tile_area(queries, kv_length, device)
    touched = (pairs > 0) & visible
    full = touched & below & (pairs == area)
    counts = [touched.sum(), full.sum(), (area * touched).sum(), pairs.sum(dtype=torch.float64)]
    stats = torch.stack([c.to(torch.float64) for c in counts]).tolist()  # one host sync
    return full, touched & ~full, RegionTileStatistics(*(round(x) for x in stats))


def region_mask_mod(owners: torch.Tensor, bitmap: torch.Tensor, query_heads: int, query_start: int):
    """Flex `mask_mod`: key kv is visible to (b, h, q) iff its region's bit is set in the bitmap row
    of (b, h's group, q) and kv <= query_start + q. owners: int32 [batch, kv_length] (-1: no
    region); bitmap: int32 [batch, groups, queries, words]. int64 flat offsets."""
    _, groups, queries, words = bitmap.shape
    kv_length = owners.shape[1]
    hpg = query_heads // groups
    flat_owners = owners.reshape(-1)
    flat_bits = bitmap.reshape(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        b64 = b.to(torch.int64)
        region = flat_owners[b64 * kv_length + kv_idx].to(torch.int64)
        safe = torch.where(region >= 0, region, 0)
        row = (b64 * groups + h // hpg) * queries + q_idx
        bit = (flat_bits[row * words + safe // 32] >> (safe % 32)) & 1
        return (region >= 0) & (bit == 1) & (kv_idx <= q_idx + query_start)

    return mask_mod


def build_region_block_mask(
    region_ids: torch.Tensor,
    region_sources: torch.Tensor,
    kv_length: int,
    query_heads: int,
    *,
    query_start: int = 0,
    build_flex: bool | None = True,
) -> RegionBlockMask:
    """Canonicalise the region routes once and, for Flex, build their 128×128 BlockMask.

    Args:
        region_ids: int32/int64 [batch, groups, queries, slots]; ids outside [0, regions) are
            unused, repeats count once, any order.
        region_sources: int32 [batch, regions, region_size], key rows, -1 where none.
        kv_length: number of keys.
        query_heads: heads of the attention that will use the mask (a multiple of groups).
        query_start: global row of query 0 (causality).
        build_flex: True builds the Flex BlockMask; False only the canonical routes (what gather
            needs; no tile products, one host sync for the canonical check); None computes the
            tile statistics and builds the Flex mask when the occupancy reaches
            FLEX_MIN_OCCUPANCY.
    Returns:
        RegionBlockMask, reusable across calls for the same routes and geometry.
    Raises:
        TypeError: region_ids not an int32/int64 tensor, region_sources not an int32 tensor,
            kv_length, query_heads or query_start not an int, build_flex not None/True/False.
        ValueError: region_ids not [batch, groups, queries, slots >= 1], region_sources not
            [batch, regions >= 1, region_size >= 1], tensors on two devices, kv_length outside
            [1, 2**31 - 1), query_heads not a positive multiple of groups, query_start outside
            [0, kv_length - queries].
    """
    _check_mask_inputs(region_ids, region_sources, kv_length, query_heads, query_start, build_flex)
    regions = region_sources.shape[1]
    routes, counts = canonical_routes(region_ids, regions)
    geometry = (regions, kv_length, query_heads, query_start)
    if build_flex is False:
        return RegionBlockMask(routes, counts, *geometry)
    full, partial, statistics = region_tiles(routes, region_sources, kv_length, query_start)
    if not (build_flex or statistics.occupancy >= FLEX_MIN_OCCUPANCY):
        return RegionBlockMask(routes, counts, *geometry, statistics=statistics)

    bitmap = pack_region_bitmap(
        routes,
        regions,
        backend="auto" if routes.shape[-1] <= MAX_TRITON_SLOTS else "reference",
    )
    mask_mod = region_mask_mod(
        token_regions(region_sources, kv_length), bitmap, query_heads, query_start
    )
    flex = tiles_block_mask(partial, full, mask_mod, query_heads, (routes.shape[2], kv_length))
    return RegionBlockMask(routes, counts, *geometry, flex=flex, statistics=statistics)


def _check_mask_inputs(region_ids, region_sources, kv_length, query_heads, query_start, build_flex):
    fn = "build_region_block_mask"
    for name, t, dtypes in (
        ("region_ids", region_ids, (torch.int32, torch.int64)),
        ("region_sources", region_sources, (torch.int32,)),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{fn}: {name} must be an {names} tensor; got {got}")
    for name, value in (
        ("kv_length", kv_length),
        ("query_heads", query_heads),
        ("query_start", query_start),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{fn}: {name} must be an int; got {value!r}")
    if build_flex not in (None, True, False):
        raise TypeError(f"{fn}: build_flex must be None, True or False; got {build_flex!r}")
    if region_ids.dim() != 4 or min(region_ids.shape) < 1:
        raise ValueError(
            f"{fn}: region_ids must be [batch, groups, queries, slots], no dim empty; got "
            f"{tuple(region_ids.shape)}"
        )
    batch, groups, queries, _ = region_ids.shape
    if (
        region_sources.dim() != 3
        or region_sources.shape[0] != batch
        or min(region_sources.shape) < 1
    ):
        raise ValueError(
            f"{fn}: region_sources must be [batch={batch}, regions >= 1, region_size >= 1]; got "
            f"{tuple(region_sources.shape)}"
        )
    if region_ids.device != region_sources.device:
        raise ValueError(
            f"{fn}: region_ids and region_sources must be on one device; got "
            f"{region_ids.device} and {region_sources.device}"
        )
    if not 1 <= kv_length < 2**31 - 1:
        raise ValueError(f"{fn}: kv_length must be in [1, 2**31 - 1); got {kv_length}")
    if query_heads < 1 or query_heads % groups:
        raise ValueError(
            f"{fn}: query_heads must be a positive multiple of the groups ({groups}); got "
            f"{query_heads}"
        )
    if not 0 <= query_start <= kv_length - queries:
        raise ValueError(
            f"{fn}: query_start must be in [0, kv_length - queries] = [0, {kv_length - queries}]; "
            f"got {query_start}"
        )
