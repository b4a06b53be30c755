"""`stable_topk` in Gluon: the algorithm of `triton_kernels`, with each thread owning a run of
adjacent entries.

Why: the Triton kernel is bound by its instructions (ncu on the H200: ALU 78 % busy), and most of
them go to prefix sums whose layout Triton chooses: the compaction of the keys above the bound took
about 52 thread instructions per entry, four separate warp scans per 1024-entry chunk among them.
Here a chunk is `[WARPS, 32, RUN]`, lane l of warp w holding the RUN entries `(32 w + l) RUN ...`:
a prefix sum is a sum within the thread, a scan within the warp, and the warps' totals, which every
thread reads from shared memory and sums itself (one barrier; Triton's block reductions and scans
took two to three each, and a chunk needed two of them: 4096 x 8192 rows 1.09x faster, the Step-5
forward's top-k 13.1 -> 11.7 ms on the H200).

Two kernels, one program per row:
- rows of 2049 to 32768 entries with `2k <= 1024` (`_stable_topk_prefilter_kernel`, 4 warps by
  default, RUN 8): the Triton kernel's prefilter path. The maxima of 1024 strided groups (position
  mod 1024: each thread keeps the maxima of its own RUN columns, so no thread talks to another); a
  `bound` that at least k maxima reach (a bit-by-bit walk, stopped once at most k + k/8 do); the
  positions of the keys above `bound` compacted in position order into 2k int32 slots (the int64
  output row's own memory, or scratch where the caller gives the output); then: between k and 2k
  of them (the usual case), the walk over those keys and the
  kept positions written ascending; fewer than k, `bound` is the k-th largest key and one pass over
  the row writes them; more than 2k (ties above the bound, or a bound left low by the early stop),
  a walk that re-reads the row per step.
- other rows of 1024 to 4095 entries (up to 2048 entries, or `2k > 1024`; any k)
  (`_stable_topk_whole_row_kernel`): the row held whole, walked, and the kept positions written
  from the registers.
Same keys and tie order as `triton_kernels` (`-0.0` ties with `+0.0`, `-inf` lowest), so the same
positions.

Gluon has no interpreter: these kernels run on SM90 GPUs only (`gpu` tests against the oracle and the
Triton kernel); elsewhere the Triton kernel runs.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sa_kernels.backend import sm_count
from sa_kernels.gluon_compat import cta_barrier
from sa_kernels.stable_topk import TRITON_MAX_ROW
from sa_kernels.stable_topk.triton_kernels import output_rows

MAXIMA = 1024
"""Strided groups whose maxima give the bound; also the survivors' capacity (at least 2k)."""
WARPS = 4
PROGRAMS_PER_SM = None
"""Programs per SM of the grid-stride launch (None: one program per row)."""
RUN = MAXIMA // (32 * WARPS)
"""Adjacent entries per thread in a chunk of MAXIMA entries at the default 4 warps (8)."""


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _keys_of(x):
    """uint32 keys of float32 scores x, whose unsigned order is the scores' order."""
    x = gl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in torch.sort
    bits = x.to(gl.uint32, bitcast=True)
    return gl.where((bits & 0x80000000) != 0, ~bits, bits | 0x80000000)


@gluon.jit
def _score_of(key):
    """The float32 score of a scalar key (`_keys_of`'s inverse; +0.0 for the key of zero)."""
    bits = gl.where((key & 0x80000000) != 0, key & 0x7FFFFFFF, ~key)
    return bits.to(gl.float32, bitcast=True)


@gluon.constexpr_function
def _warps_by_warps(warps):
    """[warps, warps] layout: row w in warp w (its lanes alike), every column in every thread."""
    return gl.BlockedLayout([1, warps], [1, 32], [warps, 1], [1, 0])


@gluon.jit
def _warp_totals_everywhere(counts):
    """The [WARPS] sums of each warp's row of counts [WARPS, 32] (one entry per lane), held whole by
    every thread: one warp reduction, then one pass through shared memory (one barrier, where the
    generic block reduction took three)."""
    warps: gl.constexpr = counts.shape[0]
    return gl.convert_layout(gl.sum(counts, axis=1), gl.SliceLayout(0, _warps_by_warps(warps)))


