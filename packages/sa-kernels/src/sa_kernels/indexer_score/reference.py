"""The oracle for indexer scoring: `Σ_h w · relu(q_h · s_r)` in FP32 (FP64 for FP64 inputs), no 1/sqrt(D)."""

import torch


def indexer_score_tile(
    query: torch.Tensor, weights: torch.Tensor, summary: torch.Tensor, start: int, stop: int
) -> torch.Tensor:
    """query [B, Q, G, H, D], weights [B, Q, G, H], summary [B, R, D] → [B, G, stop − start, R]."""
    ct = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query[:, start:stop].to(ct)
    w = weights[:, start:stop].to(ct)
    s = summary.to(ct)
    dots = torch.einsum("bqghd,brd->bgqhr", q, s)
    return (dots.relu() * w.permute(0, 2, 1, 3).unsqueeze(-1)).sum(3)
