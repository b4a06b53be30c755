"""The oracle for attention over selected regions: plain PyTorch, chunked over queries, K/V heads never
expanded, regions never expanded beyond one chunk of queries."""

import torch

from sa_kernels.sparse_gqa.reference import route_membership, row_lse

# Queries per chunk at most; fewer when the chunk's gathered K (or V) copy would pass
# _CHUNK_ELEMENTS elements ([batch, groups, chunk, slots · region_size, head_dim]).
DEFAULT_QUERY_CHUNK = 256
_CHUNK_ELEMENTS = 1 << 24


def region_key_rows(
    region_ids: torch.Tensor, region_sources: torch.Tensor, kv_length: int, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key rows each query row sees through its selected regions.

    Args:
        region_ids: integer [batch, groups, queries, slots]; ids outside [0, regions) are unused,
            repeats count once.
        region_sources: int32 [batch, regions, region_size], key rows, -1 where a region has none.
        kv_length: number of keys; sources outside [0, kv_length) hold no token.
        rows: int64 [queries], each query's global row (its causal bound).
    Returns:
        keys: int64 [batch, groups, queries, slots · region_size], the key rows (0 where not visible).
        visible: bool, same shape: the slot's region is a first occurrence of a valid id and the
            key row is in [0, min(kv_length, row + 1)).
    """
    batch = region_ids.shape[0]
    keep = route_membership(region_ids, region_sources.shape[1])
    safe = torch.where(keep, region_ids.long(), 0)
    batch_index = torch.arange(batch, device=region_ids.device).view(batch, 1, 1, 1)
    sources = region_sources[batch_index, safe].long()  # [B, G, Q, W, R]
    visible = (
        keep.unsqueeze(-1)
        & (sources >= 0)
        & (sources < kv_length)
        & (sources <= rows.view(1, 1, -1, 1, 1))
    )
    keys = torch.where(visible, sources, 0)
    return keys.flatten(-2), visible.flatten(-2)


def sparse_region_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    region_ids: torch.Tensor,
    region_sources: torch.Tensor,
    query_start: int = 0,
    softmax_scale: float | None = None,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of each query row over the keys of its KV group's selected regions.

    Args:
        query: [batch, queries, heads, head_dim], any float dtype (float64 for gradcheck).
        key: [batch, kv_length, kv_groups, head_dim]; heads % kv_groups == 0, heads of group g are
            g·hpg … (g + 1)·hpg − 1.
        value: [batch, kv_length, kv_groups, head_dim].
        region_ids: integer [batch, kv_groups, queries, slots]; ids outside [0, regions) are unused,
            repeats count once, any order.
        region_sources: int32 [batch, regions, region_size], the key rows of each region, -1 (or any
            row outside [0, kv_length)) where it has none. Regions are disjoint (a key row belongs
            to at most one region), as region metadata builds them.
        query_start: global row of query 0; query q sees key rows k <= query_start + q.
        softmax_scale: defaults to head_dim ** -0.5.
        query_chunk: queries gathered at once at most (bounds memory; never changes results).
        return_lse: also return the log-sum-exp of the scaled scores.
    Returns:
        [batch, queries, heads, head_dim] in query.dtype; a row with no visible key is 0 and gets
        zero gradients. Scores and softmax run in FP32 (float64 for float64 inputs). With
        `return_lse`, `(out, lse)`: lse float32 [batch, queries, heads], the natural log of
        `Σ exp(scale · q · k)` over the row's visible keys, −inf for a row with none, detached (no
        gradient).
    """
    batch, queries, heads, head_dim = query.shape
    kv_length, groups = key.shape[1], key.shape[2]
    hpg = heads // groups
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    width = region_ids.shape[-1] * region_sources.shape[-1]
    chunk = max(1, min(query_chunk, _CHUNK_ELEMENTS // max(1, batch * groups * width * head_dim)))
    batch_index = torch.arange(batch, device=query.device).view(batch, 1, 1, 1)
    group_index = torch.arange(groups, device=query.device).view(1, groups, 1, 1)
    outputs, lses = [], []
    for start in range(0, queries, chunk):
        stop = min(start + chunk, queries)
        rows = torch.arange(query_start + start, query_start + stop, device=query.device)
        keys, visible = region_key_rows(
            region_ids[:, :, start:stop], region_sources, kv_length, rows
        )  # [B, G, Qc, L]
        k = key[batch_index, keys, group_index].to(compute)  # [B, G, Qc, L, D]
        v = value[batch_index, keys, group_index].to(compute)
        q = query[:, start:stop].reshape(batch, stop - start, groups, hpg, head_dim)
        scores = torch.einsum("bqghd,bgqld->bgqhl", q.to(compute), k) * scale
        scores = torch.where(visible.unsqueeze(3), scores, float("-inf"))
        peak = scores.amax(dim=-1, keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, 0.0).detach()
        weights = torch.exp(scores - peak)
        total = weights.sum(dim=-1, keepdim=True)
        probs = weights / torch.where(total > 0, total, 1.0)
        out = torch.einsum("bgqhl,bgqld->bqghd", probs, v)
        outputs.append(out.reshape(batch, stop - start, heads, head_dim).to(query.dtype))
        if return_lse:  # [B, G, Qc, hpg, 1] -> [B, Qc, heads]
            lse = row_lse(peak, total).squeeze(-1).permute(0, 2, 1, 3)
            lses.append(lse.reshape(batch, stop - start, heads))
    if return_lse:
        return torch.cat(outputs, dim=1), torch.cat(lses, dim=1)
    return torch.cat(outputs, dim=1)
