"""The GPU block scorer: `Σ_h relu(q_h · k_b) / sqrt(D)` for a chunk of query rows, FP32, in one kernel.

Each program scores a `BLOCK_M × BLOCK_N` tile of (row, block) pairs: for 16-bit operands the key tile is
loaded once and each head is one `tl.dot` over the whole (padded) head dim with FP32 accumulation (FP32
operands: exact dots over 32-wide head-dim slices, summed in order); each head's dot is relu'd and added to the
tile's sum in head order, scaled by `1/sqrt(D)`, and blocks a row cannot see (`b >= (p + 1) // c`) are
set to −inf. Tiles wholly past their last row's visible blocks only store −inf. No per-head
`[rows, blocks]` tensor exists.

Determinism: one fixed configuration per backend (no autotuning), the same instruction sequence for
every (row, block) pair whatever its tile, rows and offsets not specialised, so a score does not depend
on the chunk or tile its row lands in and chunking never changes the routes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sa_kernels.backend import triton_interpret
from sa_kernels.triton_dot import fp32_dot

_BLOCK_M, _BLOCK_N, _NUM_WARPS = 128, 128, 8
"""The one compiled configuration for 16-bit operands (H200: 4 × [128, 128] × [128, 128] BF16 dots per program)."""
_FP32_BLOCK_M, _FP32_BLOCK_N, _FP32_BLOCK_K, _FP32_NUM_WARPS = 64, 64, 32, 4
"""FP32 operands: exact (IEEE) dots over 32-wide head-dim slices; one [128, 128, 128] IEEE dot per head
unrolls into so many FMAs that Triton took 68 s to compile it on the H200."""
_INTERPRET_BLOCK_M, _INTERPRET_BLOCK_N = 32, 16
"""Small tiles under the interpreter, so that small test shapes still span several tiles."""


@triton.jit(do_not_specialize=["rows", "columns", "first_position"])
def _qsa_scores_kernel(
    q_ptr,
    k_ptr,
    out_ptr,
    rows,
    columns,
    first_position,
    compress_ratio,
    dim,
    scale,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_or,
    HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = r < rows
    n_ok = n < columns
    out_ptrs = out_ptr + r.to(tl.int64)[:, None] * stride_or + n[None, :]
    out_ok = r_ok[:, None] & n_ok[None, :]
    last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, rows) - 1
    tile_visible = (first_position + last_row + 1) // compress_ratio
    if pid_n * BLOCK_N >= tile_visible:
        tl.store(out_ptrs, tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32), mask=out_ok)
    else:
        q_rows = q_ptr + r.to(tl.int64)[:, None] * stride_qr
        k_rows = k_ptr + n.to(tl.int64)[:, None] * stride_kb
        score = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if BLOCK_K == BLOCK_D:  # 16-bit operands: one dot per head over the whole head dim
            d = tl.arange(0, BLOCK_D)
            d_ok = d < dim
            keys_t = tl.trans(
                tl.load(k_rows + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            )
            for h in tl.static_range(HEADS):
                q = tl.load(
                    q_rows + h * stride_qh + d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
                score += tl.maximum(fp32_dot(q, keys_t, IEEE, UPCAST), 0.0)
        else:  # FP32 operands: exact products are long to compile, so a loop over head-dim slices
            for h in tl.static_range(HEADS):
                head = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for d0 in range(0, dim, BLOCK_K):
                    d = d0 + tl.arange(0, BLOCK_K)
                    d_ok = d < dim
                    keys_t = tl.trans(
                        tl.load(k_rows + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                    )
                    q = tl.load(
                        q_rows + h * stride_qh + d[None, :],
                        mask=r_ok[:, None] & d_ok[None, :],
                        other=0.0,
                    )
                    head += fp32_dot(q, keys_t, IEEE, UPCAST)
                score += tl.maximum(head, 0.0)
        score = score * scale
        visible = (first_position + r + 1) // compress_ratio
        score = tl.where(n[None, :] < visible[:, None], score, float("-inf"))
        tl.store(out_ptrs, score, mask=out_ok)


def score_dtype(queries: torch.Tensor, keys: torch.Tensor) -> torch.dtype:
    """The operand dtype of the kernel: BF16/FP16 when both inputs share it, FP32 otherwise."""
    if queries.dtype == keys.dtype and queries.dtype in (torch.bfloat16, torch.float16):
        return queries.dtype
    return torch.float32


def qsa_block_scores_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    first_position: int,
    compress_ratio: int,
    columns: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causally masked block scores of a chunk of consecutive query rows (no validation: internal).

    `score[i, b] = Σ_h relu(q[i, h] · k[b]) / sqrt(D)` with FP32 accumulation, and −inf where
    `b >= (first_position + i + 1) // compress_ratio` (the block is not complete before row i).

    Args:
        queries: [rows, heads, dim], `score_dtype`'s dtype, last-dim stride 1; row i is at
            document position `first_position + i`.
        keys: [blocks >= columns, dim], queries' dtype, last-dim stride 1: the document's blocks.
        columns: blocks to score (default: all of `keys`).
        out: optional contiguous float32 [rows, columns] to write into.
    Returns:
        float32 [rows, columns].
    """
    rows, heads, dim = queries.shape
    columns = keys.shape[0] if columns is None else columns
    if out is None:
        out = torch.empty(rows, columns, dtype=torch.float32, device=queries.device)
    if rows == 0 or columns == 0:
        return out
    interpret = triton_interpret()
    ieee = queries.dtype == torch.float32
    block_d = max(16, triton.next_power_of_2(dim))
    block_m, block_n, block_k, num_warps = _BLOCK_M, _BLOCK_N, block_d, _NUM_WARPS
    if ieee:
        block_m, block_n, num_warps = _FP32_BLOCK_M, _FP32_BLOCK_N, _FP32_NUM_WARPS
        block_k = min(_FP32_BLOCK_K, block_d)
    if interpret:
        block_m, block_n = _INTERPRET_BLOCK_M, _INTERPRET_BLOCK_N
    grid = (triton.cdiv(rows, block_m), triton.cdiv(columns, block_n))
    _qsa_scores_kernel[grid](
        queries,
        keys,
        out,
        rows,
        columns,
        first_position,
        compress_ratio,
        dim,
        1.0 / math.sqrt(dim),
        queries.stride(0),
        queries.stride(1),
        keys.stride(0),
        out.stride(0),
        HEADS=heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_K=block_k,
        IEEE=ieee,
        UPCAST=interpret and not ieee,
        num_warps=num_warps,
    )
    return out
