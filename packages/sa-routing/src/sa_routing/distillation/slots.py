"""The sparse-stage distillation loss in the slot layout: one entry per selected unit, nothing per unit.

A `SlotProblem` holds each (query, route group)'s selection as `K` slots, sorted ascending, with ids
outside `[0, U)` (and the CSA current region) set to `U`; a slot is valid where it holds the first
occurrence of a valid unit, so a repeated unit counts once. Per tile of query rows:

1. the target (under `no_grad`), `[G, rows, K]`: each valid slot's attention mass
   `Σ_{h in group} Σ_{keys k of the unit visible to q} exp(scale · q_h · k − lse_h)`, L1-normalised
   over the query's slots. `lse` is the attention forward's or computed here over exactly the keys
   that attention attends: the distinct selected units' visible keys and the suffix (QSA tail, CSA
   current region: `suffix_rows`). The PyTorch path gathers the slots' keys per (group, KV head);
   the Triton path (`triton_kernels.sparse_mass`) reads them through the unit table in registers;
2. the indexer's FP32 logits of the valid slots only (`Σ_h c_h · relu(q_h · k_slot)`), their
   log-softmax over the valid slots, `KL(target || indexer)`. The PyTorch path gathers the slots'
   unit keys per tile; the Triton path (`slot_logits`) reads them from the unit table in registers;
3. the gradients of the tile's loss with respect to the index queries, head weights and unit keys,
   by hand from `softmax − target`; the unit keys' gradient is an `index_add` over the slots' ids
   (Triton path: `slot_logits.slot_grads`, FP32 atomic adds).

Memory: a tile holds at most `_SLOT_ELEMENTS` (64M, 256 MiB FP32) elements in its largest tensor
(PyTorch path: the `[G, rows, K, index_dim]` gathered unit keys and `[rows, K · UNIT, head_dim]`
main keys of one (group, KV head); Triton path: an eighth of it in each `[G, rows, K]` tensor, the
target, logits and their gradient), or one query's row where that is larger. No tensor is indexed
by all units. The slot layout itself (int32 ids and bool
validity, `[B, G, Q, K]`) is sorted `_SORT_ELEMENTS` ids at a time, so its int64 temporaries stay
small beside the selection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .blockwise import DistillationTile
from .slot_logits import slot_grads, slot_logits

_NEG_INF = float("-inf")
_SLOT_ELEMENTS = 1 << 26  # elements of a tile's largest gathered tensor (256 MiB FP32)
_SORT_ELEMENTS = 1 << 24  # ids sorted at once by `sorted_slots` (its int64 sort indices: 128 MiB)


@dataclass(frozen=True)
class SlotProblem:
    """One layer's sparse-stage inputs in the slot layout (`B` batch, `Q` local queries, `S` global
    keys, `G` route groups, `H` main query heads, `K` slots, `U` units).

    Attributes:
        query: [B, Q, H, D] main-attention queries (detached).
        key: [B, S, Hkv, D] main-attention keys, global (detached).
        softmax_scale: the main attention's scale.
        query_start: global row of local query 0.
        key_documents: int64 [B, S], document of every key, -1 for padding.
        query_documents: int64 [B, Q], document of every query, -1 for padding.
        loss_rows: bool [B, Q], the queries that carry a loss.
        groups: `G`; query head h belongs to group `h // (H / G)`.
        slot_units: int32 [B, G, Q, K], the selected units ascending, every invalid id `U` (last).
        slot_valid: bool [B, G, Q, K], the first occurrence of each valid unit.
        unit_rows: int32 [B, U, UNIT], the key row of each offset of each unit (UNIT a power of two),
            -1 for none.
        suffix_start: int64 [B, Q], first row of the suffix: slot keys at rows >= it are left to the
            suffix in the LSE (a key is attended once).
        suffix_rows: int32 [B, Q, W], the key rows the attention attends besides the units (QSA tail,
            CSA current region; visible, <= the query row), -1 for none; W a power of two.
        lse: float32 [B, Q, H] natural log-sum-exp of the main attention's scaled scores over the keys
            it attends, or None (computed).
        tiles: host tiles of query rows; together they cover every loss row once (their unit and key
            intervals are not read).
        backend: "torch" or "triton".
    """

    query: torch.Tensor
    key: torch.Tensor
    softmax_scale: float
    query_start: int
    key_documents: torch.Tensor
    query_documents: torch.Tensor
    loss_rows: torch.Tensor
    groups: int
    slot_units: torch.Tensor
    slot_valid: torch.Tensor
    unit_rows: torch.Tensor
    suffix_start: torch.Tensor
    suffix_rows: torch.Tensor
    lse: torch.Tensor | None
    tiles: tuple[DistillationTile, ...]
    backend: str = "torch"


def sorted_slots(
    ids: torch.Tensor,
    units: int,
    exclude: torch.Tensor | None = None,
    lookup: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 sorted ids, bool valid) of int ids [..., Q, K] whose invalid entries are `units` or
    outside `[0, units)`, and also, with `exclude` (int, broadcastable to `[..., Q, 1]`), those
    equal to it: ascending, invalid last, valid where a unit's first
    occurrence. With `lookup`, the ids are `lookup(chunk of ids)` (same shape; e.g. token rows to
    the units that hold them). Sorted `_SORT_ELEMENTS` ids at a time along the query axis, in
    int32, so that the temporaries stay a fraction of the routes however long the sequence."""
    slots = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    valid = torch.empty(ids.shape, dtype=torch.bool, device=ids.device)
    rows = max(1, _SORT_ELEMENTS // max(ids[..., :1, :].numel(), 1))
    if exclude is not None:
        exclude = exclude.expand(*ids.shape[:-1], 1)
    for q0 in range(0, ids.shape[-2], rows):
        part = ids[..., q0 : q0 + rows, :]
        if lookup is not None:
            part = lookup(part)
        keep = (part >= 0) & (part < units)  # before the int32 cast: no id wraps into range
        if exclude is not None:
            keep &= part != exclude[..., q0 : q0 + rows, :]
        ordered = torch.where(keep, part.to(torch.int32), units).sort(dim=-1).values
        slots[..., q0 : q0 + rows, :] = ordered
        first = valid[..., q0 : q0 + rows, :]
        first[..., :1] = ordered[..., :1] < units
        first[..., 1:] = (ordered[..., 1:] < units) & (ordered[..., 1:] != ordered[..., :-1])
    return slots, valid


def slot_tiles(
    tiles: tuple[DistillationTile, ...], per_row: int, query_block: int | None
) -> tuple[DistillationTile, ...]:
    """The rows of `tiles` regrouped: adjacent tiles of one batch row merged, then cut into tiles of
    at most `_SLOT_ELEMENTS // per_row` rows (at least 1) and at most `query_block`."""
    rows = max(1, _SLOT_ELEMENTS // max(per_row, 1))
    if query_block is not None:
        rows = min(rows, query_block)
    spans: list[list[int]] = []
    for t in tiles:
        if spans and spans[-1][0] == t.batch and spans[-1][2] == t.query_start:
            spans[-1][2] = t.query_stop
        else:
            spans.append([t.batch, t.query_start, t.query_stop])
    return tuple(
        DistillationTile(b, q0, min(q0 + rows, q1), 0, 0, 0, 0)
        for b, first, q1 in spans
        for q0 in range(first, q1, rows)
    )


def _visible_rows(
    problem: SlotProblem, b: int, rows: torch.Tensor, q0: int, q1: int
) -> torch.Tensor:
    """bool of key rows `rows` [n, ...] (-1 none) whose keys query rows q0..q1 see: same document,
    not after the query; `rows` leads with the query axis."""
    query_rows = problem.query_start + torch.arange(q0, q1, device=rows.device)
    shape = (q1 - q0,) + (1,) * (rows.dim() - 1)
    documents = problem.key_documents[b][rows.clamp_min(0).long()]
    own = problem.query_documents[b, q0:q1].view(shape)
    return (rows >= 0) & (rows.long() <= query_rows.view(shape)) & (documents == own) & (own >= 0)


def _torch_mass(problem: SlotProblem, tile: DistillationTile) -> torch.Tensor:
    """float32 [G, rows, K] unnormalised slot mass of one tile (the blockwise PyTorch path)."""
    b, q0, q1 = tile.batch, tile.query_start, tile.query_stop
    query, key = problem.query[b], problem.key[b]
    heads, kv_heads = query.shape[1], key.shape[1]
    groups, per_group, per_kv = problem.groups, heads // problem.groups, heads // kv_heads
    units = problem.slot_units[b, :, q0:q1].transpose(0, 1)  # [rows, G, K]
    valid = problem.slot_valid[b, :, q0:q1].transpose(0, 1)
    count = problem.unit_rows.shape[1]
    slot_rows = problem.unit_rows[b][units.clamp_max(max(count - 1, 0)).long()]  # [r, G, K, UNIT]
    slot_rows = torch.where(valid[..., None], slot_rows, -1)
    slot_keep = _visible_rows(problem, b, slot_rows, q0, q1)
    rows, slots, width = q1 - q0, units.shape[-1], slot_rows.shape[-1]
    suffix = problem.suffix_rows[b, q0:q1]  # [rows, W]
    suffix_keep = suffix >= 0
    before_suffix = slot_rows.long() < problem.suffix_start[b, q0:q1].view(rows, 1, 1, 1)
    q = query[q0:q1].float() * problem.softmax_scale  # [rows, H, D]
    lse = None
    if problem.lse is not None:
        lse = problem.lse[b, q0:q1].float()
        lse = torch.where(torch.isfinite(lse), lse, float("inf"))  # an empty row has no mass
    mass = torch.zeros(groups, rows, slots, device=query.device)
    for g in range(groups):
        keep = slot_keep[:, g].flatten(1)  # [rows, K * UNIT]
        flat = slot_rows[:, g].flatten(1).clamp_min(0).long()
        h, stop = g * per_group, (g + 1) * per_group
        while h < stop:  # the group's heads, one KV head's run at a time
            kv = h // per_kv
            end = min(stop, (kv + 1) * per_kv)
            qh = q[:, h:end]  # [rows, hs, D]
            scores = qh @ key[:, kv][flat].float().transpose(1, 2)  # [rows, hs, K * UNIT]
            scores.masked_fill_(~keep[:, None], _NEG_INF)
            if lse is None:
                tail = qh @ key[:, kv][suffix.clamp_min(0).long()].float().transpose(1, 2)
                tail.masked_fill_(~suffix_keep[:, None], _NEG_INF)
                attended = scores.masked_fill(~before_suffix[:, g].flatten(1)[:, None], _NEG_INF)
                run_lse = torch.logsumexp(torch.cat([attended, tail], dim=-1), dim=-1)
                run_lse = torch.where(torch.isfinite(run_lse), run_lse, float("inf"))
            else:
                run_lse = lse[:, h:end]
            p = scores.sub_(run_lse[..., None]).exp_()  # in place: the scores die
            mass[g] += p.view(rows, end - h, slots, width).sum(dim=(1, 3))
            h = end
    return mass


def _triton_lse(problem: SlotProblem) -> tuple[torch.Tensor, bool]:
    """(float32 [B, Q, H] LSE buffer, whether the kernels fill it tile by tile)."""
    if problem.lse is not None:
        given = problem.lse.float()
        return torch.where(torch.isfinite(given), given, float("inf")).contiguous(), False
    batch, queries, heads = problem.query.shape[:3]
    return torch.full((batch, queries, heads), float("inf"), device=problem.query.device), True


def _triton_mass(
    problem: SlotProblem, tile: DistillationTile, lse: torch.Tensor, compute_lse: bool
) -> torch.Tensor:
    from .triton_kernels import sparse_mass

    b = tile.batch
    return sparse_mass(
        problem.query[b],
        problem.key[b],
        lse[b],
        problem.unit_rows[b],
        problem.key_documents[b],
        problem.query_documents[b],
        problem.suffix_start[b],
        problem.suffix_rows[b],
        problem.slot_units[b],
        rows=(tile.query_start, tile.query_stop),
        query_start=problem.query_start,
        softmax_scale=problem.softmax_scale,
        compute_lse=compute_lse,
    )


def slot_distillation_sum(
    problem: SlotProblem,
    index_queries: torch.Tensor,
    index_weights: torch.Tensor | None,
    index_scale: float,
    unit_keys: torch.Tensor,
    needs_grad: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """`blockwise.distillation_sum` of the sparse stage: the sum over loss rows of the per-query loss
    (the mean of its groups' KLs) and its gradients, in the slot layout.

    Args:
        index_queries: [B, Q, G, Hi, Di] floating.
        index_weights: [B, Q, G, Hi] floating, or None (coefficient `index_scale`).
        unit_keys: [B, U', Di] floating, U' >= U.
        needs_grad: which of (index_queries, index_weights, unit_keys) need a gradient.
    """
    device = index_queries.device
    groups = problem.groups
    want_q, want_w, want_k = needs_grad
    want_w = want_w and index_weights is not None
    d_queries = torch.zeros_like(index_queries, dtype=torch.float32) if want_q else None
    d_weights = torch.zeros_like(index_weights, dtype=torch.float32) if want_w else None
    d_keys = torch.zeros_like(unit_keys, dtype=torch.float32) if want_k else None
    total = torch.zeros((), device=device)
    count = problem.unit_rows.shape[1]
    if not problem.tiles or count == 0:
        return total, (d_queries, d_weights, d_keys)
    lse = compute_lse = None
    if problem.backend == "triton":
        lse, compute_lse = _triton_lse(problem)
    tiny = torch.finfo(torch.float32).tiny
    for tile in problem.tiles:
        b, q0, q1 = tile.batch, tile.query_start, tile.query_stop
        valid = problem.slot_valid[b, :, q0:q1]  # [G, rows, K]
        with torch.no_grad():
            if lse is None:
                mass = _torch_mass(problem, tile)
            else:
                mass = _triton_mass(problem, tile, lse, compute_lse)
            mass = mass * valid
            norm = mass.sum(dim=-1, keepdim=True)
            target = torch.where(norm > 0, mass / norm.clamp_min(tiny), 0.0)
        units = problem.slot_units[b, :, q0:q1]  # [G, rows, K]
        weights = None if index_weights is None else index_weights[b, q0:q1]
        fused = problem.backend == "triton"
        if fused:  # the unit keys read in registers (`slot_logits`)
            tile_args = (index_queries[b, q0:q1], weights, index_scale, unit_keys[b], units, valid)
            logits = slot_logits(*tile_args, count=count)
        else:
            ids = units.long().clamp_max(count - 1)
            keys = unit_keys[b].float()[ids]  # [G, rows, K, Di]
            queries = index_queries[b, q0:q1].float().transpose(0, 1)  # [G, rows, Hi, Di]
            coefficient = (
                index_scale if weights is None else weights.float().transpose(0, 1)[..., None]
            )  # [G, rows, Hi, 1]
            dots = queries @ keys.transpose(-1, -2)  # [G, rows, Hi, K]
            logits = (torch.relu(dots) * coefficient).sum(dim=2)  # [G, rows, K]
        any_valid = valid.any(dim=-1, keepdim=True)
        logits = torch.where(valid, logits, torch.where(any_valid, _NEG_INF, 0.0))
        log_probabilities = torch.log_softmax(logits, dim=-1)
        kl = torch.where(
            target > 0, target * (torch.log(target.clamp_min(tiny)) - log_probabilities), 0.0
        ).sum(dim=-1)  # [G, rows]
        # a loss row whose target has no mass on its slots contributes 0 (and no gradient)
        row_weight = (problem.loss_rows[b, q0:q1] & (norm[..., 0] > 0)) / groups
        total = total + (kl * row_weight).sum()
        if not (want_q or want_w or want_k):
            continue
        d_logits = (torch.exp(log_probabilities) - target) * valid * row_weight[..., None]
        if fused:  # a tile's rows are its own: the kernel stores their d_queries, d_weights
            slot_grads(
                *tile_args,
                d_logits,
                d_queries[b, q0:q1] if want_q else None,
                d_weights[b, q0:q1] if want_w else None,
                d_keys[b] if want_k else None,
                count=count,
            )
            continue
        d_logits = d_logits[:, :, None]  # [G, rows, 1, K]
        if want_w:
            d_weights[b, q0:q1] += (d_logits * torch.relu(dots)).sum(dim=-1).transpose(0, 1)
        d_dots = d_logits * coefficient * (dots > 0)  # [G, rows, Hi, K]
        if want_q:
            d_queries[b, q0:q1] += (d_dots @ keys).transpose(0, 1)
        if want_k:
            d_slots = d_dots.transpose(-1, -2) @ queries  # [G, rows, K, Di]
            # CUDA adds atomically (summation order varies between runs) unless
            # torch.use_deterministic_algorithms(True) asks for its deterministic path.
            d_keys[b].index_add_(0, ids.flatten(), d_slots.flatten(0, 2))
    return total, (d_queries, d_weights, d_keys)