@gluon.jit
def _total(x):
    """Sum of every entry of a [WARPS, 32, RUN] tensor (a scalar)."""
    return gl.sum(_warp_totals_everywhere(gl.sum(x, axis=2)), axis=0)


@gluon.jit
def _exclusive_prefix(x):
    """Exclusive prefix sums of int32 x [WARPS, 32, RUN] in row-major order (lane l's entries follow
    lane l - 1's, warp w's follow warp w - 1's), and the sum of all of x: a scan within each thread,
    one within each warp, and the warps' totals, read by every thread, summed in each."""
    warps: gl.constexpr = x.shape[0]
    per_lane = gl.sum(x, axis=2)
    # the same distribution as a blocked layout, which scans take (no data moves)
    lane_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [warps, 1], [1, 0])
    counts = gl.convert_layout(per_lane, lane_layout)
    totals = _warp_totals_everywhere(counts)
    square: gl.constexpr = _warps_by_warps(warps)
    mine = gl.expand_dims(gl.arange(0, warps, layout=gl.SliceLayout(1, square)), 1)
    other = gl.expand_dims(gl.arange(0, warps, layout=gl.SliceLayout(0, square)), 0)
    earlier = gl.where(other < mine, gl.expand_dims(totals, 0), 0)
    warps_before = gl.convert_layout(gl.sum(earlier, axis=1), gl.SliceLayout(1, lane_layout))
    before = gl.expand_dims(warps_before, 1) + gl.associative_scan(counts, 1, _add) - counts
    before = gl.convert_layout(before, per_lane.type.layout)
    prefix = gl.expand_dims(before, 2) + gl.associative_scan(x, 2, _add) - x
    return prefix, gl.sum(totals, axis=0)


@gluon.jit
def _kth_key_from(keys, k, prefix, shift, slack):
    """The k-th largest of the uint32 keys [WARPS, 32, RUN], or a prefix reached by k to `k + slack`
    of them (the walk stops there; with slack 0 the prefix reached by exactly k), the bits above
    `shift` already known to be `prefix`'s."""
    searching = shift >= 0
    while searching:
        candidate = prefix | (gl.full([], 1, gl.uint32) << shift.to(gl.uint32))
        reaching = _total((keys >= candidate).to(gl.int32))
        prefix = gl.where(reaching >= k, candidate, prefix)
        shift -= 1
        searching = (shift >= 0) & ((reaching < k) | (reaching > k + slack))
    return prefix


@gluon.jit
def _walk_start(low, high):
    """(prefix, shift) for a walk whose answer lies in [low, high] (low < high): every key in that
    range shares their common top bits, so the walk starts below them."""
    diff = low ^ high
    shift = gl.full([], 31, gl.int32)
    while ((diff >> shift.to(gl.uint32)) & 1) == 0:
        shift -= 1
    below = (gl.full([], 2, gl.uint32) << shift.to(gl.uint32)) - 1  # 2 << 31 wraps to 0: all ones
    return high & ~below, shift


@gluon.jit
def _chunk_keys(row, positions, n, read):
    """Keys of the row's entries at positions [WARPS, 32, RUN]: those at or past `read` (<= n) are
    not loaded and get -inf's key, those at or past n key 0 (below every entry)."""
    scores = gl.load(row + positions, mask=positions < read, other=float("-inf")).to(gl.float32)
    return gl.where(positions < n, _keys_of(scores), 0)


@gluon.jit
def _count_reaching(row, offsets, n, read, candidate, CHUNK: gl.constexpr):
    """How many keys of the row reach `candidate` (>= 1)."""
    count = gl.zeros([], gl.int32)
    for start in range(0, n, CHUNK):
        keys = _chunk_keys(row, start + offsets, n, read)
        count += _total((keys >= candidate).to(gl.int32))
    return count


