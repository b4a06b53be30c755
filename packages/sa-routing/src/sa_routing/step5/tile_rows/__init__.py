"""Writing one score tile's rows of the selection in one pass: kept regions on its sparse rows, the
dense ids on the others.

Per tile the selection holds `[G, n, topk]` kept positions (int64, ascending, relative to the tile's
region chunk); a sparse row's slots become `position + offset`, then its current region. As PyTorch
ops (`reference.py`) that is an add, a cast, a concatenation, a select and a copy over the tile
(about 4.6 ms of a 128k forward on the H200); the kernel (`triton_kernels.py`, imported only where
it runs) reads the positions once and writes int32 once. Where `stable_topk` already wrote a
call's kept ids into the selection (`kept=None`), only the current regions and the dense rows are
left to write.
"""

import torch

from sa_kernels.backend import resolve_backend

from .reference import write_tile_rows_reference


def write_tile_rows(
    out: torch.Tensor,
    batch_row: int,
    first_query: int,
    kept: torch.Tensor | None,
    offset: int,
    current: torch.Tensor,
    sparse: torch.Tensor,
    dense: torch.Tensor,
    fill: int,
    *,
    backend: str = "auto",
) -> None:
    """`out[batch_row, g, first_query + i] = [kept[g, i] + offset..., current[i]]` where `sparse[i]`,
    else `dense[i]` padded with `fill` (every group alike). With `kept=None` the sparse rows' first
    `topk` slots already hold their ids and only their last slot is written.

    Args:
        out: int32 [B, G, Q, topk + 1], the selection; the tile's rows are written in place.
        batch_row, first_query: where the tile's rows start in `out`.
        kept: int64 [G, n, topk] kept positions of the tile's rows (any strides), or None: already
            in place.
        offset: added to every kept position (the region chunk's first region); unused with None.
        current: int64 [n], each row's current region (its last slot).
        sparse: bool [n], the rows that take `kept`.
        dense: int32 [n, w], w <= topk + 1: the ids of the other rows (`dense_region_ids`).
        fill: the slots of those rows past w (the unused sentinel, `region_count`).
        backend: "auto" (Triton on CUDA, PyTorch on CPU), "triton" or "reference".
    """
    n = current.shape[0]
    if n == 0:
        return
    rows = out[batch_row, :, first_query : first_query + n]
    tensors = (out, current, sparse, dense) if kept is None else (out, kept, current, sparse, dense)
    if resolve_backend("write_tile_rows", backend, *tensors) == "reference":
        write_tile_rows_reference(rows, kept, offset, current, sparse, dense, fill)
        return
    from .triton_kernels import write_tile_rows_triton

    write_tile_rows_triton(rows, kept, offset, current, sparse, dense, fill)
