"""Writing one score tile's kept regions into the selection: its sparse rows only, in one pass.

Per tile the selection holds `[G, n, topk]` kept positions (int64, ascending, relative to the tile's
region chunk); a sparse row's slots become `position + offset`, then its current region. As PyTorch
ops that is an add, a cast, a concatenation, a select and a copy over the tile (about 4.6 ms of a
128k forward on the H200, 2026-11-30); the kernel (`sparse_rows_triton`, imported only where it
runs) reads the positions once and writes int32 once.
"""

import torch

from sa_kernels.backend import resolve_backend


def write_sparse_rows(
    out: torch.Tensor,
    batch_row: int,
    first_query: int,
    kept: torch.Tensor,
    offset: int,
    current: torch.Tensor,
    sparse: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """`out[batch_row, g, first_query + i] = [kept[g, i] + offset..., current[i]]` where `sparse[i]`.

    Args:
        out: int32 [B, G, Q, topk + 1], the selection; written in place, rows that are not sparse are
            left as they are.
        batch_row, first_query: where the tile's rows start in `out`.
        kept: int64 [G, n, topk] kept positions of the tile's rows (any strides).
        offset: added to every kept position (the region chunk's first region).
        current: int64 [n], each row's current region (its last slot).
        sparse: bool [n], the rows to write.
        backend: "auto" (Triton on CUDA, PyTorch on CPU), "triton" or "reference".
    """
    groups, n, topk = kept.shape
    if n == 0:
        return
    rows = out[batch_row, :, first_query : first_query + n]
    if resolve_backend("write_sparse_rows", backend, out, kept, current, sparse) == "reference":
        ids = (kept + offset).to(torch.int32)
        last = current.to(torch.int32).view(1, n, 1).expand(groups, n, 1)
        rows.copy_(torch.where(sparse.view(1, n, 1), torch.cat([ids, last], dim=-1), rows))
        return
    from .sparse_rows_triton import write_sparse_rows_triton

    write_sparse_rows_triton(rows, kept, offset, current, sparse)
