"""The PyTorch path of `write_tile_rows` (CPU, `backend="reference"`) and the oracle of its kernels."""

import torch


def write_tile_rows_reference(
    rows: torch.Tensor,
    kept: torch.Tensor | None,
    offset: int,
    current: torch.Tensor,
    sparse: torch.Tensor,
    dense: torch.Tensor,
    fill: int,
) -> None:
    """rows: int32 [G, n, topk + 1] view of the selection, written in place; the other arguments as
    `write_tile_rows`."""
    groups, n, slots = rows.shape
    topk = slots - 1
    ids = rows[..., :topk] if kept is None else (kept + offset).to(torch.int32)
    last = current.to(torch.int32).view(1, n, 1).expand(groups, n, 1)
    padded = torch.nn.functional.pad(dense, (0, topk + 1 - dense.shape[-1]), value=fill)
    rows.copy_(torch.where(sparse.view(1, n, 1), torch.cat([ids, last], dim=-1), padded))
