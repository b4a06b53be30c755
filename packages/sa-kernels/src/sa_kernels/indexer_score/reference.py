"""The oracle for indexer scoring: `Σ_h w · relu(q_h · s_r)` in FP32 (FP64 for FP64 inputs), no 1/sqrt(D)."""

import torch


def indexer_score_tile(
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    start: int,
    stop: int,
    candidate_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """query [B, Q, G, H, D], weights [B, Q, G, H], summary [B, R, D] → [B, G, stop − start, R];
    with `candidate_bounds` (first, past) int64 [B, stop − start], −inf outside `[first, past)`."""
    ct = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query[:, start:stop].to(ct)
    w = weights[:, start:stop].to(ct)
    s = summary.to(ct)
    dots = torch.einsum("bqghd,brd->bgqhr", q, s)
    scores = (dots.relu() * w.permute(0, 2, 1, 3).unsqueeze(-1)).sum(3)
    if candidate_bounds is None:
        return scores
    first, past = (bound[:, None, :, None] for bound in candidate_bounds)
    region = torch.arange(summary.shape[1], device=scores.device)
    return scores.masked_fill((region < first) | (region >= past), float("-inf"))
