"""`stable_topk` for rows that fit one program: radix select on order-preserving keys, then a prefix sum.

One program owns one row. It loads the row once into registers as 32-bit keys whose unsigned order is
the scores' order (`-0.0` folded into `+0.0`, `-inf` lowest, padding below everything). The k-th best key
`t` is built from the top, one digit of `DIGIT_BITS` bits per step: one bit by counting the keys that
reach a candidate, or several bits from a histogram of the digit over the keys that still match the
digits chosen so far. The walk stops early once exactly k keys reach the prefix chosen so far (then
they are the answer and no key ties at the threshold). Then every key above `t` is kept, and of the keys
equal to `t` the first `k - #above` positions (an exclusive prefix count). A prefix count over the kept
mask gives each kept position its output slot, so positions come out ascending without a sort: over the
whole row at once from the registers, or (`OUTPUT_TILE`) in tiles re-read from memory with the counts
carried between tiles. One or two reads of the row, k writes, no workspace in memory, no host sync.
"""

from dataclasses import dataclass

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
def _kth_key(keys, k, DIGIT_BITS: tl.constexpr):
    """The k-th largest key, or (early stop) a prefix reached by exactly k keys and tied by none.

    Invariant per step: `above` keys lie above every key matching `prefix` on the bits chosen so far,
    `above < k <= above + #matching`. A runtime loop, not an unrolled one: the row's registers are
    many, and 32 inlined copies of the step made compilation take minutes at 32768 entries.
    """
    DIGITS: tl.constexpr = 1 << DIGIT_BITS
    prefix = tl.zeros([], dtype=tl.uint32)
    above = tl.zeros([], dtype=tl.int32)
    shift = tl.full([], 32 - DIGIT_BITS, tl.int32)
    searching = shift >= 0  # a scalar True; False once exactly k keys reach `prefix`
    while searching:
        if DIGIT_BITS == 1:
            candidate = prefix | (tl.full([], 1, tl.uint32) << shift.to(tl.uint32))
            reaching = tl.sum((keys >= candidate).to(tl.int32), axis=0)
            prefix = tl.where(reaching >= k, candidate, prefix)
            exact = reaching == k
        else:
            # the digit of keys that match the prefix above it (the prefix is zero from `shift` down);
            # other keys go to an overflow bin
            digit = ((keys >> shift.to(tl.uint32)) & (DIGITS - 1)).to(tl.int32)
            matching = ((keys ^ prefix) >> shift.to(tl.uint32)) < DIGITS
            bins = tl.arange(0, 2 * DIGITS)
            counts = tl.histogram(tl.where(matching, digit, DIGITS), 2 * DIGITS)
            counts = tl.where(bins < DIGITS, counts, 0)
            # reaching[d] = keys at or above prefix | d << shift
            reaching = above + tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts
            chosen = tl.max(tl.where((reaching >= k) & (bins < DIGITS), bins, 0), axis=0)
            above += tl.sum(tl.where(bins > chosen, counts, 0), axis=0)
            prefix = prefix | (chosen.to(tl.uint32) << shift.to(tl.uint32))
            exact = tl.sum(tl.where(bins == chosen, reaching, 0), axis=0) == k
        shift -= DIGIT_BITS
        searching = (shift >= 0) & (exact == 0)
    return prefix


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
    DIGIT_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_scores = scores_ptr + row * stride_row
    row_out = out_ptr + row * stride_out
    offsets = tl.arange(0, BLOCK_N)
    keys = _order_keys(row_scores, offsets, n)
    threshold = _kth_key(keys, k, DIGIT_BITS)

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


@dataclass(frozen=True)
class LaunchConfig:
    """How a row maps onto one program; every config returns the same positions.

    num_warps: warps per program (row).
    output_tile: 0 = the output phase's prefix sums over the whole row from registers; a power of two =
        re-read the row in tiles of that many entries (fewer live registers).
    digit_bits: radix digit resolved per step (1, 2, 4 or 8); more bits, fewer steps over the row.
    """

    num_warps: int = 4
    output_tile: int = 0
    digit_bits: int = 1


def default_config(block: int) -> LaunchConfig:
    """The H200 sweep's best (`bench_stable_topk.py --sweep`, 2026-11-29 18:29 UTC): 4 warps, and the
    output phase in 2048-entry tiles above 2048 entries (32768: 0.944 ms vs 1.533 for the previous
    whole-row 32-warp default; 16384: 0.376 vs 0.461; 4096: 0.169 vs 0.179)."""
    return LaunchConfig(num_warps=4, output_tile=2048 if block > 2048 else 0)


def stable_topk_rows(
    scores: torch.Tensor, k: int, *, _config: LaunchConfig | None = None
) -> torch.Tensor:
    """`stable_topk` of every row of `scores` (no validation: internal).

    Args:
        scores: [rows, n] float32/bfloat16/float16, last-dim stride 1, `1 <= k <= n <= TRITON_MAX_ROW`.
        _config: override the launch (benchmark sweeps; the result does not change).
    Returns:
        int64 [rows, k], ascending positions per row.
    """
    rows, n = scores.shape
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    block = max(16, triton.next_power_of_2(n))
    config = _config or default_config(block)
    _stable_topk_kernel[(rows,)](
        scores,
        out,
        n,
        k,
        scores.stride(0),
        out.stride(0),
        BLOCK_N=block,
        OUTPUT_TILE=min(config.output_tile, block),
        DIGIT_BITS=config.digit_bits,
        num_warps=config.num_warps,
    )
    return out
