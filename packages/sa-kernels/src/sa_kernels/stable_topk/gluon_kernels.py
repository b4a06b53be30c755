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
  `bound` that at least k maxima reach (a selection stopped once at most k + k/8 do); the
  positions of the keys above `bound` compacted in position order into 2k int32 slots (the int64
  output row's own memory, or scratch where the caller gives the output); then: between k and 2k
  of them (the usual case), the selection over those keys and the kept positions written
  ascending; fewer than k, `bound` is the k-th largest key and one pass over the row writes them;
  more than 2k (ties above the bound, or a bound left low by the early stop), a selection that
  re-reads the row per probe.
- other rows of 1024 to 4095 entries (up to 2048 entries, or `2k > 1024`; any k)
  (`_stable_topk_whole_row_kernel`): the row held whole, the selection over it, and the kept
  positions written from the registers.
Where the Triton kernel walks the key bits one by one, a selection here (`_select`) narrows a
bracket of keys by probes that interpolate the count in score: about 9 probes instead of 23 on
random and Step-5-like rows (offline); on the H200 the Step-5 forward's top-k takes 3.37 ms at
65 536 tokens and 11.1 ms at 131 072 with it, 3.65 and 11.8 with a bit walk.
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
from sa_kernels.stable_topk.limits import TRITON_MAX_ROW
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


ZERO_KEY = gl.constexpr(0x80000000)
"""The key of +0.0 (and of -0.0, folded into it)."""
NEG_INF_KEY = gl.constexpr(0x007FFFFF)
POS_INF_KEY = gl.constexpr(0xFF800000)
INTERPOLATED_PROBES = gl.constexpr(10)
"""Probes of a selection chosen by interpolation; the later ones halve the bracket (at most 32)."""


@gluon.jit
def _largest_key(keys):
    return gl.max(gl.max(gl.max(keys, axis=2), axis=1), axis=0)


@gluon.jit
def _smallest_key(keys):
    return gl.min(gl.min(gl.min(keys, axis=2), axis=1), axis=0)


@gluon.jit
def _probe(lo, hi, reach_lo, reach_past_hi, aim, weight_lo, weight_hi, interpolate):
    """The next key to count in [lo + 1, hi] (lo < hi): where the count, interpolated linearly in
    score between the bracket's ends (their weights Illinois-style), reaches `aim`. Exact zero and
    the infinities get probes of their own: relu scores tie at zero in bulk, and the count's jump
    there is a step that an interpolation only approaches (offline: 40 probes on some rows instead
    of 6). Probes past `interpolate` halve the bracket (so does an end whose score is NaN)."""
    zero = gl.full([], ZERO_KEY, gl.uint32)
    score_lo = _score_of(lo)
    score_hi = _score_of(hi)
    above = (reach_lo.to(gl.float32) - aim) * weight_lo
    below = (aim - reach_past_hi.to(gl.float32)) * weight_hi
    finite = (score_lo > float("-inf")) & (score_hi < float("inf"))
    # a weighted mean of the ends (no overflow; infinite or NaN ends zeroed, their guess unused)
    weight = above / (above + below)
    guess = (
        gl.where(finite, score_lo, 0.0) * (1.0 - weight) + gl.where(finite, score_hi, 0.0) * weight
    )
    probe = gl.where(interpolate & finite, _keys_of(guess), lo + (hi - lo) // 2 + 1)
    # just above an exact zero at lo: the smallest positive score, which ends a tie at zero (also
    # among the halvings, which would otherwise walk down through the subnormals)
    near_zero = (guess < score_hi * 0.0625) | ~interpolate
    probe = gl.where((lo == zero) & near_zero, zero + 1, probe)
    probe = gl.where((lo < zero) & (zero <= hi), zero, probe)  # zero inside: split there first
    # an infinite end: is it the answer (k keys -inf, or k keys +inf)? else the bracket is finite
    probe = gl.where(lo == NEG_INF_KEY, lo + 1, probe)
    probe = gl.where(hi == POS_INF_KEY, hi, probe)
    return gl.minimum(gl.maximum(probe, lo + 1), hi)


@gluon.jit
def _reaching(keys, row, offsets, n, read, probe, STREAM: gl.constexpr):
    """How many keys reach `probe`: of the keys held, or (STREAM) of the row, re-read."""
    if STREAM:
        count = _count_reaching(row, offsets, n, read, probe, offsets.numel)
    else:
        count = _total((keys >= probe).to(gl.int32))
    return count


@gluon.jit
def _largest_at_most(keys, row, offsets, n, read, hi, STREAM: gl.constexpr):
    """The largest key <= hi (0 if none): of the keys held, or (STREAM) of the row, re-read."""
    if STREAM:
        largest = gl.zeros([], gl.uint32)
        for start in range(0, n, offsets.numel):
            chunk = _chunk_keys(row, start + offsets, n, read)
            largest = gl.maximum(largest, _largest_key(gl.where(chunk <= hi, chunk, 0)))
    else:
        largest = _largest_key(gl.where(keys <= hi, keys, 0))
    return largest


@gluon.jit
def _smallest_from(keys, row, offsets, n, read, lo, STREAM: gl.constexpr):
    """The smallest key >= lo (lo >= 1; all ones if none): of the keys held, or (STREAM) of the
    row, re-read."""
    if STREAM:
        smallest = gl.full([], 0xFFFFFFFF, gl.uint32)
        for start in range(0, n, offsets.numel):
            chunk = _chunk_keys(row, start + offsets, n, read)
            smallest = gl.minimum(smallest, _smallest_key(gl.where(chunk >= lo, chunk, 0xFFFFFFFF)))
    else:
        smallest = _smallest_key(gl.where(keys >= lo, keys, 0xFFFFFFFF))
    return smallest


@gluon.jit
def _select(
    keys, row, offsets, n, read, k, lo, reach_lo, hi, reach_past_hi, slack, STREAM: gl.constexpr
):
    """A key that k to `k + slack` keys reach, or else the k-th largest key (with slack 0: the k-th
    largest, or a key exactly k reach), given a bracket: `reach_lo` >= k keys reach lo, and
    `reach_past_hi` < k reach hi + 1. Keys: the uint32 keys held [WARPS, 32, RUN] (0 never counts:
    lo >= 1 there), or (STREAM) the row's n entries, re-read for each probe.

    The bracket shrinks by each probe until one end is the answer: a probe from interpolation in
    score (`_probe`; at most INTERPOLATED_PROBES, then halvings: at most 42 probes); and where
    one key is still needed (the bracket's largest) or all of them are (its smallest), one
    reduction ends it."""
    aim = k.to(gl.float32) + slack.to(gl.float32) * 0.5
    weight_lo = gl.full([], 1.0, gl.float32)
    weight_hi = gl.full([], 1.0, gl.float32)
    last_move = gl.zeros([], gl.int32)  # 1: lo was raised, -1: hi was lowered
    probes = gl.zeros([], gl.int32)
    searching = lo < hi
    while searching:
        still_needed = k - reach_past_hi
        if still_needed == 1:
            lo = _largest_at_most(keys, row, offsets, n, read, hi, STREAM)
            searching = lo < lo
        elif still_needed == reach_lo - reach_past_hi:
            lo = _smallest_from(keys, row, offsets, n, read, lo, STREAM)
            searching = lo < lo
        else:
            probe = _probe(
                lo, hi, reach_lo, reach_past_hi, aim, weight_lo, weight_hi,
                probes < INTERPOLATED_PROBES,
            )  # fmt: skip
            reaching = _reaching(keys, row, offsets, n, read, probe, STREAM)
            probes += 1
            raise_lo = reaching >= k
            # Illinois-like: lo's weight halves whenever hi is lowered other than right after a
            # raise of lo (the first probe too), hi's when lo is raised twice in a row
            weight_lo = gl.where(raise_lo | (last_move > 0), 1.0, weight_lo * 0.5)
            weight_hi = gl.where(raise_lo & (last_move > 0), weight_hi * 0.5, 1.0)
            last_move = gl.where(raise_lo, 1, -1)
            lo = gl.where(raise_lo, probe, lo)
            reach_lo = gl.where(raise_lo, reaching, reach_lo)
            hi = gl.where(raise_lo, hi, probe - 1)
            reach_past_hi = gl.where(raise_lo, reach_past_hi, reaching)
            searching = (lo < hi) & ~(raise_lo & (reaching <= k + slack))
    return lo


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
        # at most k: a NaN key would pass `threshold` here though no count above had it
        gl.store(
            out + kept_seen + kept_prefix, ids, mask=(kept != 0) & (kept_seen + kept_prefix < k)
        )
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
    top = _largest_key(maxima_keys)  # the row's largest key
    # Any key that k maxima reach is a bound: the selection stops once at most k + k/8 reach it
    # (for about 8 % more keys above it than the k-th largest maximum gives, offline)
    bound = _select(
        maxima_keys, row, offsets, n, read, k, _smallest_key(maxima_keys),
        gl.full([], MAXIMA, gl.int32), top, gl.zeros([], gl.int32), k >> 3, False,
    )  # fmt: skip

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
        threshold = _select(
            keys, row, offsets, n, read, k, bound + 1, above_bound, top, gl.zeros([], gl.int32),
            gl.zeros([], gl.int32), False,
        )  # fmt: skip
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
        # more than 2k above the bound (ties, or a bound left low): the selection re-reads the row
        # for each probe
        threshold = _select(
            maxima_keys, row, offsets, n, read, k, bound + 1, above_bound, top,
            gl.zeros([], gl.int32), gl.zeros([], gl.int32), True,
        )  # fmt: skip
        above_threshold = _count_reaching(row, offsets, n, read, threshold + 1, MAXIMA)
        _store_kept_streamed(
            row, out, offset, offsets, n, read, k, threshold, above_threshold, MAXIMA
        )


@gluon.jit
def _whole_row(row, out, offset, offsets, n, read, k):
    """`stable_topk` of a row held whole (offsets [WARPS, 32, RUN] cover it; entries at or past
    `read` are -inf): the selection over every key, then the kept positions, ascending."""
    keys = _chunk_keys(row, offsets, n, read)
    present = offsets < n
    threshold = _select(
        keys, row, offsets, n, read, k, _smallest_key(gl.where(present, keys, 0xFFFFFFFF)), n,
        _largest_key(keys), gl.zeros([], gl.int32), gl.zeros([], gl.int32), False,
    )  # fmt: skip
    above = (keys > threshold).to(gl.int32)
    tied = ((keys == threshold) & present).to(gl.int32)
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
    """`(n_row, read)`: the entries the row's selection covers and those it loads. With lengths:
    `read` is the row's length clamped to [0, n] (the rest is -inf) and the selection covers at
    least k entries (the kept -inf ones come from the lowest positions); else both are n."""
    if HAS_LENGTHS:
        at = (row64 // len_inner) * len_stride_outer + (row64 % len_inner) * len_stride_inner
        read = gl.minimum(gl.maximum(gl.load(lengths_ptr + at), 0), n).to(gl.int32)
        n_row = gl.maximum(read, k)
    else:
        read = n
        n_row = n
    return n_row, read


_ADDRESSING = [
    "k",  # Triton would specialise k = 1 to a constant, which Triton 3.6 fails to lower here
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
SHORT_ROW = 8192
SHORT_ROW_REGISTERS = 48
"""The prefilter's registers on rows of up to SHORT_ROW entries (a register cap at launch): 10
programs per SM instead of the 8 that the compiler's 62 registers leave (ncu, Triton 3.6). The
capped kernel spills a few values (16-24 bytes of stack in the offline Triton 3.6 cubins) and runs
faster all the same: on the H200 the Step-5 forward's top-k takes 3.21 instead of 3.37 ms at 65 536
tokens. Longer rows keep the compiler's count: 9 or 10 programs per SM run them 3-12 % slower
(12 288 and 16 384 entries; presumably less of each row is still in L2 for the compaction pass).
Under Triton 3.9 (offline) the kernel needs 56-62 registers uncapped, so the cap applies there too."""
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
        **({"maxnreg": SHORT_ROW_REGISTERS} if n <= SHORT_ROW else {}),
    )
    return out


__all__ = ["MAXIMA", "applies", "stable_topk_rows"]
