"""The oracle of `region_summaries`: plain PyTorch, each region pooled on its own from the token walk
of `metadata.reference.reference_regions`."""

import torch

from ..metadata.reference import reference_regions


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
