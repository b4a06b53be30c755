"""The oracle of the distillation losses: float64, one query at a time, explicit loops.

Written from the definitions, not from the blockwise path: every query's visible keys, its per-head
softmax over the keys the main attention attends, the sum over its route's heads, the aggregation
into units by walking each unit's tokens, the indexer logits and the KL, in float64 with autograd
(so gradients come from `backward()`). Slow on purpose; tests compare the blockwise losses and
gradients against it.
"""

from __future__ import annotations

import itertools
import math

import torch

from ..step5.metadata.reference import reference_regions


def _kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(logits)), target already normalised, 0 · log 0 = 0."""
    log_p = torch.log_softmax(logits, dim=0)
    positive = target > 0
    return (target[positive] * (target[positive].log() - log_p[positive])).sum()


def _head_probabilities(
    query: torch.Tensor, key: torch.Tensor, heads: range, keys: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of the query heads `heads` over the key rows `keys`: ([len(heads), len(keys)],
    lse [len(heads)]), float64. query [all heads, D] of one query, key [S, kv_heads, D] of its row;
    head h reads kv head `h // (all heads / kv_heads)`."""
    index = torch.tensor(keys, dtype=torch.long)
    rows = key[index].double()  # [n, kv_heads, D]
    kv = torch.tensor(list(heads)) // (query.shape[0] // key.shape[1])
    scores = torch.einsum("hd,nhd->hn", query[list(heads)].double(), rows[:, kv]) * scale
    lse = torch.logsumexp(scores, dim=1)
    return torch.exp(scores - lse[:, None]), lse


