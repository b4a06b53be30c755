"""The Triton kernel of `write_sparse_rows`: one program per (group, row) of a tile."""

import torch
import triton
import triton.language as tl


def write_sparse_rows_triton(
    rows: torch.Tensor,
    kept: torch.Tensor,
    offset: int,
    current: torch.Tensor,
    sparse: torch.Tensor,
) -> None:
    """rows: int32 [G, n, topk + 1] view of the selection; the other arguments as `write_sparse_rows`."""
    groups, n, topk = kept.shape
    _write_sparse_rows_kernel[(groups * n,)](
        rows,
        kept,
        current,
        sparse,
        offset,
        n,
        topk,
        *rows.stride(),
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
