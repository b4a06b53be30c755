"""Region summaries: gather each region's key/logit rows, pool them with a per-dimension softmax.

The oracle, `reference.py`, pools each region on its own from a token-by-token walk."""

import torch

from sa_kernels import round_to_e4m3

from ..layouts import RegionMetadata

SUMMARY_CHUNK_REGIONS = 16384
"""Regions summarised per call of `_summarize_regions` (about 50 KB of temporaries per region, 0.8 GB
per call at this size, below the scoring calls' peak): each call is some twenty small launches,
whose host time the GPU waited for at the start of a forward (4096 took 0.99 ms of host time at
65 536 tokens on the H200's host, docs/benchmarks.md)."""


def gather_region_payload(
    keys: torch.Tensor, logits: torch.Tensor, sources: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and logit rows of the given regions; an integer gather, no float arithmetic.

    Pass only the regions a rank needs (slices of `RegionMetadata.region_sources`); the result is
    safe to `torch.compile`.

    Args:
        keys: [batch, global_length, proxy_dim] BF16, normalised and rotated indexer keys.
        logits: [batch, global_length, proxy_dim], compression logits `z`.
        sources: int32 [batch, regions, region_size], key rows, -1 where missing.
        valid: bool [batch, regions, region_size], `sources >= 0`.
    Returns:
        `(key_rows, logit_rows)`, each [batch, regions, region_size, proxy_dim] in its input dtype; slots
        that are not valid hold row 0 of their batch and must be masked by the caller.
    Raises:
        ValueError: shapes disagree.
    """
    _check_payload_args("gather_region_payload", keys, logits, sources, valid)
    batch, length, dim = keys.shape
    rows = sources.clamp(min=0)  # index_select takes int32 rows as they are
    if batch > 1:
        rows = (
            rows.to(torch.int64)
            + torch.arange(batch, device=keys.device).view(batch, 1, 1) * length
        )
    flat = rows.reshape(-1)
    key_rows = keys.reshape(batch * length, dim).index_select(0, flat).view(*sources.shape, dim)
    logit_rows = logits.reshape(batch * length, dim).index_select(0, flat).view(*sources.shape, dim)
    return key_rows, logit_rows


def region_summaries(
    keys: torch.Tensor, logits: torch.Tensor, metadata: RegionMetadata
) -> torch.Tensor:
    """Summaries of the regions the score tiles read: per region and dimension
    `Σ_t softmax_t(z_td) · k_td` over its valid tokens in FP32, rounded FP32 → BF16 → E4M3 → BF16.

    Args:
        keys: [B, S, proxy_dim] BF16, normalised and rotated indexer keys of the whole sequence
            `metadata` describes (B = `metadata.batch_size`, S = `metadata.global_length`).
        logits: [B, S, proxy_dim], compression logits `z` of the same tokens.
        metadata: `region_metadata(...)` of this forward and shard.
    Returns:
        BF16 [B, N, proxy_dim], N = `metadata.region_count`, every value representable in
        float8_e4m3fn: the regions in `metadata.summary_ranges`, zero elsewhere.
    Raises:
        ValueError: keys or logits are not floating [B, S, D] of `metadata`'s batch and length.
    """
    for name, t in (("keys", keys), ("logits", logits)):
        want = (metadata.batch_size, metadata.global_length)
        if t.dim() != 3 or tuple(t.shape[:2]) != want or not t.is_floating_point():
            raise ValueError(
                f"region_summaries: {name} must be floating [batch, global_length, D] with "
                f"(batch, global_length) = {want}; got {tuple(t.shape)} {t.dtype}"
            )
    batch, _, dim = keys.shape
    summary = torch.zeros(
        batch, metadata.region_count, dim, dtype=torch.bfloat16, device=keys.device
    )
    for b, first, past in metadata.summary_ranges:
        for c0 in range(first, past, SUMMARY_CHUNK_REGIONS):
            c1 = min(c0 + SUMMARY_CHUNK_REGIONS, past)
            summary[b, c0:c1] = _summarize_regions(
                keys[b : b + 1],
                logits[b : b + 1],
                metadata.region_sources[b : b + 1, c0:c1],
                metadata.region_source_valid[b : b + 1, c0:c1],
            )[0]
    return summary


def _summarize_regions(
    keys: torch.Tensor, logits: torch.Tensor, sources: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """`region_summaries` of the given regions: per region and dimension `Σ_t softmax_t(z_td) · k_td`
    in FP32, rounded FP32 → BF16 → E4M3 → BF16.

    Args: as `gather_region_payload`.
    Returns:
        BF16 [batch, regions, proxy_dim], every value representable in float8_e4m3fn; zero for a
        region with no valid token.
    Raises:
        ValueError: shapes disagree.
    """
    key_rows, logit_rows = gather_region_payload(keys, logits, sources, valid)
    mask = valid.unsqueeze(-1)
    z = logit_rows.float().masked_fill(~mask, float("-inf"))
    pooled = (torch.softmax(z, dim=-2) * key_rows.float()).sum(dim=-2)
    pooled = torch.where(valid.any(dim=-1, keepdim=True), pooled, 0.0)
    return round_to_e4m3(pooled.to(torch.bfloat16))


def _check_payload_args(
    fn: str, keys: torch.Tensor, logits: torch.Tensor, sources: torch.Tensor, valid: torch.Tensor
) -> None:
    if keys.dim() != 3 or logits.shape != keys.shape:
        raise ValueError(
            f"{fn}: keys and logits must both be [batch, global_length, proxy_dim]; "
            f"got {tuple(keys.shape)} and {tuple(logits.shape)}"
        )
    if sources.dim() != 3 or sources.shape[0] != keys.shape[0] or valid.shape != sources.shape:
        raise ValueError(
            f"{fn}: sources and valid must both be [batch={keys.shape[0]}, regions, region_size]; "
            f"got {tuple(sources.shape)} and {tuple(valid.shape)}"
        )
    if sources.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: sources must be int32 or int64; got {sources.dtype}")
    if valid.dtype != torch.bool:
        raise TypeError(f"{fn}: valid must be bool; got {valid.dtype}")
