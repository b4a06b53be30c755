"""The oracle of Step-5 routing: plain PyTorch, written from SEMANTICS §1.2 without the fast path.

Regions come from a per-token Python walk, scores from a dense einsum over every region (chunked by
queries only to bound memory), top-k from a stable descending sort over ids in ascending order.
Slow on purpose; tests and GPU checks compare the fast path against it.
"""

import math

import torch


def reference_regions(
    key_positions: torch.Tensor, key_padding: torch.Tensor | None, region_size: int
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Walk every row token by token: per row, each token's global region (-1 padding), each region's
    document, and each region's first region in its document."""
    positions = key_positions.tolist()
    padding = (
        [[False] * len(row) for row in positions] if key_padding is None else key_padding.tolist()
    )
    token_regions, region_documents, region_first = [], [], []
    for row_pos, row_pad in zip(positions, padding, strict=True):
        regions, docs, firsts = [], [], []
        document, doc_first, previous = -1, 0, None
        for p, pad in zip(row_pos, row_pad, strict=True):
            if pad:
                regions.append(-1)
                continue
            if p == 0:
                document += 1
                doc_first = len(docs)
            elif previous is None or p != previous + 1:
                raise ValueError(f"reference_regions: position {p} does not continue its document")
            if p % region_size == 0:
                docs.append(document)
                firsts.append(doc_first)
            regions.append(len(docs) - 1)
            previous = p
        token_regions.append(regions)
        region_documents.append(docs)
        region_first.append(firsts)
    return token_regions, region_documents, region_first


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """BF16/FP32 → float8_e4m3fn (saturating at ±448, nearest-even) → back to x's dtype."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


def reference_summaries(
    keys: torch.Tensor,
    logits: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    region_size: int,
) -> torch.Tensor:
    """Summaries of every region, BF16 [B, N, D] (E4M3-rounded), N the largest region count.

    Per region and dimension, `Σ_t softmax_t(z_td) · k_td` in FP32 over the region's valid tokens,
    then FP32 → BF16 → E4M3 → BF16. Rows with fewer regions are zero past their last region.
    """
    token_regions, region_documents, _ = reference_regions(key_positions, key_padding, region_size)
    batch, _, dim = keys.shape
    count = max((len(d) for d in region_documents), default=0)
    out = torch.zeros(batch, count, dim, dtype=torch.bfloat16, device=keys.device)
    for b in range(batch):
        members: list[list[int]] = [[] for _ in region_documents[b]]
        for t, r in enumerate(token_regions[b]):
            if r >= 0:
                members[r].append(t)
        for r, tokens in enumerate(members):
            index = torch.tensor(tokens, device=keys.device)
            z = logits[b, index].float()
            k = keys[b, index].float()
            pooled = (torch.softmax(z, dim=0) * k).sum(dim=0)
            out[b, r] = round_e4m3(pooled.to(torch.bfloat16))
    return out


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


def reference_rope(
    x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float
) -> torch.Tensor:
    """NeoX half-split RoPE over the first `rope_dim` dims of x [B, S, ..., D] in FP32, back to x's dtype."""
    half = rope_dim // 2
    inv_freq = 1.0 / theta ** (
        torch.arange(0, rope_dim, 2, dtype=torch.float32, device=x.device) / rope_dim
    )
    angle = positions.float()[..., None] * inv_freq
    angle = angle.reshape(*positions.shape, *([1] * (x.dim() - 3)), half)
    a, b = x[..., :half].float(), x[..., half:rope_dim].float()
    out = x.clone()
    out[..., :half] = (a * angle.cos() - b * angle.sin()).to(x.dtype)
    out[..., half:rope_dim] = (b * angle.cos() + a * angle.sin()).to(x.dtype)
    return out


def reference_project_keys(
    indexer: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (LayerNorm `E[x²] − E[x]²`, weights in x's dtype, then RoPE) and logits, from the indexer's weights."""
    cfg = indexer.config
    with torch.no_grad():
        k = hidden @ indexer.k_proj.weight.t()
        kf = k.float()
        mean = kf.mean(-1, keepdim=True)
        var = (kf * kf).mean(-1, keepdim=True) - mean * mean
        w = indexer.k_norm.weight.to(k.dtype).float()
        bias = indexer.k_norm.bias.to(k.dtype).float()
        normed = ((kf - mean) / torch.sqrt(var + cfg.norm_eps) * w + bias).to(k.dtype)
        keys = reference_rope(normed, positions, cfg.rope_dim, indexer.rotary.theta)
        return keys, hidden @ indexer.z_proj.weight.t()


def reference_project_queries(
    indexer: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3-rounded queries [B, S, G, H, D] and FP32 weights [B, S, G, H], from the indexer's weights."""
    cfg = indexer.config
    groups, heads = cfg.num_provider_groups, cfg.heads_per_group
    with torch.no_grad():
        q = (hidden @ indexer.q_proj.weight.t()).view(
            *hidden.shape[:2], groups, heads, cfg.proxy_dim
        )
        qf = q.float()
        scale = 1.0 + indexer.q_norm.weight.to(q.dtype).float()
        normed = (qf * torch.rsqrt((qf * qf).mean(-1, keepdim=True) + cfg.norm_eps) * scale).to(
            q.dtype
        )
        query = round_e4m3(reference_rope(normed, positions, cfg.rope_dim, indexer.rotary.theta))
        w = (hidden @ indexer.w_proj.weight.to(hidden.dtype).t()).float() * heads**-0.5
        return query, w.view(*hidden.shape[:2], groups, heads)


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
