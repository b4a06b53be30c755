"""`build_route_block_mask`: route membership as a FlexAttention `BlockMask`, built once per routes.

Tiles are 128×128 (query tile × key tile). A tile whose every (query, key) pair is selected is *full*
(Flex skips the mask there); a tile with some pairs is *partial*. Two kinds of `mask_mod`:
- *causal*: when every partial tile is exactly the causal cut (key ≤ query position) of its tile, the
  common shape of routes made of whole tiles plus the query's own diagonal tile, the mask_mod is
  `q + offset >= kv`: arithmetic only, the same kernel a block-aligned causal Flex mask compiles to;
- *bitmap* otherwise: each partial tile gets a 128×128 bitmap (2 KiB) and the `mask_mod` reads one
  bit (a slot table lookup, then one word; int64 flat offsets). Those per-element loads cost: on the
  H200 they make clustered routes 0.74× a block-aligned causal mask at 32k, D 128
  (docs/results/sparse_gqa_clustered.json).
Memory is O(partial tiles), never a dense [queries, kv_length] bool mask. The tile counts also give the
*occupancy* (selected pairs / area of the touched tiles). The gather path needs only the canonical
routes: build with `build_flex=False` when Flex will not run.
"""

import numbers
from dataclasses import dataclass, field

import torch

from .routes import canonical_routes

TILE = 128
# build_flex=None builds the Flex mask, and backend="auto" runs Flex on CUDA, when at least this fraction
# of the touched tiles' area is selected: the gather kernel's cost follows the selected pairs, Flex's the
# touched tiles, so Flex wastes at most half its tile math here (a heuristic; bench_sparse_gqa.py
# measures both backends on clustered (occupancy > 0.9) and scattered (< 0.3) routes).
FLEX_MIN_OCCUPANCY = 0.5
# Route entries binned per step of the tile count (bounds the int64 temporaries).
_BIN_CHUNK = 1 << 25


@dataclass(frozen=True)
class TileStatistics:
    """Host counts of the 128×128 tiles a route set touches (reading them costs one host sync)."""

    touched_tiles: int
    touched_area: int
    selected_pairs: int
    partial_tiles: int
    # q + causal_offset is every query row's position in key coordinates when each partial tile is the
    # exact causal cut of its tile (the cheap `mask_mod`); None when some partial tile is not.
    causal_offset: int | None = None

    @property
    def occupancy(self) -> float:
        """Selected pairs / area of the touched tiles (1.0: block-aligned routes)."""
        return self.selected_pairs / self.touched_area if self.touched_area else 1.0


@dataclass(frozen=True)
class RouteBlockMask:
    """Canonical routes plus their tile structure; pass it to `sparse_gqa_attention(block_mask=...)`.

    routes: int32 [batch, route_heads, queries, W] (`routes.canonical_routes`): per row its
        `counts` distinct valid ids ascending, then the sentinel `kv_length`.
    counts: int32 [batch, route_heads, queries], distinct valid ids per row.
    kv_length: number of keys the routes address.
    query_heads: query heads the Flex mask addresses (route head = query head // group).
    flex: the FlexAttention `BlockMask` ([batch, query_heads or 1, queries, kv_length]), or None
        when it was not built.
    statistics: the tile counts when the build needed them (Flex); None for a gather-only mask,
        whose build skips the tile binning and its host sync.
    cache: per-backend layouts derived from the tiles once (FA4's block lists).
    """

    routes: torch.Tensor
    counts: torch.Tensor
    kv_length: int
    query_heads: int
    flex: object | None = None
    statistics: TileStatistics | None = None
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    def tile_statistics(self) -> TileStatistics:
        """The tile counts: the build's, or computed now from the routes (one host sync)."""
        if self.statistics is not None:
            return self.statistics
        return _tile_masks(self.routes, self.kv_length)[2]

    @property
    def occupancy(self) -> float:
        """Selected pairs / area of the 128×128 tiles they touch (1.0: block-aligned routes)."""
        return self.tile_statistics().occupancy

    @property
    def touched_tiles(self) -> int:
        """Tiles holding at least one pair, over all (batch, route head)."""
        return self.tile_statistics().touched_tiles

    @property
    def route_heads(self) -> int:
        return self.routes.shape[1]

    @property
    def queries(self) -> int:
        return self.routes.shape[2]


