"""The oracle for attention over routes: plain PyTorch, chunked over queries, K/V heads never expanded."""

import torch

# Queries per chunk: bounds the gathered [chunk, Hkv, W, D] K/V copies and the [chunk, Hkv, G, W] scores.
DEFAULT_QUERY_CHUNK = 256


def route_membership(token_ids: torch.Tensor, kv_length: int) -> torch.Tensor:
    """Valid, first-occurrence mask of `token_ids`: ids outside [0, kv_length) and repeats are dropped.

    Args:
        token_ids: integer [..., W] key ids.
        kv_length: number of keys.
    Returns:
        bool [..., W]: True where the id is in range and no earlier slot of its row holds the same id.
    """
    ids = token_ids.long()
    valid = (ids >= 0) & (ids < kv_length)
    # Sort each row and mark every repeat after its first occurrence (set semantics).
    keyed = torch.where(valid, ids, kv_length)
    sorted_ids, order = keyed.sort(dim=-1, stable=True)
    repeat = torch.zeros_like(valid)
    repeat[..., 1:] = sorted_ids[..., 1:] == sorted_ids[..., :-1]
    first = torch.empty_like(valid).scatter_(-1, order, ~repeat)
    return valid & first


def sparse_gqa_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query row over the keys its route selects (the oracle).

    Args:
        query: [batch, queries, query_heads, head_dim], any float dtype (float64 for gradcheck).
        key: [batch, kv_length, kv_heads, head_dim], query_heads % kv_heads == 0.
        value: [batch, kv_length, kv_heads, head_dim].
        token_ids: integer [batch, queries, W] (shared by every KV group) or
            [batch, kv_heads, queries, W] (one route per KV group); global key ids; ids outside
            [0, kv_length) (−1 by convention) are padding; repeats count once.
        softmax_scale: defaults to head_dim ** -0.5.
        query_chunk: queries gathered at once (bounds memory; never changes results).
        return_lse: also return the log-sum-exp of the scaled scores.
    Returns:
        [batch, queries, query_heads, head_dim] in query.dtype; rows with no valid id are 0 and get
        zero gradients. Scores and softmax run in FP32 (float64 for float64 inputs). With
        `return_lse`, `(out, lse)`: lse float32 [batch, queries, query_heads], the natural log of
        `Σ exp(scale · q · k)` over the row's distinct valid keys, −inf for a row with none,
        detached (no gradient).
    """
    batch, queries, query_heads, head_dim = query.shape
    kv_length, kv_heads = key.shape[1], key.shape[2]
    group = query_heads // kv_heads
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    if token_ids.dim() == 3:
        token_ids = token_ids.unsqueeze(1).expand(batch, kv_heads, queries, token_ids.shape[-1])
    batch_index = torch.arange(batch, device=query.device).view(batch, 1, 1, 1)
    head_index = torch.arange(kv_heads, device=query.device).view(1, 1, kv_heads, 1)
    outputs, lses = [], []
    for start in range(0, queries, query_chunk):
        stop = min(start + query_chunk, queries)
        ids = token_ids[:, :, start:stop].transpose(1, 2)  # [B, Qc, Hkv, W]
        keep = route_membership(ids, kv_length)
        safe = torch.where(keep, ids.long(), 0)
        # Gather only the selected rows of each KV group: [B, Qc, Hkv, W, D].
        k = key[batch_index, safe, head_index].to(compute)
        v = value[batch_index, safe, head_index].to(compute)
        q = query[:, start:stop].reshape(batch, stop - start, kv_heads, group, head_dim)
        scores = torch.einsum("bqhgd,bqhwd->bqhgw", q.to(compute), k) * scale
        scores = torch.where(keep.unsqueeze(3), scores, float("-inf"))
        peak = scores.amax(dim=-1, keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, 0.0).detach()
        weights = torch.exp(scores - peak)
        total = weights.sum(dim=-1, keepdim=True)
        probs = weights / torch.where(total > 0, total, 1.0)
        out = torch.einsum("bqhgw,bqhwd->bqhgd", probs, v)
        outputs.append(out.reshape(batch, stop - start, query_heads, head_dim).to(query.dtype))
        if return_lse:
            lses.append(row_lse(peak, total).reshape(batch, stop - start, query_heads))
    if return_lse:
        return torch.cat(outputs, dim=1), torch.cat(lses, dim=1)
    return torch.cat(outputs, dim=1)


def row_lse(peak: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """float32 natural log-sum-exp `peak + log(total)` of rows shifted by `peak` (detached; −inf
    where `total` is 0: the row holds no key)."""
    total = total.detach()
    return torch.where(total > 0, peak + torch.log(total), float("-inf")).float()


def dense_route_mask(token_ids: torch.Tensor, kv_length: int, query_heads: int) -> torch.Tensor:
    """bool [batch, query_heads, queries, kv_length] membership (small sizes only: tests)."""
    if token_ids.dim() == 3:
        token_ids = token_ids.unsqueeze(1)
    batch, route_heads, queries, _ = token_ids.shape
    ids = token_ids.long()
    valid = (ids >= 0) & (ids < kv_length)
    mask = torch.zeros(
        batch, route_heads, queries, kv_length + 1, dtype=torch.bool, device=ids.device
    )
    mask.scatter_(-1, torch.where(valid, ids, kv_length), True)
    mask = mask[..., :kv_length]
    return mask.repeat_interleave(query_heads // route_heads, dim=1)
