"""Fast region selection: walk the score tiles, score with `indexer_score_tile`, keep a running top-k.

`torch.topk` orders ties arbitrarily, so ties are made explicit: every top-k call here sees keys
whose winners are distinct, and the selected set is exactly (score descending, region id ascending).
The "threshold" method is `sa_kernels.stable_topk` on the running candidates, whose ids ascend with
their position (kept ids come back ascending and precede the next chunk's regions). The oracle,
`reference.py`, scores every region and sorts.
"""

import weakref
from collections.abc import Callable

import torch

from sa_kernels import indexer_score_tile, stable_topk
from sa_kernels.stable_topk import stable_topk_workspace_bytes

from ..layouts import RegionMetadata, ScoreTile
from ..tile_rows import write_tile_rows

_LOW = 2**32
_ID_FLIP = 2**31 - 1
_MASKED = torch.iinfo(torch.int64).min
METHODS = ("threshold", "composite")
MERGE_WIDTH_GROWTH = 1.25
"""How much wider than its first score tile a merged call may grow (`_merge_tiles`). At 65 536
tokens in one document the calls score 1.205x the causal work unbounded, 1.094x at 1.25. On the
H200 the forward's time did not change (the smaller calls run the scoring kernel less efficiently),
and its peak extra memory went from 1.72 to 1.48 GiB (1.78 to 1.55 at 131 072 tokens)."""
PROJECT_ROWS = 16384
"""Query rows `select_regions_tiled` asks `tile_inputs` for at most per call (unless one scoring call
is longer): adjacent scoring calls share one projection (fewer, larger launches). A projection ends
where a scoring call ends, so no row is projected twice (ending at a fixed row count re-projected
26 % of the rows at 131 072 tokens)."""
SCORE_ROW_ALIGN = 16
"""Score rows are allocated with a stride that is a multiple of this many entries, so that
`stable_topk`'s loads are vector ones (Triton specialises strides divisible by 16; the scoring
kernels do not specialise theirs). On the H200 the top-k of 4096 rows of 8200 entries took 1.35x
the time of 8192-entry rows."""

Plan = tuple[
    list[ScoreTile],
    list[tuple[int, int, int, list[ScoreTile]]],
    dict[ScoreTile, tuple[torch.Tensor, torch.Tensor] | None],
]
"""A host plan of `select_regions_marked`: the merged scoring calls, their projection spans and
each call's candidate bounds relative to its first region (method "threshold", else None)."""
_HOST_PLANS: dict[int, dict[tuple, Plan]] = {}
"""The plans of every live `RegionMetadata`, keyed by its identity (the metadata itself stays
immutable) and dropped when it is collected."""


def host_plans(metadata: RegionMetadata) -> dict[tuple, Plan]:
    """The memoised host plans of `metadata`, by selection options: every layer of a forward shares
    one metadata, so the plans are made once per forward (empty until a selection runs)."""
    key = id(metadata)
    plans = _HOST_PLANS.get(key)
    if plans is None:
        plans = _HOST_PLANS[key] = {}
        weakref.finalize(metadata, _HOST_PLANS.pop, key, None)
    return plans


def select_regions(
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    metadata: RegionMetadata,
    *,
    region_chunk: int = 16384,
    score_budget_bytes: int = 2**30,
    method: str = "threshold",
    backend: str = "auto",
) -> torch.Tensor:
    """Region ids of every (batch, provider group, query): int32 [B, G, Q, topk + 1], ascending.

    Dense queries take `metadata.dense_region_ids`; sparse queries keep their `topk` best candidates
    (same document, before their own region) by (score descending, id ascending) plus their current
    region; padding queries select nothing. Unused slots hold `metadata.region_count`.

    Args:
        query: [B, Q, G, H, D] BF16, E4M3-rounded indexer queries of the shard's queries.
        weights: [B, Q, G, H] FP32 signed head weights.
        summary: [B, N, D] BF16 E4M3-rounded summaries, N = `metadata.region_count`; only the rows in
            `metadata.summary_ranges` are read.
        metadata: `region_metadata(...)` of this forward and shard.
        region_chunk: regions scored per call; with `score_budget_bytes` it bounds the temporaries.
        score_budget_bytes: adjacent tiles of one batch row are scored in one call while its
            temporaries fit in this many bytes (`score_call_bytes`: 4 per score with "threshold"
            on the GPU and one region chunk, 20 with "composite"); fewer, larger calls cost less
            host time. The ids do not depend on it.
        method: how ties are made deterministic (both give the same ids): "threshold"
            (`sa_kernels.stable_topk` on the running candidates, whose ids ascend: a Triton radix
            select on CUDA, two PyTorch top-k passes otherwise) or "composite" (one int64 top-k over
            `(order-preserving score bits << 32) | (2**31 - 1 - id)`).
        backend: the backend of `indexer_score_tile` and of writing the kept ids ("auto": Triton on
            CUDA).
    Raises:
        ValueError: shapes disagree with each other or with `metadata`; unknown `method`;
            `region_chunk < 1`.
    """
    _check(query, weights, summary, metadata)

    def tile_inputs(b: int, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor]:
        return query[b : b + 1, q0:q1], weights[b : b + 1, q0:q1]

    return select_regions_tiled(
        tile_inputs,
        query.shape[2],
        summary,
        metadata,
        region_chunk=region_chunk,
        score_budget_bytes=score_budget_bytes,
        method=method,
        backend=backend,
    )


