"""`stable_topk` for rows that fit one program: radix select on order-preserving keys, then a prefix sum.

One program owns one row. It loads the row once into registers as 32-bit keys whose unsigned order is
the scores' order (`-0.0` folded into `+0.0`, `-inf` lowest, padding below everything). The k-th best key
`t` is built from the top, `DIGIT_BITS` bits per step: one reduction counts the keys reaching each
candidate digit, and the largest digit that at least k keys reach is kept. Then every key above `t` is kept, and of the keys equal to `t` the first `k - #above`
positions (an exclusive prefix count). A prefix count over the kept mask gives each kept position
its output slot, so positions come out ascending without a sort. One read of the row, k writes,
no workspace in memory, no host sync.
"""

import torch
import triton
import triton.language as tl

MAX_ROW = 32768
"""Longest row the kernel holds in registers (larger rows take the PyTorch path)."""


@triton.jit
def _stable_topk_kernel(
    scores_ptr,
    out_ptr,
    n,
    k,
    stride_row,
    stride_out,
    BLOCK_N: tl.constexpr,
    DIGIT_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # 2-D [1, BLOCK_N] so that the digit counts below broadcast without a layout change
    offsets = tl.arange(0, BLOCK_N)[None, :]
    in_row = offsets < n
    x = tl.load(scores_ptr + row * stride_row + offsets, mask=in_row, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in torch.sort
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full([1, BLOCK_N], 0x80000000, tl.uint32)
    keys = tl.where((bits & sign) != 0, ~bits, bits | sign)
    keys = tl.where(in_row, keys, 0)  # -inf maps to 0x007fffff, so padding sorts below every score

    # Radix select, DIGIT_BITS bits per step: count the keys reaching each candidate digit (one
    # reduction for all digits), keep the largest digit that at least k keys reach.
    digits = tl.arange(0, 1 << DIGIT_BITS).to(tl.uint32)[:, None]
    threshold = tl.zeros([1, 1], dtype=tl.uint32)
    shift = tl.full([], 32, tl.uint32)
    for _ in range(32 // DIGIT_BITS):
        shift = shift - DIGIT_BITS
        candidates = threshold | (digits << shift)
        reaching = tl.sum((keys >= candidates).to(tl.int32), axis=1, keep_dims=True)
        chosen = tl.sum((reaching >= k).to(tl.int32), axis=0, keep_dims=True) - 1
        threshold = threshold | (chosen.to(tl.uint32) << shift)

    above = keys > threshold
    tied = keys == threshold
    still_needed = k - tl.sum(above.to(tl.int32), axis=1, keep_dims=True)
    tied_before = tl.cumsum(tied.to(tl.int32), axis=1) - tied.to(tl.int32)
    kept = above | (tied & (tied_before < still_needed))
    slot = tl.cumsum(kept.to(tl.int32), axis=1) - 1
    tl.store(out_ptr + row * stride_out + slot, offsets.to(tl.int64), mask=kept)


def default_num_warps(block: int) -> int:
    """The H200 sweep's best (`bench_stable_topk.py --sweep`, 2026-11-29): 4 warps up to 4096 entries,
    8 up to 16384, 32 for 32768."""
    if block <= 4096:
        return 4
    return 8 if block <= 16384 else 32


DIGIT_BITS = 2
"""Bits resolved per radix step (1, 2 or 4): fewer, wider steps trade compares for reductions."""


def stable_topk_rows(
    scores: torch.Tensor,
    k: int,
    *,
    _num_warps: int | None = None,
    _digit_bits: int | None = None,
) -> torch.Tensor:
    """`stable_topk` of every row of `scores` (no validation: internal).

    Args:
        scores: [rows, n] float32/bfloat16/float16, last-dim stride 1, `1 <= k <= n <= MAX_ROW`.
    Returns:
        int64 [rows, k], ascending positions per row.
        `_num_warps` and `_digit_bits` override the launch's warps and radix step (benchmark
        sweeps; the result does not change).
    """
    rows, n = scores.shape
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    block = max(16, triton.next_power_of_2(n))
    _stable_topk_kernel[(rows,)](
        scores,
        out,
        n,
        k,
        scores.stride(0),
        out.stride(0),
        BLOCK_N=block,
        DIGIT_BITS=_digit_bits or DIGIT_BITS,
        num_warps=_num_warps or default_num_warps(block),
    )
    return out
