"""The Triton kernel of `write_tile_rows`: one program per (group, row) of a tile."""

import torch
import triton
import triton.language as tl


def write_tile_rows_triton(
    rows: torch.Tensor,
    kept: torch.Tensor,
    offset: int,
    current: torch.Tensor,
    sparse: torch.Tensor,
    dense: torch.Tensor,
    fill: int,
) -> None:
    """rows: int32 [G, n, topk + 1] view of the selection; the other arguments as `write_tile_rows`."""
    groups, n, topk = kept.shape
    _write_tile_rows_kernel[(groups * n,)](
        rows,
        kept,
        current,
        sparse,
        dense,
        offset,
        fill,
        n,
        topk,
        dense.shape[-1],
        *rows.stride(),
        *kept.stride(),
        current.stride(0),
        sparse.stride(0),
        *dense.stride(),
        BLOCK=triton.next_power_of_2(topk + 1),
    )


@triton.jit
def _write_tile_rows_kernel(
    rows_ptr,
    kept_ptr,
    current_ptr,
    sparse_ptr,
    dense_ptr,
    offset,
    fill,
    n,
    topk,
    dense_width,
    so_g,
    so_q,
    so_s,
    sk_g,
    sk_q,
    sk_s,
    s_current,
    s_sparse,
    sd_q,
    sd_s,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    g = (pid // n).to(tl.int64)
    i = (pid % n).to(tl.int64)
    slot = tl.arange(0, BLOCK)
    is_sparse = (
        tl.load(sparse_ptr + i * s_sparse + slot * 0) != 0
    )  # a vector: the interpreter's masks
    ids = tl.load(
        kept_ptr + g * sk_g + i * sk_q + slot * sk_s, mask=(slot < topk) & is_sparse, other=0
    )
    ids = tl.where(slot < topk, ids + offset, tl.load(current_ptr + i * s_current))
    dense = tl.load(
        dense_ptr + i * sd_q + slot * sd_s, mask=(slot < dense_width) & ~is_sparse, other=fill
    )
    tl.store(
        rows_ptr + g * so_g + i * so_q + slot * so_s,
        tl.where(is_sparse, ids, dense).to(tl.int32),
        mask=slot <= topk,
    )