@gluon.jit
def _store_kept_streamed(
    row, out, offset, offsets, n, read, k, threshold, above_total, CHUNK: gl.constexpr
):
    """Re-read the row and store, ascending, the positions of its keys above `threshold` and of the
    first `k - above_total` keys equal to it."""
    still_needed = k - above_total
    tied_seen = gl.zeros([], gl.int32)
    kept_seen = gl.zeros([], gl.int32)
    for start in range(0, n, CHUNK):
        positions = start + offsets
        keys = _chunk_keys(row, positions, n, read)
        tied = ((keys == threshold) & (positions < n)).to(gl.int32)
        tied_prefix, tied_total = _exclusive_prefix(tied)
        kept = ((keys > threshold) | ((tied != 0) & (tied_seen + tied_prefix < still_needed))).to(
            gl.int32
        )
        kept_prefix, kept_total = _exclusive_prefix(kept)
        ids = (positions + offset).to(out.dtype.element_ty)
        gl.store(out + kept_seen + kept_prefix, ids, mask=kept != 0)
        tied_seen += tied_total
        kept_seen += kept_total


@gluon.jit
def _compact_above(slots, positions, scores, bound_score, above_bound, k):
    """Store the positions of the chunk's scores above `bound_score` into the slots after the
    `above_bound` already there (those past 2k are dropped); the new count."""
    above = (scores.to(gl.float32) > bound_score).to(gl.int32)
    prefix, total = _exclusive_prefix(above)
    slot = above_bound + prefix
    gl.store(slots + slot, positions, mask=(above != 0) & (slot < 2 * k))
    return above_bound + total


@gluon.jit
def _prefilter_row(row, out, offset, slots, offsets, n, read, k, MAXIMA: gl.constexpr):
    """`stable_topk` of one row of n entries, of which those at or past `read` are -inf and not
    loaded (see the module docstring; `read < n` only where n is k, below MAXIMA). Chunks of MAXIMA
    entries; the full ones are read without bounds checks, the last partial one with them."""
    full = n - n % MAXIMA
    # Group g = positions g, g + MAXIMA, ...: thread t keeps the maxima of groups t * RUN ...
    maxima = gl.full(offsets.shape, float("-inf"), gl.float32, offsets.type.layout)
    for start in range(0, full, MAXIMA):
        maxima = gl.maximum(maxima, gl.load(row + start + offsets).to(gl.float32))
    if full < n:
        positions = full + offsets
        tail = gl.load(row + positions, mask=positions < read, other=float("-inf"))
        maxima = gl.maximum(maxima, tail.to(gl.float32))
    maxima_keys = _keys_of(maxima)
    # Any prefix that k maxima reach is a bound: the walk stops once at most k + k/8 reach it, 9 to
    # 13 steps instead of 16 to 20 on random rows, for about 8 % more keys above it (offline)
    bound = _kth_key_from(
        maxima_keys, k, gl.zeros([], gl.uint32), gl.full([], 31, gl.int32), k >> 3
    )
    top = gl.max(gl.max(gl.max(maxima_keys, axis=2), axis=1), axis=0)  # the row's largest key

    # The positions of the keys above `bound` (at least k reach it), in position order, into 2k
    # int32 slots (the int64 output row's own memory unless the caller gave an output); the count
    # goes on past them. `key > bound` is
    # `score > bound_score` (no NaN, zeros folded).
    bound_score = _score_of(bound)
    above_bound = gl.zeros([], gl.int32)
    for start in range(0, full, MAXIMA):
        positions = start + offsets
        scores = gl.load(row + positions)
        above_bound = _compact_above(slots, positions, scores, bound_score, above_bound, k)
    if full < n:
        positions = full + offsets
        scores = gl.load(row + positions, mask=positions < read, other=float("-inf"))
        above_bound = _compact_above(slots, positions, scores, bound_score, above_bound, k)
    cta_barrier()  # the compacted positions are visible to every thread

    if (above_bound >= k) & (above_bound <= 2 * k):
        present = offsets < above_bound  # slot order is position order
        positions = gl.load(slots + offsets, mask=present, other=0)
        scores = gl.load(row + positions, mask=present, other=0.0).to(gl.float32)
        keys = gl.where(present, _keys_of(scores), 0)
        # every survivor is above `bound`: the answer lies in [bound + 1, top]
        if bound + 1 == top:
            threshold = top
        else:
            prefix, shift = _walk_start(bound + 1, top)
            threshold = _kth_key_from(keys, k, prefix, shift, 0)
        cta_barrier()  # every slot is read before the output overwrites it
        above = (keys > threshold).to(gl.int32)
        tied = (keys == threshold).to(gl.int32)
        tied_before, _ = _exclusive_prefix(tied)
        kept = ((above != 0) | ((tied != 0) & (tied_before < k - _total(above)))).to(gl.int32)
        slot, _ = _exclusive_prefix(kept)
        gl.store(out + slot, (positions + offset).to(out.dtype.element_ty), mask=kept != 0)
    elif above_bound < k:
        # at least k keys reach `bound` (k maxima do) and fewer pass it: it is the k-th largest key
        _store_kept_streamed(row, out, offset, offsets, n, read, k, bound, above_bound, MAXIMA)
    else:
        # more than 2k above the bound (ties, or a bound left low): the walk re-reads the row for
        # each step, from the common top bits of the smallest key above the bound and the largest
        if bound + 1 == top:
            threshold = top
        else:
            prefix, shift = _walk_start(bound + 1, top)
            searching = shift >= 0
            while searching:
                candidate = prefix | (gl.full([], 1, gl.uint32) << shift.to(gl.uint32))
                reaching = _count_reaching(row, offsets, n, read, candidate, MAXIMA)
                prefix = gl.where(reaching >= k, candidate, prefix)
                shift -= 1
                searching = (shift >= 0) & (reaching != k)
            threshold = prefix
        above_threshold = _count_reaching(row, offsets, n, read, threshold + 1, MAXIMA)
        _store_kept_streamed(
            row, out, offset, offsets, n, read, k, threshold, above_threshold, MAXIMA
        )


