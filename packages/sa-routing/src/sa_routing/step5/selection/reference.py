"""The oracle of `select_regions`: plain PyTorch, written from SEMANTICS §1.2 without the fast path.

Scores from a dense einsum over every region (chunked by queries only to bound memory), top-k from a
stable descending sort over ids in ascending order; slow on purpose. `selections_differ_beyond_ties`
compares a selection whose scores were summed in another FP32 order with the oracle's.
"""

import math

import torch

from ..metadata.reference import reference_regions


def reference_scores(
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`Σ_h w_h · relu(q_h · s_r)` for every (group, query, region): [B, G, Q, N] in `dtype`.

    query [B, Q, G, H, D] (E4M3-rounded BF16), weights [B, Q, G, H] FP32, summary [B, N, D].
    """
    dots = torch.einsum("bqghd,brd->bgqhr", query.to(dtype), summary.to(dtype))
    return torch.einsum("bgqhr,bqgh->bgqr", torch.relu(dots), weights.to(dtype))


def reference_select_regions(
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    query_start: int,
    region_size: int,
    topk: int,
    score_dtype: torch.dtype = torch.float32,
    query_chunk: int = 256,
) -> torch.Tensor:
    """Region ids int32 [B, G, Q, topk + 1] of the queries at global rows `[query_start, query_start + Q)`.

    Every query is scored against every region; candidates are the regions of its document before its
    own; the best `min(topk, candidates)` by (score descending, id ascending) plus the current region
    are emitted ascending, unused slots N. Padding queries select nothing.
    """
    token_regions, region_documents, region_first = reference_regions(
        key_positions, key_padding, region_size
    )
    batch, queries, groups = query.shape[:3]
    count = max((len(d) for d in region_documents), default=0)
    device = query.device
    rows = slice(query_start, query_start + queries)
    current = torch.tensor([r[rows] for r in token_regions], dtype=torch.int64, device=device)
    first = torch.tensor(
        [
            [region_first[b][r] if r >= 0 else -1 for r in token_regions[b][rows]]
            for b in range(batch)
        ],
        dtype=torch.int64,
        device=device,
    )
    out = torch.full((batch, groups, queries, topk + 1), count, dtype=torch.int32, device=device)
    ids = torch.arange(count, device=device)
    for q0 in range(0, queries, query_chunk):
        q1 = min(q0 + query_chunk, queries)
        scores = reference_scores(
            query[:, q0:q1], weights[:, q0:q1], summary[:, :count], score_dtype
        )
        cur, fst = current[:, None, q0:q1, None], first[:, None, q0:q1, None]
        candidate = (ids >= fst) & (ids < cur)
        scores = scores.masked_fill(~candidate, -math.inf)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        kept = min(topk, count)
        chosen = order[..., :kept]
        n_candidates = candidate.sum(dim=-1, keepdim=True)
        chosen = torch.where(torch.arange(kept, device=device) < n_candidates, chosen, count)
        chosen = torch.cat(
            [chosen, torch.where(cur >= 0, cur, count).expand(-1, groups, -1, 1)], dim=-1
        )
        chosen = torch.sort(chosen, dim=-1).values.to(torch.int32)
        out[:, :, q0:q1, : kept + 1] = chosen
    return out


def selections_differ_beyond_ties(
    out: torch.Tensor,
    oracle: torch.Tensor,
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    count: int,
    rtol: float = 1e-5,
) -> tuple[int, list[tuple[int, int, int, int, int]]]:
    """Compare two selections whose scores were accumulated in different FP32 orders.

    Returns `(rows that differ, swaps that are not near-ties)`: a swap `(b, g, q, x, y)` exchanges
    region x (only in `out`) for region y (only in `oracle`) although their float64 scores differ by
    more than `rtol` times the row's largest score magnitude. An empty list means the selections agree
    up to FP32 rounding.
    """
    differing = (out != oracle).any(-1).nonzero().tolist()
    bad = []
    for b, g, q in differing:
        scores = reference_scores(
            query[b : b + 1, q : q + 1],
            weights[b : b + 1, q : q + 1],
            summary[b : b + 1],
            torch.float64,
        )
        row = scores[0, g, 0]
        mine, theirs = set(out[b, g, q].tolist()) - {count}, set(oracle[b, g, q].tolist()) - {count}
        only_mine, only_theirs = sorted(mine - theirs), sorted(theirs - mine)
        if len(only_mine) != len(only_theirs):
            bad.append((b, g, q, -1, -1))
            continue
        limit = rtol * float(row.abs().max())
        for x, y in zip(only_mine, only_theirs, strict=True):
            if abs(float(row[x] - row[y])) > limit:
                bad.append((b, g, q, x, y))
    return len(differing), bad
