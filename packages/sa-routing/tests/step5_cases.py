"""Test support for the Step-5 tests (not part of the package): positions of packed documents."""

import torch


def document_positions(lengths: list[int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of back-to-back documents, then a padding tail up to `total` tokens.

    Returns:
        (positions int64 [total], document-relative, 0 on the tail; padding bool [total], True on the tail).
    """
    pos = (
        torch.cat([torch.arange(n) for n in lengths])
        if lengths
        else torch.zeros(0, dtype=torch.int64)
    )
    pad = torch.arange(total) >= pos.numel()
    return torch.cat([pos, torch.zeros(total - pos.numel(), dtype=torch.int64)]), pad
