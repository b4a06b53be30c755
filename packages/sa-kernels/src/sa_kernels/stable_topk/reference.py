"""The oracle of `stable_topk`: one full stable descending sort, then the first k positions, ascending."""

import torch


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1) -> torch.Tensor:
    """Positions of the k best entries along `dim` by (score descending, position ascending), ascending.

    A stable descending sort keeps equal scores in position order, so its first k positions are
    exactly the wanted set. O(n log n) per row; the fast op gets the same set without sorting.
    """
    order = torch.sort(scores, dim=dim, descending=True, stable=True).indices
    return torch.sort(order.narrow(dim, 0, k), dim=dim).values


def group_maxima(scores: torch.Tensor, group: int) -> torch.Tensor:
    """[..., n] → [..., cdiv(n, group)]: the largest entry of each run of `group` positions, the
    last run possibly shorter (what `stable_topk(..., group_maxima=...)` takes)."""
    n = scores.shape[-1]
    runs = -(-n // group)
    padded = torch.nn.functional.pad(scores, (0, runs * group - n), value=float("-inf"))
    return padded.reshape(*scores.shape[:-1], runs, group).amax(dim=-1)
