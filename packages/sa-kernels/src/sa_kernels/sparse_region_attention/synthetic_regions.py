"""Synthetic region layouts and CSA-like selections for tests and benchmarks.

`region_layout` lays documents out one after another in each batch row (padding after them) and cuts
each document into regions of `region_size` tokens restarting at its start (SEMANTICS §1.2), so a
document's last region may be short. `csa_selection` draws, per (batch, group, query), what the
Step-5 indexer would emit: every region of the query's document up to its own when at most `topk`
precede it (dense-equivalent), else `topk` random earlier regions of the document plus its own;
ascending, unused slots = the region count.
"""

import torch

# Query rows drawn per step (bounds the [batch, groups, rows, regions] random scores).
_SCORE_ELEMENTS = 1 << 25


def region_layout(
    document_lengths: list[list[int]],
    kv_length: int,
    region_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Regions of documents laid out from row 0 of each batch row, padding after them.

    Args:
        document_lengths: per batch row, its documents' token counts (sum <= kv_length).
        kv_length: key rows per batch row.
        region_size: tokens per region.
    Returns:
        region_sources: int32 [batch, regions, region_size], key rows, -1 past a short last region
            and for the regions a batch row does not have (regions = the largest count).
        token_regions: int64 [batch, kv_length], each token's region, -1 for padding.
        first_regions: int64 [batch, kv_length], the first region of each token's document, -1 for
            padding.
    """
    batch = len(document_lengths)
    token_regions = torch.full((batch, kv_length), -1, dtype=torch.int64)
    first_regions = torch.full((batch, kv_length), -1, dtype=torch.int64)
    counts = []
    for b, lengths in enumerate(document_lengths):
        if sum(lengths) > kv_length:
            raise ValueError(
                f"region_layout: documents of row {b} hold {sum(lengths)} tokens; kv_length is "
                f"{kv_length}"
            )
        start, region = 0, 0
        for length in lengths:
            local = torch.arange(length)
            token_regions[b, start : start + length] = region + local // region_size
            first_regions[b, start : start + length] = region
            start += length
            region += -(-length // region_size)
        counts.append(region)
    regions = max(1, *counts)
    region_sources = torch.full((batch, regions + 1, region_size), -1, dtype=torch.int32)
    rows = torch.arange(kv_length).expand(batch, -1)
    valid = token_regions >= 0
    # offset of each token inside its region: tokens of one region are consecutive rows
    first_row = torch.full((batch, regions + 1), kv_length, dtype=torch.int64)
    slot = torch.where(valid, token_regions, regions)
    first_row.scatter_reduce_(1, slot, rows, reduce="amin")
    offset = rows - first_row.gather(1, slot)
    flat = (slot * region_size + torch.where(valid, offset, 0)).view(batch, -1)
    region_sources.view(batch, -1).scatter_(
        1, torch.where(valid.view(batch, -1), flat, regions * region_size), rows.to(torch.int32)
    )
    region_sources[:, regions] = -1
    return (
        region_sources[:, :regions].contiguous().to(device),
        token_regions.to(device),
        first_regions.to(device),
    )


def csa_selection(
    token_regions: torch.Tensor,
    first_regions: torch.Tensor,
    regions: int,
    *,
    groups: int,
    topk: int,
    query_start: int = 0,
    queries: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """int32 [batch, groups, queries, min(topk, regions) + 1]: CSA-like region ids per (batch,
    group, query) for queries at global rows query_start … query_start + queries − 1 (default: to
    the end); padding queries select nothing."""
    batch, kv_length = token_regions.shape
    device = token_regions.device
    queries = kv_length - query_start if queries is None else queries
    keep = min(topk, regions)
    out = torch.full((batch, groups, queries, keep + 1), regions, dtype=torch.int32, device=device)
    step = max(1, _SCORE_ELEMENTS // max(1, batch * groups * regions))
    region = torch.arange(regions, device=device)
    for start in range(0, queries, step):
        stop = min(start + step, queries)
        own = token_regions[:, query_start + start : query_start + stop].view(batch, 1, -1, 1)
        first = first_regions[:, query_start + start : query_start + stop].view(batch, 1, -1, 1)
        candidate = (region >= first) & (region < own)  # earlier regions of the document
        scores = torch.rand(
            batch, groups, stop - start, regions, generator=generator, device=device
        )
        scores = torch.where(candidate, scores, -1.0)
        best, picked = scores.topk(keep, dim=-1) if keep else (scores[..., :0], None)
        ids = torch.where(best >= 0, picked, regions) if keep else best.long()
        ids = torch.cat([ids, torch.where(own >= 0, own, regions).expand(-1, groups, -1, 1)], -1)
        out[:, :, start:stop] = ids.sort(dim=-1).values.to(torch.int32)
    return out
