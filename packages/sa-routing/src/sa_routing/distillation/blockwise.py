"""The dense warm-up distillation loss: targets from the main attention, KL to the indexer, by tile.

A `DistillationProblem` holds everything in the indexer's "units" (QSA compressed blocks, CSA regions):
the unit of every key token, the candidate units `[start, stop)` of every query, the rows that carry
a loss, and host tiles of at most `query_block` local queries with the unit and key intervals they
need. (The sparse stage, whose candidates are a few selected units, runs in the slot layout of
`slots`.) Per tile:

1. the target (under `no_grad`): the main attention's per-head softmax over the tile's keys, streamed
   over blocks of `key_block` keys: a first pass for the per-head log-sum-exp (skipped when the
   attention forward's is given), a second that sums each route group's heads and scatter-adds the
   probabilities into units; then masked to the candidates and L1-normalised;
2. the indexer's FP32 logits over the tile's units, head by head; `KL(target || softmax(logits))`
   over the candidates;
3. the gradient of the tile's loss with respect to the index queries, head weights and unit keys,
   by hand from `softmax − target` (the scores are sums of ReLUs of dot products), recomputing each
   head's dots instead of keeping them.

So the largest temporaries are `[heads, query_block, key_block]` (the attention scores, one alive
at a time: the exponentials run in place) and
`[groups, query_block, tile units]` (target, logits, gradient); no tensor of all queries against all
keys or units exists, in the forward or the backward (the autograd graph keeps only the gradients).

With `backend == "triton"` step 1 runs the kernels of `triton_kernels` instead (`_triton_target`):
the per-head LSE of every query first (when not given), then each tile's unit mass; and steps 2
and 3 run `dense_logits` (`_triton_tile_loss`: one batched GEMM of the dots of every index head, a
fused Triton kernel for the logits, KL and the dots' gradient, two GEMMs for the queries' and keys'
gradients) in place of the per-head matmuls of `_torch_tile_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class DistillationTile:
    """Local query rows `[query_start, query_stop)` of batch row `batch`, whose candidate units lie in
    `[unit_start, unit_stop)` and whose attended keys lie in `[key_start, key_stop)` (global rows)."""

    batch: int
    query_start: int
    query_stop: int
    unit_start: int
    unit_stop: int
    key_start: int
    key_stop: int


@dataclass(frozen=True)
class DistillationProblem:
    """One layer's dense warm-up inputs in the indexer's units (`B` batch, `Q` local queries, `S`
    global keys, `G` route groups, `H` main query heads).

    Attributes:
        query: [B, Q, H, D] main-attention queries (detached).
        key: [B, S, Hkv, D] main-attention keys, global (detached).
        softmax_scale: the main attention's scale.
        query_start: global row of local query 0.
        key_documents: int64 [B, S], document of every key, -1 for padding.
        query_documents: int64 [B, Q], document of every query, -1 for padding.
        key_units: int64 [B, S], unit of every key, -1 for none (padding, a QSA tail).
        loss_rows: bool [B, Q], the queries that carry a loss.
        groups: `G`; query head h belongs to group `h // (H / G)`.
        candidate_start, candidate_stop: int64 [B, Q], the candidate units `[start, stop)`.
        lse: float32 [B, Q, H] natural log-sum-exp of the main attention's scaled scores over every
            visible key, or None (computed).
        tiles: the host tiles; together they cover every loss row once.
        key_block: keys per streamed block (the PyTorch path).
        backend: "torch" (the blockwise PyTorch loop) or "triton" (`triton_kernels`).
        document_start: int64 [B, Q], the first key row of each query's document ("triton" only).
        unit_rows: int32 [B, U, UNIT], the key row of each slot of each unit (UNIT a power of two),
            -1 for none ("triton" only).
    """

    query: torch.Tensor
    key: torch.Tensor
    softmax_scale: float
    query_start: int
    key_documents: torch.Tensor
    query_documents: torch.Tensor
    key_units: torch.Tensor
    loss_rows: torch.Tensor
    groups: int
    candidate_start: torch.Tensor
    candidate_stop: torch.Tensor
    lse: torch.Tensor | None
    tiles: tuple[DistillationTile, ...]
    key_block: int
    backend: str = "torch"
    document_start: torch.Tensor | None = None
    unit_rows: torch.Tensor | None = None


def split_rows(
    batch: int,
    first: int,
    stop: int,
    query_block: int,
    ranges,
) -> list[DistillationTile]:
    """Tiles of at most `query_block` rows over local rows `[first, stop)` of `batch`; `ranges(q0, q1)`
    gives the `(unit_start, unit_stop, key_start, key_stop)` of rows `[q0, q1)`."""
    tiles = []
    for q0 in range(first, stop, query_block):
        q1 = min(q0 + query_block, stop)
        tiles.append(DistillationTile(batch, q0, q1, *ranges(q0, q1)))
    return tiles


def merge_tiles(
    tiles: tuple[DistillationTile, ...], width: int, budget: int
) -> tuple[DistillationTile, ...]:
    """Adjacent tiles of one batch row merged while `width · rows · units` stays within `budget`
    elements (`width`: the FP32 elements per (query, unit) of the tile's largest temporaries)."""
    merged: list[DistillationTile] = []
    for tile in tiles:
        last = merged[-1] if merged else None
        if last is not None and last.batch == tile.batch and last.query_stop == tile.query_start:
            unit_start = min(last.unit_start, tile.unit_start)
            unit_stop = max(last.unit_stop, tile.unit_stop)
            rows = tile.query_stop - last.query_start
            if width * rows * (unit_stop - unit_start) <= budget:
                merged[-1] = DistillationTile(
                    tile.batch,
                    last.query_start,
                    tile.query_stop,
                    unit_start,
                    unit_stop,
                    min(last.key_start, tile.key_start),
                    max(last.key_stop, tile.key_stop),
                )
                continue
        merged.append(tile)
    return tuple(merged)


def _candidates(problem: DistillationProblem, tile: DistillationTile) -> torch.Tensor:
    """bool [G, rows, units of the tile]: the candidate units of each (group, query)."""
    b, q0, q1 = tile.batch, tile.query_start, tile.query_stop
    unit = torch.arange(tile.unit_start, tile.unit_stop, device=problem.key_units.device)
    start = problem.candidate_start[b, q0:q1, None]
    stop = problem.candidate_stop[b, q0:q1, None]
    inside = (unit >= start) & (unit < stop)
    return inside.unsqueeze(0).expand(problem.groups, -1, -1)


def _target(
    problem: DistillationProblem, tile: DistillationTile, candidates: torch.Tensor
) -> torch.Tensor:
    """float32 [G, rows, units]: the main attention's mass on each candidate unit, summed over the
    group's heads and L1-normalised over the candidates (rows without mass: zero)."""
    b, q0, q1 = tile.batch, tile.query_start, tile.query_stop
    rows, units, groups = q1 - q0, tile.unit_stop - tile.unit_start, problem.groups
    query, key = problem.query, problem.key
    heads, dim = query.shape[2], query.shape[3]
    kv_heads = key.shape[2]
    per_kv, per_group = heads // kv_heads, heads // groups
    device = query.device
    # [Hkv, per_kv * rows, D]: head h = kv * per_kv + j lands at rows [j * rows, (j + 1) * rows)
    q = query[b, q0:q1].float() * problem.softmax_scale
    q = (
        q.view(rows, kv_heads, per_kv, dim)
        .permute(1, 2, 0, 3)
        .reshape(kv_heads, per_kv * rows, dim)
    )
    query_rows = problem.query_start + torch.arange(q0, q1, device=device)
    query_documents = problem.query_documents[b, q0:q1]

    def block(t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked scaled scores [G, per_group, rows, keys] and the keys' unit slots [keys]."""
        k = key[b, t0:t1].float().permute(1, 2, 0)  # [Hkv, D, keys]
        scores = torch.bmm(q, k).view(groups, per_group, rows, t1 - t0)
        key_rows = torch.arange(t0, t1, device=device)
        visible = (
            (problem.key_documents[b, t0:t1] == query_documents[:, None])
            & (query_documents[:, None] >= 0)
            & (key_rows <= query_rows[:, None])
        )  # [rows, keys]
        unit = problem.key_units[b, t0:t1] - tile.unit_start
        slot = torch.where((unit >= 0) & (unit < units), unit, units)
        return scores.masked_fill_(~visible[None, None], _NEG_INF), slot

    key_ranges = [
        (t0, min(t0 + problem.key_block, tile.key_stop))
        for t0 in range(tile.key_start, tile.key_stop, problem.key_block)
    ]
    if problem.lse is None:  # pass 1: per-head log-sum-exp, streamed
        running_max = torch.full((groups, per_group, rows), _NEG_INF, device=device)
        total = torch.zeros(groups, per_group, rows, device=device)
        for t0, t1 in key_ranges:
            scores, _ = block(t0, t1)
            new_max = torch.maximum(running_max, scores.amax(dim=-1))
            shift = torch.where(new_max > _NEG_INF, new_max, 0.0)
            block_sum = scores.sub_(shift[..., None]).exp_().sum(dim=-1)  # in place: scores die
            total = total * torch.exp(running_max - shift) + block_sum
            running_max = new_max
        shift = torch.where(running_max > _NEG_INF, running_max, 0.0)
        lse = torch.where(total > 0, shift + torch.log(total), float("inf"))
    else:
        lse = problem.lse[b, q0:q1].float().t().reshape(groups, per_group, rows)
        lse = torch.where(torch.isfinite(lse), lse, float("inf"))  # an empty row has no mass
    mass = torch.zeros(groups, rows, units + 1, device=device)
    for t0, t1 in key_ranges:  # pass 2: probabilities, summed over the group's heads, into units
        scores, slot = block(t0, t1)
        probabilities = scores.sub_(lse[..., None]).exp_().sum(dim=1)  # [G, rows, keys]
        mass.scatter_add_(2, slot.expand(groups, rows, -1), probabilities)
    target = mass[..., :units] * candidates
    norm = target.sum(dim=-1, keepdim=True)
    return torch.where(norm > 0, target / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def _triton_lse(problem: DistillationProblem) -> torch.Tensor:
    """float32 [B, Q, H] per-head LSE of the Triton target: the given one (+inf where not finite) or
    `triton_kernels.dense_lse` over every visible key."""
    from .triton_kernels import dense_lse

    if problem.lse is not None:
        given = problem.lse.float()
        return torch.where(torch.isfinite(given), given, float("inf")).contiguous()
    return dense_lse(
        problem.query,
        problem.key,
        problem.key_documents,
        problem.query_documents,
        problem.document_start,
        query_start=problem.query_start,
        softmax_scale=problem.softmax_scale,
    )


def _triton_target(
    problem: DistillationProblem,
    tile: DistillationTile,
    candidates: torch.Tensor,
    lse: torch.Tensor,
) -> torch.Tensor:
    """`_target` from the Triton kernel `triton_kernels.dense_mass`."""
    from .triton_kernels import dense_mass

    b, q0, q1 = tile.batch, tile.query_start, tile.query_stop
    mass = dense_mass(
        query=problem.query[b],
        key=problem.key[b],
        lse=lse[b],
        unit_rows=problem.unit_rows[b],
        key_documents=problem.key_documents[b],
        query_documents=problem.query_documents[b],
        candidate_start=problem.candidate_start[b],
        candidate_stop=problem.candidate_stop[b],
        groups=problem.groups,
        rows=(q0, q1),
        units=(tile.unit_start, tile.unit_stop),
        query_start=problem.query_start,
        softmax_scale=problem.softmax_scale,
    )
    target = mass * candidates
    norm = target.sum(dim=-1, keepdim=True)
    return torch.where(norm > 0, target / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def _index_dots(queries: torch.Tensor, keys: torch.Tensor, head: int) -> torch.Tensor:
    """[G, rows, units] dots of one index head: queries [rows, G, Hi, Di], keys [units, Di]."""
    return torch.matmul(queries[:, :, head].transpose(0, 1), keys.t())


def distillation_sum(
    problem: DistillationProblem,
    index_queries: torch.Tensor,
    index_weights: torch.Tensor | None,
    index_scale: float,
    unit_keys: torch.Tensor,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The sum over loss rows of the per-query loss (the mean of its groups' KLs), and its gradients.

    Logits: `Σ_h c_h · relu(q_h · k_u)`, `c_h = index_weights[..., h]` (CSA) or `index_scale` (QSA).

    Args:
        index_queries: [B, Q, G, Hi, Di] floating.
        index_weights: [B, Q, G, Hi] floating, or None.
        unit_keys: [B, U, Di] floating.
        needs_grad: which of (index_queries, index_weights, unit_keys) need a gradient.
    Returns:
        `(loss, (d_queries, d_weights, d_keys))`: float32 scalar, float32 gradients of the inputs'
        shapes (None where not needed).
    """
    device = index_queries.device
    groups = problem.groups
    want_q, want_w, want_k = needs_grad
    want_w = want_w and index_weights is not None
    d_queries = torch.zeros_like(index_queries, dtype=torch.float32) if want_q else None
    d_weights = torch.zeros_like(index_weights, dtype=torch.float32) if want_w else None
    d_keys = torch.zeros_like(unit_keys, dtype=torch.float32) if want_k else None
    total = torch.zeros((), device=device)
    lse = None
    if problem.backend == "triton" and problem.tiles:
        with torch.no_grad():
            lse = _triton_lse(problem)
    for tile in problem.tiles:
        b, q0, q1, u0, u1 = (
            tile.batch,
            tile.query_start,
            tile.query_stop,
            tile.unit_start,
            tile.unit_stop,
        )
        candidates = _candidates(problem, tile)
        with torch.no_grad():
            if lse is None:
                target = _target(problem, tile, candidates)
            else:
                target = _triton_target(problem, tile, candidates, lse)
        # a loss row whose target has no mass on its candidates contributes 0 (and no gradient)
        row_weight = (problem.loss_rows[b, q0:q1] & (target.sum(dim=-1) > 0)) / groups
        grads = (
            d_queries[b, q0:q1] if want_q else None,
            d_weights[b, q0:q1] if want_w else None,
            d_keys[b, u0:u1] if want_k else None,
        )
        tile_loss = _triton_tile_loss if problem.backend == "triton" else _torch_tile_loss
        total = total + tile_loss(
            problem,
            tile,
            index_queries[b, q0:q1],
            None if index_weights is None else index_weights[b, q0:q1],
            index_scale,
            unit_keys[b, u0:u1],
            target,
            candidates,
            row_weight,
            grads,
        )
    return total, (d_queries, d_weights, d_keys)


def _torch_tile_loss(
    problem: DistillationProblem,
    tile: DistillationTile,
    index_queries: torch.Tensor,
    index_weights: torch.Tensor | None,
    index_scale: float,
    unit_keys: torch.Tensor,
    target: torch.Tensor,
    candidates: torch.Tensor,
    row_weight: torch.Tensor,
    grads: tuple[torch.Tensor | None, ...],
) -> torch.Tensor:
    """One tile's weighted KL sum (steps 2 and 3 in PyTorch), its gradients added into `grads`
    (views of the tile's rows and units). Shapes as `dense_logits.dense_tile_loss`."""
    d_queries, d_weights, d_keys = grads
    heads = index_queries.shape[2]
    queries = index_queries.float()  # [rows, G, Hi, Di]
    keys = unit_keys.float()  # [units, Di]
    coefficients = (
        None if index_weights is None else index_weights.float().permute(2, 1, 0)
    )  # [Hi, G, rows]
    logits = torch.zeros_like(target)
    for h in range(heads):
        c = index_scale if coefficients is None else coefficients[h, :, :, None]
        logits += torch.relu(_index_dots(queries, keys, h)) * c
    any_candidate = candidates.any(dim=-1, keepdim=True)
    logits = torch.where(candidates, logits, torch.where(any_candidate, _NEG_INF, 0.0))
    log_probabilities = torch.log_softmax(logits, dim=-1)
    kl = torch.where(
        target > 0,
        target * (torch.log(target.clamp_min(torch.finfo(torch.float32).tiny)) - log_probabilities),
        0.0,
    ).sum(dim=-1)  # [G, rows]
    total = (kl * row_weight).sum()
    if all(g is None for g in grads):
        return total
    d_logits = (torch.exp(log_probabilities) - target) * candidates * row_weight[..., None]
    for h in range(heads):
        dots = _index_dots(queries, keys, h)
        if d_weights is not None:
            d_weights[:, :, h] += (d_logits * torch.relu(dots)).sum(dim=-1).t()
        c = index_scale if coefficients is None else coefficients[h, :, :, None]
        d_dots = d_logits * c * (dots > 0)  # [G, rows, units]
        if d_queries is not None:
            d_queries[:, :, h] += torch.matmul(d_dots, keys).transpose(0, 1)
        if d_keys is not None:
            flat = d_dots.flatten(0, 1)  # [G * rows, units]
            d_keys += flat.t() @ queries[:, :, h].transpose(0, 1).flatten(0, 1)
    return total


def _triton_tile_loss(
    problem: DistillationProblem,
    tile: DistillationTile,
    index_queries: torch.Tensor,
    index_weights: torch.Tensor | None,
    index_scale: float,
    unit_keys: torch.Tensor,
    target: torch.Tensor,
    candidates: torch.Tensor,
    row_weight: torch.Tensor,
    grads: tuple[torch.Tensor | None, ...],
) -> torch.Tensor:
    """`_torch_tile_loss` from the Triton kernels of `dense_logits`."""
    from .dense_logits import dense_tile_loss

    b, q0, q1, u0, u1 = (
        tile.batch,
        tile.query_start,
        tile.query_stop,
        tile.unit_start,
        tile.unit_stop,
    )
    units = u1 - u0
    start = (problem.candidate_start[b, q0:q1] - u0).clamp(0, units).to(torch.int32)
    stop = (problem.candidate_stop[b, q0:q1] - u0).clamp(0, units).to(torch.int32)
    return dense_tile_loss(
        index_queries, index_weights, index_scale, unit_keys, target, start, stop,
        row_weight.float(), *grads,
    )  # fmt: skip