def qsa_indexer_distillation_loss_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    index_queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    *,
    token_budget: int,
    compress_ratio: int,
    mode: str,
    routes: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sequence_lengths: list[int] | None = None,
    cu_seqlens: tuple[int, ...] | None = None,
    query_start: int = 0,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The QSA loss of `sa_routing.qsa_indexer_distillation_loss` (same arguments, no validation).

    Returns:
        `(loss, lse)`: float64 scalar, differentiable with respect to `index_queries` and
        `compressed_keys`; float64 [batch, local_queries, heads] log-sum-exp of the keys each sparse
        query attends (0 elsewhere).
    """
    batch, queries, heads, dim = query.shape
    total = key.shape[1]
    c, kept = compress_ratio, token_budget // compress_ratio
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    index_scale = 1.0 / math.sqrt(index_queries.shape[-1])
    # per batch row: (document start, length, global id of its block 0)
    if cu_seqlens is None:
        lengths = [total] * batch if sequence_lengths is None else list(sequence_lengths)
        documents = [[(0, lengths[b], 0)] for b in range(batch)]
    else:
        documents, first_block = [[]], 0
        for start, stop in itertools.pairwise(cu_seqlens):
            documents[0].append((start, stop - start, first_block))
            first_block += (stop - start) // c
    lse_out = torch.zeros(batch, queries, heads, dtype=torch.float64)
    losses = []
    for b in range(batch):
        for i in range(queries):
            row = query_start + i
            home = [d for d in documents[b] if d[0] <= row < d[0] + d[1]]
            if not home:
                continue  # padding
            start, _, block0 = home[0]
            p = row - start
            v = (p + 1) // c
            if v <= kept:
                continue  # dense prefix
            visible = list(range(start, row + 1))
            if mode == "dense_warmup":
                attended = visible
                candidates = list(range(v))  # document-local blocks
            else:
                route = [int(t) for t in routes[b, i].tolist() if t >= 0]
                attended = sorted(set(route) & set(visible))
                candidates = sorted({(t - start) // c for t in route[: kept * c : c]})
            probabilities, lse = _head_probabilities(
                query[b, i], key[b], range(heads), attended, scale
            )
            lse_out[b, i] = lse
            mass = dict(zip(attended, probabilities.sum(dim=0).unbind(), strict=True))
            target = torch.stack(
                [
                    sum(
                        (
                            mass.get(start + u * c + j, torch.zeros((), dtype=torch.float64))
                            for j in range(c)
                        ),
                        torch.zeros((), dtype=torch.float64),
                    )
                    for u in candidates
                ]
            )
            target = target / target.sum()
            block_keys = compressed_keys[b, [block0 + u for u in candidates], 0].double()
            dots = index_queries[b, i].double() @ block_keys.t()  # [index_heads, candidates]
            logits = torch.relu(dots).sum(dim=0) * index_scale
            losses.append(_kl(target, logits))
    return _reduce(losses, reduction), lse_out


def csa_indexer_distillation_loss_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    index_queries: torch.Tensor,
    index_weights: torch.Tensor,
    region_summaries: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    *,
    region_size: int,
    topk: int,
    mode: str,
    region_ids: torch.Tensor | None = None,
    query_start: int = 0,
    softmax_scale: float | None = None,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSA loss of `sa_routing.csa_indexer_distillation_loss`, its regions from a token walk.

    Args:
        key_positions, key_padding: [batch, global_length] document positions and padding, as given
            to `region_metadata`.
        region_ids: "sparse": int [batch, G, local_queries, topk + 1]; ids >= the region count are unused.
        (others as the blockwise function).
    Returns:
        `(loss, lse)`: float64 scalar, differentiable with respect to `index_queries`,
        `index_weights` and `region_summaries`; float64 [batch, local_queries, heads] log-sum-exp of
        the keys each sparse query's heads attend (0 elsewhere).
    """
    batch, queries, heads, dim = query.shape
    groups = index_queries.shape[2]
    per_group = heads // groups
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    token_regions, region_documents, region_first = reference_regions(
        key_positions, key_padding, region_size
    )
    positions = key_positions.tolist()
    lse_out = torch.zeros(batch, queries, heads, dtype=torch.float64)
    losses = []
    for b in range(batch):
        regions = token_regions[b]
        for i in range(queries):
            row = query_start + i
            current = regions[row]
            if current < 0 or positions[b][row] // region_size <= topk:
                continue  # padding or dense
            document = region_documents[b][current]
            visible = [
                t
                for t in range(row + 1)
                if regions[t] >= 0 and region_documents[b][regions[t]] == document
            ]
            per_query = []
            for g in range(groups):
                if mode == "dense_warmup":
                    attended = visible
                    candidates = list(range(region_first[b][current], current))
                else:
                    chosen = {
                        int(r)
                        for r in region_ids[b, g, i].tolist()
                        if 0 <= r < len(region_documents[b])
                    }
                    attended = [t for t in visible if regions[t] in chosen]
                    candidates = sorted(chosen - {current})
                head_slice = slice(g * per_group, (g + 1) * per_group)
                probabilities, lse = _head_probabilities(
                    query[b, i], key[b], range(g * per_group, (g + 1) * per_group), attended, scale
                )
                lse_out[b, i, head_slice] = lse
                summed = probabilities.sum(dim=0)
                target = torch.zeros(len(candidates), dtype=torch.float64)
                position_of = {r: n for n, r in enumerate(candidates)}
                for n, t in enumerate(attended):
                    if regions[t] in position_of:
                        target[position_of[regions[t]]] += summed[n]
                target = target / target.sum()
                summaries = region_summaries[b, candidates].double()  # [candidates, D]
                dots = (
                    index_queries[b, i, g].double() @ summaries.t()
                )  # [heads_per_group, candidates]
                logits = (index_weights[b, i, g].double()[:, None] * torch.relu(dots)).sum(dim=0)
                per_query.append(_kl(target, logits))
            losses.append(torch.stack(per_query).mean())
    return _reduce(losses, reduction), lse_out


def _reduce(losses: list[torch.Tensor], reduction: str) -> torch.Tensor:
    if not losses:
        return torch.zeros((), dtype=torch.float64)
    total = torch.stack(losses).sum()
    return total / len(losses) if reduction == "mean" else total
