"""The Triton kernels of `write_tile_rows`: one program per (group, row) of a tile writing the kept
ids; where they are in place already, one per (group, block of rows) writing the current regions
and the rare dense rows (a program per row that wrote one slot took 0.40 ms of a 131 072-token
forward on the H200)."""

import torch
import triton
import triton.language as tl


def write_tile_rows_triton(
    rows: torch.Tensor,
    kept: torch.Tensor | None,
    offset: int,
    current: torch.Tensor,
    sparse: torch.Tensor,
    dense: torch.Tensor,
    fill: int,
) -> None:
    """rows: int32 [G, n, topk + 1] view of the selection; the other arguments as `write_tile_rows`."""
    groups, n, slots = rows.shape
    topk = slots - 1
    if kept is None:
        _write_current_and_dense_kernel[(groups, triton.cdiv(n, IN_PLACE_ROWS))](
            rows,
            current,
            sparse,
            dense,
            fill,
            n,
            topk,
            dense.shape[-1],
            *rows.stride(),
            current.stride(0),
            sparse.stride(0),
            *dense.stride(),
            ROWS=IN_PLACE_ROWS,
            SLOTS=min(128, triton.next_power_of_2(slots)),
        )
        return
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


IN_PLACE_ROWS = 128


@triton.jit
def _write_current_and_dense_kernel(
    rows_ptr,
    current_ptr,
    sparse_ptr,
    dense_ptr,
    fill,
    n,
    topk,
    dense_width,
    so_g,
    so_q,
    so_s,
    s_current,
    s_sparse,
    sd_q,
    sd_s,
    ROWS: tl.constexpr,
    SLOTS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    in_tile = i < n
    i = i.to(tl.int64)
    is_sparse = tl.load(sparse_ptr + i * s_sparse, mask=in_tile, other=0) != 0
    out_rows = rows_ptr + g * so_g + i * so_q
    current = tl.load(current_ptr + i * s_current, mask=in_tile & is_sparse, other=0)
    tl.store(out_rows + topk * so_s, current.to(tl.int32), mask=in_tile & is_sparse)
    dense_rows = in_tile & ~is_sparse
    if tl.max(dense_rows.to(tl.int32), axis=0) > 0:  # rare inside a scoring call
        for first in range(0, topk + 1, SLOTS):
            slot = first + tl.arange(0, SLOTS)
            ids = tl.load(
                dense_ptr + i[:, None] * sd_q + slot[None, :] * sd_s,
                mask=dense_rows[:, None] & (slot < dense_width)[None, :],
                other=fill,
            )
            tl.store(
                out_rows[:, None] + slot[None, :] * so_s,
                ids.to(tl.int32),
                mask=dense_rows[:, None] & (slot <= topk)[None, :],
            )
