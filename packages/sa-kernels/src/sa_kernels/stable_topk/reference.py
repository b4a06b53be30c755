"""The oracle of `stable_topk`: one full stable descending sort, then the first k positions, ascending."""

import torch


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1) -> torch.Tensor:
    """Positions of the k best entries along `dim` by (score descending, position ascending), ascending.

    A stable descending sort keeps equal scores in position order, so its first k positions are
    exactly the wanted set. O(n log n) per row; the fast op gets the same set without sorting.
    """
    order = torch.sort(scores, dim=dim, descending=True, stable=True).indices
    return torch.sort(order.narrow(dim, 0, k), dim=dim).values
