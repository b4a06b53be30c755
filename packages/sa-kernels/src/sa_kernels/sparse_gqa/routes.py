"""Canonical routes: the one form every fast backend reads (built once, reused across layers)."""

import torch


def canonical_routes(token_ids: torch.Tensor, kv_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop padding and repeats so that each row is its distinct ids, ascending, then sentinels.

    Rows that already hold strictly ascending valid ids followed by padding (what the route
    selectors emit) are kept as they are; otherwise every row is sorted once and its repeats move,
    as sentinels, behind its distinct ids. Whole rows stay ascending, so a key range's slots are
    found by binary search (the gather backward's key-range passes). One host synchronisation (the
    ascending check). Ids that are already canonical, int32 and contiguous with every padding slot
    the sentinel (the Step-5 selection's region ids) are returned as they are, not copied: a
    recorded selection and its block mask then share one tensor.

    Args:
        token_ids: integer [batch, route_heads, queries, W]; ids outside [0, kv_length) are padding.
        kv_length: number of keys; also the sentinel.
    Returns:
        routes: int32 [batch, route_heads, queries, W], contiguous, every row ascending: its first
            `counts` slots hold its distinct valid ids, every later slot the sentinel `kv_length`.
        counts: int32 [batch, route_heads, queries], distinct valid ids per row.
    """
    # validity on the caller's dtype: an int64 id such as 2**32 + 3 must not wrap into a valid int32 id
    valid = (token_ids >= 0) & (token_ids < kv_length)
    sentinel = torch.full((), kv_length, dtype=torch.int32, device=token_ids.device)
    ids = torch.where(valid, token_ids.to(torch.int32), sentinel)
    reusable = False
    if ids.shape[-1] > 1:
        tail, head = ids[..., 1:], ids[..., :-1]
        ascending = ((tail > head) | (tail == kv_length)).all()
        if token_ids.dtype == torch.int32 and token_ids.is_contiguous():  # one sync for both
            ascending, reusable = torch.stack((ascending, (ids == token_ids).all())).tolist()
        if not bool(ascending):
            ids = ids.sort(dim=-1).values
            keep = ids < kv_length
            keep[..., 1:] &= ids[..., 1:] != ids[..., :-1]  # first occurrences of valid ids
            # a permutation, not a second sort: kept ids to the front in order, the rest behind them
            kept_before = torch.cumsum(keep, dim=-1, dtype=torch.int32)
            counts = kept_before[..., -1:]
            dropped_before = torch.arange(1, ids.shape[-1] + 1, device=ids.device) - kept_before
            slot = torch.where(keep, kept_before - 1, counts + dropped_before - 1)
            ids = torch.full_like(ids, kv_length).scatter_(
                -1, slot.long(), torch.where(keep, ids, sentinel)
            )
            return ids.contiguous(), counts.squeeze(-1).contiguous()
    counts = valid.sum(dim=-1, dtype=torch.int32)
    return (token_ids if reusable else ids.contiguous()), counts
