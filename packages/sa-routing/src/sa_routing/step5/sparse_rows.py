"""Writing one score tile's kept regions into the selection: its sparse rows only, in one pass.

Per tile the selection holds `[G, n, topk]` kept positions (int64, ascending, relative to the tile's
region chunk); a sparse row's slots become `position + offset`, then its current region. As PyTorch
ops that is an add, a cast, a concatenation, a select and a copy over the tile (about 4.6 ms of a
128k forward on the H200, 2026-11-30); the kernel reads the positions once and writes int32 once.
"""

import torch
import triton
import triton.language as tl

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
    _write_sparse_rows_kernel[(groups * n,)](
        rows,
        kept,
        current,
        sparse,
        offset,
        n,
        topk,
        *rows.stride()[:3],
        *kept.stride(),
        current.stride(0),
        sparse.stride(0),
        BLOCK=triton.next_power_of_2(topk + 1),
    )


@triton.jit
def _write_sparse_rows_kernel(
    rows_ptr,
    kept_ptr,
    current_ptr,
    sparse_ptr,
    offset,
    n,
    topk,
    so_g,
    so_q,
    so_s,
    sk_g,
    sk_q,
    sk_s,
    s_current,
    s_sparse,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    g = (pid // n).to(tl.int64)
    i = (pid % n).to(tl.int64)
    slot = tl.arange(0, BLOCK)
    is_sparse = (
        tl.load(sparse_ptr + i * s_sparse + slot * 0) != 0
    )  # a vector: the interpreter's masks
    ids = tl.load(kept_ptr + g * sk_g + i * sk_q + slot * sk_s, mask=slot < topk, other=0) + offset
    ids = tl.where(slot < topk, ids, tl.load(current_ptr + i * s_current))
    tl.store(
        rows_ptr + g * so_g + i * so_q + slot * so_s,
        ids.to(tl.int32),
        mask=(slot <= topk) & is_sparse,
    )
