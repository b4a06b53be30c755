"""`stable_topk` for rows that fit one program: radix select on order-preserving keys, then a prefix sum.

One program owns one row. It loads the row once into registers as 32-bit keys whose unsigned order is
the scores' order (`-0.0` folded into `+0.0`, `-inf` lowest, padding below everything). The k-th best key
`t` is built bit by bit from the top: a candidate bit stays set when at least k keys reach the
candidate. Then every key above `t` is kept, and of the keys equal to `t` the first `k - #above`
positions (an exclusive prefix count). A prefix count over the kept mask gives each kept position
its output slot, so positions come out ascending without a sort: over the whole row at once from the
registers, or (`OUTPUT_TILE`) in tiles re-read from memory with the counts carried between tiles.
One or two reads of the row, k writes, no workspace in memory, no host sync.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _order_keys(scores_ptr, offsets, n):
    """uint32 keys whose unsigned order is the scores' order; positions at or past n get key 0."""
    in_row = offsets < n
    x = tl.load(scores_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in torch.sort
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(offsets.shape, 0x80000000, tl.uint32)
    keys = tl.where((bits & sign) != 0, ~bits, bits | sign)
    return tl.where(in_row, keys, 0)  # -inf maps to 0x007fffff, so padding sorts below every score


@triton.jit
def _stable_topk_kernel(
    scores_ptr,
    out_ptr,
    n,
    k,
    stride_row,
    stride_out,
    BLOCK_N: tl.constexpr,
    OUTPUT_TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_scores = scores_ptr + row * stride_row
    row_out = out_ptr + row * stride_out
    offsets = tl.arange(0, BLOCK_N)
    keys = _order_keys(row_scores, offsets, n)

    threshold = tl.zeros([], dtype=tl.uint32)
    bit = tl.full([], 0x80000000, tl.uint32)
    for _ in range(32):
        candidate = threshold | bit
        reaching = tl.sum((keys >= candidate).to(tl.int32), axis=0)
        threshold = tl.where(reaching >= k, candidate, threshold)
        bit = bit >> 1

    still_needed = k - tl.sum((keys > threshold).to(tl.int32), axis=0)
    if OUTPUT_TILE == 0:  # the whole row's prefix sums at once, from the keys held in registers
        above = keys > threshold
        tied = keys == threshold
        tied_before = tl.cumsum(tied.to(tl.int32), axis=0) - tied.to(tl.int32)
        kept = above | (tied & (tied_before < still_needed))
        slot = tl.cumsum(kept.to(tl.int32), axis=0) - 1
        tl.store(row_out + slot, offsets.to(tl.int64), mask=kept)
    else:  # re-read the row in tiles, carrying the counts: fewer live registers than whole-row sums
        tied_seen = tl.zeros([], dtype=tl.int32)
        kept_seen = tl.zeros([], dtype=tl.int32)
        for start in range(0, n, OUTPUT_TILE):
            tile = start + tl.arange(0, OUTPUT_TILE)
            tile_keys = _order_keys(row_scores, tile, n)
            above = tile_keys > threshold
            tied = ((tile_keys == threshold) & (tile < n)).to(tl.int32)
            tied_before = tied_seen + tl.cumsum(tied, axis=0) - tied
            kept = above | ((tied != 0) & (tied_before < still_needed))
            slot = kept_seen + tl.cumsum(kept.to(tl.int32), axis=0) - 1
            tl.store(row_out + slot, tile.to(tl.int64), mask=kept)
            tied_seen += tl.sum(tied, axis=0)
            kept_seen += tl.sum(kept.to(tl.int32), axis=0)


# A variant resolving 2 or 4 bits per step (one reduction over [digits, n] per step) measured slower on
# the H200 at every warp count (2026-11-29: [2048, 16384] best 0.64 ms vs 0.46 ms here), so one bit it is.


def default_num_warps(block: int) -> int:
    """The H200 sweep's best (`bench_stable_topk.py --sweep`, 2026-11-29): 4 warps up to 4096 entries,
    8 up to 16384, 32 for 32768."""
    if block <= 4096:
        return 4
    return 8 if block <= 16384 else 32


OUTPUT_TILE = 0
"""Output phase: 0 computes the whole row's prefix sums from the registers (measured on the H200);
a power of two re-reads the row in tiles of that many entries (fewer live registers: ptxas reports
255 registers and 232 bytes of spills at 16384 entries × 8 warps for 0, none for 2048; not yet
timed on a GPU, so `bench_stable_topk.py --sweep` includes it)."""


def stable_topk_rows(
    scores: torch.Tensor,
    k: int,
    *,
    _num_warps: int | None = None,
    _output_tile: int | None = None,
) -> torch.Tensor:
    """`stable_topk` of every row of `scores` (no validation: internal).

    Args:
        scores: [rows, n] float32/bfloat16/float16, last-dim stride 1, `1 <= k <= n <= TRITON_MAX_ROW`.
        _num_warps, _output_tile: override the launch's warps and `OUTPUT_TILE` (benchmark sweeps;
            the result does not change).
    Returns:
        int64 [rows, k], ascending positions per row.
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
        OUTPUT_TILE=OUTPUT_TILE if _output_tile is None else min(_output_tile, block),
        num_warps=_num_warps or default_num_warps(block),
    )
    return out