def select_regions_tiled(
    tile_inputs: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]],
    groups: int,
    summary: torch.Tensor,
    metadata: RegionMetadata,
    *,
    region_chunk: int = 16384,
    score_budget_bytes: int = 2**30,
    project_rows: int = PROJECT_ROWS,
    method: str = "threshold",
    backend: str = "auto",
) -> torch.Tensor:
    """`select_regions` with queries produced on demand: `tile_inputs(b, q0, q1)` returns the query
    `[1, q1 - q0, G, H, D]` and weights `[1, q1 - q0, G, H]` of rows `[q0, q1)` of batch row b. It
    is asked only for rows that are scored, each row once, in spans of adjacent scoring calls of
    at most `project_rows` rows (or one longer call). On CUDA the projection's GEMM may depend on the
    span's row count, so scores (and ids, at FP32 near-ties) can change in the last bits with
    `project_rows` and with `score_budget_bytes` (spans end where merged calls end).

    Args: `tile_inputs`, then `groups` (G), `summary` and `metadata` as `select_regions`;
    `project_rows` as above; the other options as `select_regions`.
    Returns: as `select_regions`.
    Raises: as `select_regions`; `project_rows < 1`.
    """
    return select_regions_marked(
        tile_inputs,
        groups,
        summary,
        metadata,
        no_mark,
        region_chunk=region_chunk,
        score_budget_bytes=score_budget_bytes,
        project_rows=project_rows,
        method=method,
        backend=backend,
    )


def no_mark(stage: str) -> None:
    """The `mark` of an untimed selection: does nothing."""
    return None