@gluon.jit
def _whole_row(row, out, offset, offsets, n, read, k):
    """`stable_topk` of a row held whole (offsets [WARPS, 32, RUN] cover it; entries at or past
    `read` are -inf): the walk over every key, then the kept positions, ascending."""
    keys = _chunk_keys(row, offsets, n, read)
    threshold = _kth_key_from(keys, k, gl.zeros([], gl.uint32), gl.full([], 31, gl.int32), 0)
    above = (keys > threshold).to(gl.int32)
    tied = ((keys == threshold) & (offsets < n)).to(gl.int32)
    tied_before, _ = _exclusive_prefix(tied)
    kept = ((above != 0) | ((tied != 0) & (tied_before < k - _total(above)))).to(gl.int32)
    slot, _ = _exclusive_prefix(kept)
    gl.store(out + slot, (offsets + offset).to(out.dtype.element_ty), mask=kept != 0)


@gluon.jit
def _chunk_offsets(RUN: gl.constexpr, WARPS: gl.constexpr):
    """Offsets [WARPS, 32, RUN] of a chunk: lane l of warp w holds the RUN entries (32 w + l) RUN ..."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1, RUN], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0])
    warps = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    lanes = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    run = gl.arange(0, RUN, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    threads = gl.expand_dims(warps, 1) * 32 + gl.expand_dims(lanes, 0)
    return gl.expand_dims(threads * RUN, 2) + gl.expand_dims(gl.expand_dims(run, 0), 1)


@gluon.jit
def _out_row(out_ptr, row64, out_inner, out_stride_outer, out_stride_inner):
    """Row `row64`'s output row: `(row // out_inner, row % out_inner)` of an output addressed by two
    strides (a [rows, k] output has one outer row)."""
    return (
        out_ptr + (row64 // out_inner) * out_stride_outer + (row64 % out_inner) * out_stride_inner
    )


@gluon.jit
def _row_extent(
    lengths_ptr,
    row64,
    len_inner,
    len_stride_outer,
    len_stride_inner,
    n,
    k,
    HAS_LENGTHS: gl.constexpr,
):
    """`(n_row, read)`: the entries the row's walk covers and those it loads. With lengths: `read`
    is the row's length clamped to [0, n] (the rest is -inf) and the walk covers at least k
    entries (the kept -inf ones come from the lowest positions); else both are n."""
    if HAS_LENGTHS:
        at = (row64 // len_inner) * len_stride_outer + (row64 % len_inner) * len_stride_inner
        read = gl.minimum(gl.maximum(gl.load(lengths_ptr + at), 0), n).to(gl.int32)
        n_row = gl.maximum(read, k)
    else:
        read = n
        n_row = n
    return n_row, read


_ADDRESSING = [
    "out_inner",
    "out_stride_outer",
    "out_stride_inner",
    "offset",
    "len_inner",
    "len_stride_outer",
    "len_stride_inner",
]
"""Arguments that vary per call (not specialised: one compiled kernel serves every call)."""


@gluon.jit(do_not_specialize=_ADDRESSING)
def _stable_topk_whole_row_kernel(
    scores_ptr,
    out_ptr,
    lengths_ptr,
    n,
    k,
    stride_row,
    out_inner,
    out_stride_outer,
    out_stride_inner,
    offset,
    len_inner,
    len_stride_outer,
    len_stride_inner,
    RUN: gl.constexpr,
    WARPS: gl.constexpr,
    HAS_LENGTHS: gl.constexpr,
):
    offsets = _chunk_offsets(RUN, WARPS)
    row64 = gl.program_id(0).to(gl.int64)
    out = _out_row(out_ptr, row64, out_inner, out_stride_outer, out_stride_inner)
    n_row, read = _row_extent(
        lengths_ptr, row64, len_inner, len_stride_outer, len_stride_inner, n, k, HAS_LENGTHS
    )
    _whole_row(scores_ptr + row64 * stride_row, out, offset, offsets, n_row, read, k)


@gluon.jit(do_not_specialize=[*_ADDRESSING, "slot_stride"])
def _stable_topk_prefilter_kernel(
    scores_ptr,
    out_ptr,
    slots_ptr,
    lengths_ptr,
    n_rows,
    n,
    k,
    stride_row,
    out_inner,
    out_stride_outer,
    out_stride_inner,
    slot_stride,
    offset,
    len_inner,
    len_stride_outer,
    len_stride_inner,
    MAXIMA: gl.constexpr,
    RUN: gl.constexpr,
    WARPS: gl.constexpr,
    HAS_LENGTHS: gl.constexpr,
):
    offsets = _chunk_offsets(RUN, WARPS)
    # rows in a grid-stride loop: the launch bounds the rows in flight (and so the L2 they need)
    for row_id in range(gl.program_id(0), n_rows, gl.num_programs(0)):
        row64 = row_id.to(gl.int64)
        n_row, read = _row_extent(
            lengths_ptr, row64, len_inner, len_stride_outer, len_stride_inner, n, k, HAS_LENGTHS
        )
        _prefilter_row(
            scores_ptr + row64 * stride_row,
            _out_row(out_ptr, row64, out_inner, out_stride_outer, out_stride_inner),
            offset,
            slots_ptr + row64 * slot_stride,
            offsets,
            n_row,
            read,
            k,
            MAXIMA,
        )


PREFILTER_MIN = 2049
"""Shortest row the prefilter takes. The whole-row kernel pads a row to a power of two, so rows of
2049 to 4095 entries were walked as 4096 (32 keys per thread): on the H200 (8192 rows, k 512) the
prefilter took them 1.2-1.8x faster, while at 1024 to 2048 entries the whole-row walk was as fast
or faster (0.62-1.13x). A group holds at most three entries of a row of up to 3072 entries, four
up to 4095, and at most k + k/8 groups reach past the bound: rows with more than 2k keys above it
take the slower branch that re-reads the row, with the same result."""
WHOLE_ROW_WARPS = 4
WHOLE_ROW_MIN = 1024
"""Shortest row the Gluon kernels take (shorter ones: the Triton kernel's whole-row walk)."""


def applies(n: int, k: int) -> bool:
    """Rows these kernels take: the prefilter's (`PREFILTER_MIN` to `TRITON_MAX_ROW` entries, k at
    most half the survivors' capacity MAXIMA), or held whole (other rows of `WHOLE_ROW_MIN` to
    `4 * MAXIMA - 1` entries, any k)."""
    if k < 1 or k > n:
        return False
    if PREFILTER_MIN <= n <= TRITON_MAX_ROW and 2 * k <= MAXIMA:
        return True
    return WHOLE_ROW_MIN <= n < 4 * MAXIMA


def stable_topk_rows(
    scores: torch.Tensor,
    k: int,
    programs_per_sm: int | None = PROGRAMS_PER_SM,
    whole_row_warps: int = WHOLE_ROW_WARPS,
    prefilter_warps: int = WARPS,
    *,
    out: torch.Tensor | None = None,
    addressing: tuple[int, int, int] | None = None,
    offset: int = 0,
    lengths: torch.Tensor | None = None,
    lengths_addressing: tuple[int, int, int] | None = None,
):
    """`triton_kernels.stable_topk_rows` through this kernel (rows where `applies`; no validation).

    scores: [rows, n] float32/bfloat16/float16 on an SM90 GPU, last-dim stride 1. `out`,
    `addressing`, `offset`:
    as `triton_kernels.stable_topk_rows` (None: a new int64 [rows, k]); returns it, ascending
    positions (+ offset) per row. `lengths`: optional int32/int64 row lengths, row r's at
    `(r // inner) * stride_outer + (r % inner) * stride_inner` for `lengths_addressing = (inner,
    stride_outer, stride_inner)`: entries at or past a row's length count as -inf and are not
    loaded. `programs_per_sm`: programs per SM, each looping over rows (None:
    one program per row); `whole_row_warps`, `prefilter_warps`: warps per row of the two kernels
    (the sweep's knobs; the results do not change)."""
    rows, n = scores.shape
    whole = n < PREFILTER_MIN or 2 * k > MAXIMA
    out, slots, addressing = output_rows(out, addressing, rows, k, scores.device, not whole)
    if rows == 0:
        return out
    has_lengths = lengths is not None
    if has_lengths:
        assert lengths_addressing is not None
        length_args = (lengths, *lengths_addressing)
    else:
        length_args = (out, 1, 0, 0)  # an unread placeholder
    if whole:  # held whole: RUN adjacent entries per thread cover it
        warps = whole_row_warps
        block = max(32 * warps, triton.next_power_of_2(n))
        _stable_topk_whole_row_kernel[(rows,)](
            scores,
            out,
            length_args[0],
            n,
            k,
            scores.stride(0),
            *addressing[:3],  # no slots: the row is walked in registers
            offset,
            *length_args[1:],
            RUN=block // (32 * warps),
            WARPS=warps,
            HAS_LENGTHS=has_lengths,
            num_warps=warps,
        )
        return out
    programs = (
        rows
        if programs_per_sm is None
        else min(rows, sm_count(scores.device.index) * programs_per_sm)
    )
    _stable_topk_prefilter_kernel[(programs,)](
        scores,
        out,
        slots,
        length_args[0],
        rows,
        n,
        k,
        scores.stride(0),
        *addressing,
        offset,
        *length_args[1:],
        MAXIMA=MAXIMA,
        RUN=MAXIMA // (32 * prefilter_warps),
        WARPS=prefilter_warps,
        HAS_LENGTHS=has_lengths,
        num_warps=prefilter_warps,
    )
    return out


__all__ = ["MAXIMA", "applies", "stable_topk_rows"]