def tile_pair_counts(routes: torch.Tensor, kv_length: int) -> torch.Tensor:
    """int64 [batch, route_heads, query_tiles, kv_tiles]: selected (query, key) pairs per tile."""
    batch, route_heads, queries, width = routes.shape
    q_tiles = -(-queries // TILE)
    kv_tiles = -(-kv_length // TILE)
    bins = torch.zeros(
        batch * route_heads * q_tiles * kv_tiles + 1, dtype=torch.int64, device=routes.device
    )
    rows_per_step = max(1, _BIN_CHUNK // max(1, batch * route_heads * width))
    row_heads = torch.arange(batch * route_heads, device=routes.device).view(-1, 1, 1)
    for start in range(0, queries, rows_per_step):
        stop = min(start + rows_per_step, queries)
        ids = routes[:, :, start:stop].reshape(batch * route_heads, stop - start, width).long()
        q_tile = (torch.arange(start, stop, device=routes.device) // TILE).view(1, -1, 1)
        flat = (row_heads * q_tiles + q_tile) * kv_tiles + ids // TILE
        flat = torch.where(ids < kv_length, flat, bins.numel() - 1)
        bins += torch.bincount(flat.reshape(-1), minlength=bins.numel())
    return bins[:-1].view(batch, route_heads, q_tiles, kv_tiles)


def _tile_area(queries: int, kv_length: int, device: torch.device) -> torch.Tensor:
    q_rows = (queries - torch.arange(0, queries, TILE, device=device)).clamp(max=TILE)
    kv_cols = (kv_length - torch.arange(0, kv_length, TILE, device=device)).clamp(max=TILE)
    return q_rows[:, None] * kv_cols[None, :]


def _blocks_first(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block lists (Flex's and FA4's layout): per row of `selected` (bool [..., rows, columns]), the
    count and the ascending column indices of its True entries, then the others."""
    num = selected.sum(dim=-1, dtype=torch.int32)
    order = torch.sort((~selected).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num.contiguous(), order.contiguous()


def tiles_block_mask(
    partial: torch.Tensor,
    full: torch.Tensor,
    mask_mod,
    query_heads: int,
    seq_lengths: tuple[int, int],
):
    """The Flex `BlockMask` of 128×128 tiles: `partial` and `full` bool [batch, route_heads,
    query_tiles, key_tiles] (`mask_mod` runs on the partial ones), each route head's lists repeated
    for its query_heads // route_heads query heads; `seq_lengths` (queries, kv_length)."""
    from torch.nn.attention.flex_attention import BlockMask

    lists = (*_blocks_first(partial), *_blocks_first(full))
    route_heads = partial.shape[1]
    if route_heads > 1:
        lists = (t.repeat_interleave(query_heads // route_heads, dim=1) for t in lists)
    return BlockMask.from_kv_blocks(
        *lists, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=seq_lengths
    )


WORDS_PER_TILE = TILE * TILE // 32
_FULL = -2  # slot-table value of a full tile (untouched: −1, partial: its bitmap slot)


def partial_tile_bitmaps(
    routes: torch.Tensor, kv_length: int, slots: torch.Tensor, partial: int
) -> torch.Tensor:
    """int32 [capacity · 512] (capacity: partial tiles rounded up to a power of two): bit (r, c) of
    partial tile t's bitmap (word t·512 + r·4 + c // 32, bit c % 32) is set iff query row r of the
    tile selects key column c."""
    batch, route_heads, queries, width = routes.shape
    q_tiles, kv_tiles = slots.shape[-2:]
    # Capacity rounded up to a power of two: new routes of one geometry reuse the compiled Flex
    # kernels (a captured buffer of a new length would recompile them).
    capacity = 1 << max(0, partial - 1).bit_length()
    words = torch.zeros(capacity * WORDS_PER_TILE + 1, dtype=torch.int64, device=routes.device)
    if partial == 0:
        return words[:-1].to(torch.int32)
    flat_slots = slots.reshape(-1).long()
    rows_per_step = max(1, _BIN_CHUNK // max(1, batch * route_heads * width))
    row_heads = torch.arange(batch * route_heads, device=routes.device).view(-1, 1, 1)
    for start in range(0, queries, rows_per_step):
        stop = min(start + rows_per_step, queries)
        ids = routes[:, :, start:stop].reshape(batch * route_heads, stop - start, width).long()
        q = torch.arange(start, stop, device=routes.device).view(1, -1, 1)
        valid = ids < kv_length
        cols = torch.where(valid, ids, 0)
        slot = flat_slots[(row_heads * q_tiles + q // TILE) * kv_tiles + cols // TILE]
        word = (slot * TILE + q % TILE) * (TILE // 32) + (cols % TILE) // 32
        word = torch.where(valid & (slot >= 0), word, words.numel() - 1)
        words.scatter_add_(0, word.reshape(-1), (1 << (cols % 32)).reshape(-1))
    words = words[:-1]  # distinct pairs set distinct bits: the sums are bitwise ORs below 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def route_mask_mod(slots: torch.Tensor, bits: torch.Tensor, query_heads: int):
    """Flex `mask_mod`: key kv is visible to (b, h, q) iff its tile is full, or partial with the bit set."""
    _, route_heads, q_tiles, kv_tiles = slots.shape
    group = query_heads // route_heads
    flat_slots = slots.reshape(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        head = h // group if route_heads > 1 else h * 0
        tile = ((b.to(torch.int64) * route_heads + head) * q_tiles + q_idx // TILE) * kv_tiles
        slot = flat_slots[tile + kv_idx // TILE].to(torch.int64)
        word = (torch.where(slot >= 0, slot, 0) * TILE + q_idx % TILE) * (TILE // 32)
        bit = (bits[word + (kv_idx % TILE) // 32] >> (kv_idx % 32)) & 1
        return (slot == _FULL) | ((slot >= 0) & (bit == 1))

    return mask_mod


def build_route_block_mask(
    token_ids: torch.Tensor,
    kv_length: int,
    query_heads: int,
    *,
    build_flex: bool | None = True,
) -> RouteBlockMask:
    """Canonicalise routes once and build their 128×128 FlexAttention `BlockMask`.

    Args:
        token_ids: integer [batch, queries, W] (one route for every KV group) or
            [batch, kv_heads, queries, W] (one per KV group); global key ids, ids outside
            [0, kv_length) (−1 by convention) are padding, repeats count once.
        kv_length: number of keys (S_kv).
        query_heads: query heads of the attention that will use the mask (a multiple of kv_heads).
        build_flex: also build the Flex `BlockMask` (needs torch's flex_attention module); False
            keeps only the canonical routes (what the gather kernel needs: no tile binning, no
            host sync beyond canonicalisation); None builds it only when the occupancy reaches
            FLEX_MIN_OCCUPANCY.
    Returns:
        RouteBlockMask, reusable across layers and in recompute for the same routes and geometry.
    Raises:
        TypeError: token_ids is not an integer tensor; kv_length or query_heads not an int;
            build_flex not None/True/False.
        ValueError: token_ids is not 3-D or 4-D or has an empty dim, kv_length outside
            [1, 2**31 - 1), or query_heads is not a positive multiple of the route heads.
    """
    fn = "build_route_block_mask"
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int32, torch.int64):
        got = token_ids.dtype if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise TypeError(f"{fn}: token_ids must be an int32 or int64 tensor; got {got}")
    if token_ids.dim() not in (3, 4):
        raise ValueError(
            f"{fn}: token_ids must be [batch, queries, W] or [batch, kv_heads, queries, W]; "
            f"got shape {tuple(token_ids.shape)}"
        )
    if token_ids.numel() == 0:
        raise ValueError(
            f"{fn}: token_ids must not be empty (batch, queries and W >= 1); got shape "
            f"{tuple(token_ids.shape)}"
        )
    for name, value in (("kv_length", kv_length), ("query_heads", query_heads)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{fn}: {name} must be an int; got {value!r}")
    kv_length, query_heads = int(kv_length), int(query_heads)
    if not 1 <= kv_length < 2**31 - 1:  # ids and the sentinel kv_length are int32
        raise ValueError(f"{fn}: kv_length must be in [1, 2**31 - 1); got {kv_length}")
    if build_flex not in (None, True, False):
        raise TypeError(f"{fn}: build_flex must be None, True or False; got {build_flex!r}")
    routes4 = token_ids.unsqueeze(1) if token_ids.dim() == 3 else token_ids
    route_heads = routes4.shape[1]
    if query_heads < 1 or query_heads % route_heads:
        raise ValueError(
            f"{fn}: query_heads must be a positive multiple of the route heads ({route_heads}); "
            f"got {query_heads}"
        )
    routes, counts = canonical_routes(routes4, kv_length)
    if build_flex is False:
        return RouteBlockMask(routes, counts, kv_length, query_heads)
    full, partial, statistics = _tile_masks(routes, kv_length)
    flex = None
    if build_flex or statistics.occupancy >= FLEX_MIN_OCCUPANCY:
        if statistics.causal_offset is not None:
            mask_mod = causal_mask_mod(statistics.causal_offset)
        else:
            slots = torch.where(full, _FULL, -1).to(torch.int32)
            order = torch.cumsum(partial.reshape(-1), 0, dtype=torch.int32).view_as(slots) - 1
            slots = torch.where(partial, order, slots)
            bits = partial_tile_bitmaps(routes, kv_length, slots, statistics.partial_tiles)
            mask_mod = route_mask_mod(slots, bits, query_heads)
        flex = tiles_block_mask(partial, full, mask_mod, query_heads, (routes.shape[2], kv_length))
    return RouteBlockMask(routes, counts, kv_length, query_heads, flex, statistics)


def causal_mask_mod(offset: int):
    """Flex `mask_mod` for partial tiles that are exact causal cuts: query row q sits at key q + offset.

    The offset is a Python int, so the compiled kernel is specialised on it (what the timed kernel was);
    it is kv_length − queries, fixed by the shapes Flex already specialises on, or a context-parallel
    rank's fixed shard start."""

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    return mask_mod


def _causal_offset(routes: torch.Tensor, kv_length: int) -> torch.Tensor:
    """0-d int64: max over non-empty rows of (largest selected id − row index). Every selected pair then
    has key ≤ row + offset; rows that select their own position pin it. (The largest valid id, not
    the last counted slot: the result does not rest on the routes being canonical.)"""
    queries = routes.shape[2]
    largest = torch.where(routes < kv_length, routes, -1).amax(-1).long()
    lead = largest - torch.arange(queries, device=routes.device)
    return torch.where(largest >= 0, lead, -queries).amax()


def _causal_tile_area(queries: int, kv_length: int, offset: torch.Tensor) -> torch.Tensor:
    """int64 [query_tiles, kv_tiles]: pairs (q, kv) of each tile with kv <= q + offset (offset 0-d)."""
    device = offset.device
    r0 = torch.arange(0, queries, TILE, device=device)[:, None]
    c0 = torch.arange(0, kv_length, TILE, device=device)[None, :]
    rows = (queries - r0).clamp(max=TILE)
    width = (kv_length - c0).clamp(max=TILE)

    def below(x):  # Σ_{0 <= j < x} min(j, width): the row counts clamp(a + i, 0, width) summed
        x = x.clamp(min=0)
        ramp = x * (x - 1) // 2
        flat = width * (width + 1) // 2 + (x - width - 1) * width
        return torch.where(x <= width + 1, ramp, flat)

    first = r0 + offset + 1 - c0  # keys the tile's first row sees in this tile, before clamping
    return below(first + rows) - below(first)


def _tile_masks(
    routes: torch.Tensor, kv_length: int
) -> tuple[torch.Tensor, torch.Tensor, TileStatistics]:
    """Full and partial tiles (bool [batch, route_heads, query_tiles, kv_tiles]) and their counts."""
    pairs = tile_pair_counts(routes, kv_length)
    queries = routes.shape[2]
    area = _tile_area(queries, kv_length, routes.device)
    touched = pairs > 0
    full = pairs == area
    partial = touched & ~full
    # Every selected pair lies at or below the causal line of `offset`, so a partial tile holding
    # as many pairs as that line admits holds exactly them.
    offset = _causal_offset(routes, kv_length)
    not_causal = (partial & (pairs != _causal_tile_area(queries, kv_length, offset))).sum()
    stats = torch.stack(
        [touched.sum(), (area * touched).sum(), pairs.sum(), partial.sum(), not_causal, offset]
    ).tolist()  # one host sync
    causal_offset = stats[5] if stats[4] == 0 else None
    return full, partial, TileStatistics(*stats[:4], causal_offset=causal_offset)