def select_regions_marked(
    tile_inputs: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]],
    groups: int,
    summary: torch.Tensor,
    metadata: RegionMetadata,
    mark: Callable[[str], None],
    *,
    region_chunk: int = 16384,
    score_budget_bytes: int = 2**30,
    project_rows: int = PROJECT_ROWS,
    method: str = "threshold",
    backend: str = "auto",
) -> torch.Tensor:
    """`select_regions_tiled`, calling `mark(stage)` after each stage of the walk with the stage's
    name ("project_queries", "score", "topk", "merge"): internal, for the benchmark's per-stage
    timing (`Step5SparseIndexer._forward`)."""
    if method not in METHODS:
        raise ValueError(f"select_regions: method must be one of {METHODS}; got {method!r}")
    for name, value in (("region_chunk", region_chunk), ("project_rows", project_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"select_regions: {name} must be an int >= 1; got {value!r}")
    # The same for every layer of the forward, so planned once: the calls (about 1 ms of host time
    # at 131 072 tokens, during which the GPU would wait) and each call's candidate bounds relative
    # to its first region (two small kernels per call and layer otherwise). The metadata fixes the
    # device; its type picks the top-k path whose bytes the budget counts.
    plans = host_plans(metadata)
    plan_key = (groups, score_budget_bytes, project_rows, method, region_chunk, summary.device.type)
    plan = plans.get(plan_key)
    if plan is None:
        call_bytes = score_call_bytes(method, summary.device, region_chunk, metadata.topk)
        merged = _merge_tiles(metadata.score_tiles, groups, score_budget_bytes, call_bytes)
        bounds = {
            call: _first_chunk_bounds(metadata, call) if method == "threshold" else None
            for call in merged
        }
        plan = (merged, _projection_spans(merged, project_rows), bounds)
        plans[plan_key] = plan
    merged, spans, bounds = plan
    out = _dense_outside(metadata, groups, merged)
    for b, s0, s1, calls in spans:
        span_query, span_weights = tile_inputs(b, s0, s1)
        mark("project_queries")
        for tile in calls:
            _, q0, q1, _, _ = tile
            kept, offset = _tile_topk(
                span_query[:, q0 - s0 : q1 - s0],
                span_weights[:, q0 - s0 : q1 - s0],
                summary[b : b + 1],
                metadata,
                tile,
                region_chunk,
                method,
                backend,
                mark,
                out[b, :, q0:q1, : metadata.topk],
                bounds[tile],
            )
            if method == "composite" and kept is not None:
                kept = torch.sort(kept, dim=-1).values
            # a sparse row's kept ids ascend and are all below its current region: appending the
            # current region keeps them ascending, no sort needed (the call's other rows get their
            # dense ids in the same write)
            current, sparse = metadata.current[b, q0:q1], metadata.sparse_queries[b, q0:q1]
            dense, fill = metadata.dense_region_ids[b, q0:q1], metadata.region_count
            write_tile_rows(out, b, q0, kept, offset, current, sparse, dense, fill, backend=backend)
            mark("merge")
    return out


def _dense_outside(metadata: RegionMetadata, groups: int, calls: list[ScoreTile]) -> torch.Tensor:
    """The selection int32 [B, G, Q, topk + 1] with the dense ids (padded with `region_count`)
    written on the rows no scoring call covers, every row when `calls` is empty; `write_tile_rows`
    writes the others (writing every row dense first and then the sparse rows again cost 0.77 ms
    of a 131 072-token forward on the H200)."""
    dense, count = metadata.dense_region_ids, metadata.region_count
    batch, queries = dense.shape[:2]
    slots = metadata.topk + 1
    out = dense.new_empty(batch, groups, queries, slots)
    covered: dict[int, list[tuple[int, int]]] = {b: [] for b in range(batch)}
    for b, q0, q1, _, _ in calls:
        covered[b].append((q0, q1))
    for b, spans in covered.items():
        start = 0
        for q0, q1 in [*sorted(spans), (queries, queries)]:
            if start < q0:
                rows = torch.nn.functional.pad(
                    dense[b, start:q0], (0, slots - dense.shape[-1]), value=count
                )
                out[b, :, start:q0] = rows
            start = max(start, q1)
    return out


def _projection_spans(
    calls: list[ScoreTile], project_rows: int
) -> list[tuple[int, int, int, list[ScoreTile]]]:
    """`(batch, q0, q1, calls)`: runs of adjacent scoring calls of one batch row whose queries are
    projected together, at most `project_rows` rows unless a single call is longer."""
    spans: list[list] = []
    for call in calls:
        b, q0, q1, _, _ = call
        if spans and spans[-1][0] == b and spans[-1][2] == q0 and q1 - spans[-1][1] <= project_rows:
            spans[-1][2] = q1
            spans[-1][3].append(call)
        else:
            spans.append([b, q0, q1, [call]])
    return [(b, q0, q1, joined) for b, q0, q1, joined in spans]


def _first_chunk_bounds(
    metadata: RegionMetadata, call: ScoreTile
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate bounds `[first, current)` of a call's rows relative to its first region."""
    b, q0, q1, r0, _ = call
    rows = (slice(b, b + 1), slice(q0, q1))
    return metadata.query_first_region[rows] - r0, metadata.current[rows] - r0


def select_regions_dense(metadata: RegionMetadata, groups: int) -> torch.Tensor:
    """The selection when no query of the shard is sparse: `dense_region_ids` per group, [B, G, Q, topk + 1]."""
    return _dense_outside(metadata, groups, [])


def _tile_topk(
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    metadata: RegionMetadata,
    tile: ScoreTile,
    region_chunk: int,
    method: str,
    backend: str,
    mark: Callable[[str], None] = no_mark,
    out: torch.Tensor | None = None,
    first_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, int]:
    """Running top-k over region chunks of one tile: `(kept, offset)`, where `kept + offset` are the
    int64 [G, q1 - q0, topk] region ids, ascending for method "threshold" (`stable_topk` returns
    ascending positions and the candidates' ids ascend with their position), in any order for
    "composite". `offset` is the chunk's first region when `kept` holds its positions, else 0.
    `kept` is None where a one-chunk "threshold" tile's ids went straight into `out` (int32
    [G, q1 - q0, topk], the selection's rows), which saves writing and re-reading them as int64.
    `first_bounds`: `_first_chunk_bounds` of the tile, if the caller has them.

    query [1, q1 - q0, G, H, D], weights [1, q1 - q0, G, H] and summary [1, N, D] hold the tile's batch
    row. Ids of rows that are not sparse are meaningless (the caller discards them).
    """
    b, q0, q1, r0, r1 = tile
    topk = metadata.topk
    first = metadata.query_first_region[b : b + 1, q0:q1]
    current = metadata.current[b : b + 1, q0:q1]
    best_scores: torch.Tensor | None = None
    best_ids: torch.Tensor | None = None
    offset = 0
    for c0 in range(r0, r1, region_chunk):
        c1 = min(c0 + region_chunk, r1)
        # "threshold": the kernel writes -inf outside each query's candidates [first, current), so
        # no pass over the scores masks them (rows of non-sparse queries are discarded by the caller)
        bounds = None
        if method == "threshold":
            given = c0 == r0 and first_bounds is not None
            bounds = first_bounds if given else (first - c0, current - c0)
        padded = -(-(c1 - c0) // SCORE_ROW_ALIGN) * SCORE_ROW_ALIGN
        # float64 scores only where the reference scores float64 queries (the kernels refuse them)
        wide = query.dtype == torch.float64 and (backend == "reference" or not query.is_cuda)
        rows = query.new_empty(
            (1, query.shape[2], q1 - q0, padded), dtype=torch.float64 if wide else torch.float32
        )
        tile_scores = indexer_score_tile(
            query,
            weights,
            summary[:, c0:c1],
            0,
            q1 - q0,
            candidate_bounds=bounds,
            out=rows[..., : c1 - c0],
            backend=backend,
        )
        scores = tile_scores[0]
        one_chunk = method == "threshold" and best_scores is None and c1 == r1
        if one_chunk and out is not None and scores.shape[-1] > topk:
            # its positions + c0 are the ids, ascending: straight into the selection's rows. Past
            # each query's `past` bound the kernel wrote -inf, so the rows end there (`masked_tail`:
            # the top-k's Gluon kernels do not load the tail, the other paths ignore `lengths`):
            # the top-k took 2-3 % less time on the H200 at 64k and 128k tokens, whose calls'
            # rectangles hold 9 % and 4.5 % more entries than the rows
            lengths = None if bounds is None else bounds[1].expand(scores.shape[0], -1)
            mark("score")
            stable_topk(scores, topk, lengths=lengths, masked_tail=True, out=out, offset=c0)
            mark("topk")
            return None, 0
        region = torch.arange(c0, c1, device=scores.device)
        if method == "composite":
            sparse = metadata.sparse_queries[b, q0:q1].view(1, -1, 1)
            candidate = (
                sparse & (region >= first.view(1, -1, 1)) & (region < current.view(1, -1, 1))
            )
            keys = _composite_keys(scores, region, candidate)
            mark("score")
            if best_scores is not None:
                keys = torch.cat([best_scores, keys], dim=-1)
            if keys.shape[-1] > topk:
                keys = torch.topk(keys, topk, sorted=False).values
            best_scores = keys
            mark("topk")
            continue
        mark("score")
        ids = region  # 1-D, broadcast over (group, query) until a running state exists
        if best_scores is not None and best_ids is not None:
            scores = torch.cat([best_scores, scores], dim=-1)
            ids = torch.cat([best_ids, region.expand(*best_ids.shape[:2], -1)], dim=-1)
        if scores.shape[-1] <= topk:
            best_scores, best_ids = scores, ids.expand_as(scores)
            mark("topk")
            continue
        # ids ascend along the candidates (kept ids ascending, then this chunk's regions), so the
        # lowest position among tied scores is the lowest region id
        chosen = stable_topk(scores, topk)
        # 1-D ids are this chunk's regions, c0 + position; on the last chunk the positions are kept
        # and c0 is added when they are written, a later chunk needs the ids themselves
        if ids.dim() == 1 and c1 == r1:
            best_ids, offset = chosen, c0
        else:
            best_ids = chosen + c0 if ids.dim() == 1 else ids.gather(-1, chosen)
        best_scores = scores.gather(-1, chosen) if c1 < r1 else None
        mark("topk")
    if method == "composite":
        assert best_scores is not None
        best_ids = _ID_FLIP - (best_scores % _LOW)
    assert best_ids is not None
    if best_ids.shape[-1] < topk:  # a tile spanning fewer than topk regions holds no sparse query
        best_ids = torch.nn.functional.pad(
            best_ids, (0, topk - best_ids.shape[-1]), value=metadata.region_count
        )
    return best_ids, offset


def _composite_keys(
    scores: torch.Tensor, region: torch.Tensor, candidate: torch.Tensor
) -> torch.Tensor:
    """int64 keys ordered by (score, -region id); non-candidates get the smallest int64."""
    scores = torch.where(scores == 0, 0.0, scores)  # -0.0 ties with +0.0
    bits = scores.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    keys = ordered * _LOW + (_ID_FLIP - region)
    return torch.where(candidate, keys, _MASKED)


def score_call_bytes(
    method: str, device: torch.device | str, region_chunk: int, topk: int
) -> Callable[[int, int], int]:
    """`call_bytes(rows, width)`: the temporary bytes of one scoring call of `rows` (query, group)
    rows over `width` regions. Each chunk's FP32 scores (rows padded to `SCORE_ROW_ALIGN`), plus
    for "threshold" the workspace of `stable_topk` (none on its GPU kernels) and, once a call spans
    several chunks, the running candidates concatenated with the chunk (FP32 scores and int64 ids
    over `topk + chunk` entries); for "composite" 16 more bytes per entry (int64 key,
    concatenation)."""

    # stable_topk's workspace per entry, at the longest rows of a single-chunk and of a later
    # chunk's call (it only grows with the row): asked once, not per tile
    single = stable_topk_workspace_bytes(region_chunk, torch.float32, device)
    running = stable_topk_workspace_bytes(topk + region_chunk, torch.float32, device)

    def call_bytes(rows: int, width: int) -> int:
        chunk = min(width, region_chunk)
        scores = rows * (-(-chunk // SCORE_ROW_ALIGN) * SCORE_ROW_ALIGN) * 4  # padded FP32 rows
        if method == "composite":
            return scores + rows * chunk * 16
        one_chunk = scores + rows * chunk * single
        if width <= region_chunk:
            return one_chunk
        return one_chunk + rows * (topk + chunk) * (4 + 8 + running)

    return call_bytes


def _merge_tiles(
    tiles: tuple[ScoreTile, ...],
    groups: int,
    budget: int,
    call_bytes: Callable[[int, int], int],
    max_growth: float = MERGE_WIDTH_GROWTH,
) -> list[ScoreTile]:
    """Join tiles of one batch row that touch (no unscored rows between them) while one call's
    temporaries (`call_bytes(rows, width)`, `score_call_bytes`) stay within `budget` bytes and its
    regions span at most `max_growth` times its first tile's: a call scores the rectangle of its
    rows and regions, so rows whose causal range is much shorter would be scored (and their top-k
    walked) over regions they cannot select."""
    merged: list[list[int]] = []
    for b, q0, q1, r0, r1 in tiles:
        if merged and merged[-1][0] == b and merged[-1][2] == q0:
            mb, m0, _, mr0, mr1, first_width = merged[-1]
            lo, hi = min(mr0, r0), max(mr1, r1)
            fits = call_bytes((q1 - m0) * groups, hi - lo) <= budget
            if fits and hi - lo <= max_growth * first_width:
                merged[-1] = [mb, m0, q1, lo, hi, first_width]
                continue
        merged.append([b, q0, q1, r0, r1, r1 - r0])
    return [(b, q0, q1, r0, r1) for b, q0, q1, r0, r1, _ in merged]


def _check(
    query: torch.Tensor, weights: torch.Tensor, summary: torch.Tensor, metadata: RegionMetadata
) -> None:
    fn = "select_regions"
    batch, queries = metadata.batch_size, metadata.queries
    if query.dim() != 5 or query.shape[:2] != (batch, queries):
        raise ValueError(
            f"{fn}: query must be [batch={batch}, queries={queries}, groups, heads, dim]; got {tuple(query.shape)}"
        )
    if query.shape[2] < 1 or query.shape[3] < 1 or query.shape[4] < 1:
        raise ValueError(
            f"{fn}: query needs at least one group, head and dim; got {tuple(query.shape)}"
        )
    if weights.shape != query.shape[:4]:
        raise ValueError(
            f"{fn}: weights must be {tuple(query.shape[:4])}; got {tuple(weights.shape)}"
        )
    if (
        summary.dim() != 3
        or summary.shape[0] != batch
        or summary.shape[1] < metadata.region_count
        or summary.shape[2] != query.shape[4]
    ):
        raise ValueError(
            f"{fn}: summary must be [batch={batch}, regions>={metadata.region_count}, dim={query.shape[4]}]; "
            f"got {tuple(summary.shape)}"
        )
