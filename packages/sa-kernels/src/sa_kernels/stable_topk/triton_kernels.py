"""`stable_topk` for rows that fit one program: radix select on order-preserving keys, then a prefix sum.

A program owns one row (or, narrowing long rows, `rows_per_program` rows, every phase vectorised over
them). It reads a row as 32-bit keys whose unsigned order is the scores' order (`-0.0` folded into
`+0.0`, `-inf` lowest, padding below everything). The k-th best key
`t` is built bit by bit from the top: a candidate bit stays set when at least k keys reach the
candidate; the walk stops early once exactly k keys reach the prefix built so far (they are the answer,
and none ties at it). Then every key above `t` is kept, and of the keys equal to `t` the first
`k - #above` positions (an exclusive prefix count). A prefix count over the kept mask gives each kept
position its output slot, so positions come out ascending without a sort: over the whole row at once
from the registers, or (`OUTPUT_TILE`) in tiles re-read from memory with the counts carried between
tiles.

Short rows (no prefilter) are held in registers and walked whole. Long rows are first narrowed
(`MAXIMA` > 0), streaming the row in `CHUNK`-entry tiles so that no program holds all of it (a
16384-entry row in registers took 255 registers per thread at 4 warps, two programs per SM; streamed,
96): the maxima of `MAXIMA` strided groups give a bound `b` (the k-th largest maximum; at least k keys
reach it, so every kept key does), and the keys above `b` are counted and compacted in position order
into the output row's own memory (2k int32 slots). These two passes compare the scores themselves (only
the maxima become keys): the same order, fewer instructions. Fewer than k above `b`: `b` is the k-th largest key
itself, so the output pass runs at once (a threshold tied many times, as relu-weighted scores tie at 0:
4.1–4.7 % of the Step-5 rows at 128k). Between k and 2k (k to 1.4·k
on normal random rows): the walk runs over those keys. More (heavy ties above `b`): the walk re-reads the row for each of its steps.
Two or three reads of the row (all but the first mostly from L2; one per walk step on the rare
heavy-tie rows), k writes, no workspace in memory, no host sync.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _keys_of(x):
    """uint32 keys of float32 scores x, whose unsigned order is the scores' order."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in torch.sort
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(x.shape, 0x80000000, tl.uint32)
    return tl.where((bits & sign) != 0, ~bits, bits | sign)


@triton.jit
def _score_of(keys):
    """The float32 score of each key (`_keys_of`'s inverse; +0.0 for the key of zero)."""
    sign = tl.full(keys.shape, 0x80000000, tl.uint32)
    bits = tl.where((keys & sign) != 0, keys & ~sign, ~keys)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _order_keys(scores_ptr, offsets, n):
    """uint32 keys whose unsigned order is the scores' order; positions at or past n get key 0."""
    in_row = offsets < n
    keys = _keys_of(tl.load(scores_ptr + offsets, mask=in_row, other=0.0).to(tl.float32))
    return tl.where(in_row, keys, 0)  # -inf maps to 0x007fffff, so padding sorts below every score


@triton.jit
def _load_scores(scores_ptr, offsets, n):
    """float32 scores, -inf at positions at or past n. For the prefilter, which compares scores
    themselves: keys cost about eight more instructions per entry, and this kernel is bound by its
    instructions (ncu on the H200: ALU pipe 79 % busy on Step-5 rows)."""
    return tl.load(scores_ptr + offsets, mask=offsets < n, other=float("-inf")).to(tl.float32)


@triton.jit
def _store_kept_tiles(
    row_scores, row_out, offset, n, k, threshold, above_total, TILE: tl.constexpr
):
    """`_store_kept_rows` of one row re-read in tiles, the counts carried between tiles; `above_total` is
    the number of keys above `threshold` in the whole row."""
    still_needed = k - above_total
    tied_seen = tl.zeros([], dtype=tl.int32)
    kept_seen = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, TILE):
        tile = start + tl.arange(0, TILE)
        tile_keys = _order_keys(row_scores, tile, n)
        above = tile_keys > threshold
        tied = ((tile_keys == threshold) & (tile < n)).to(tl.int32)
        tied_before = tied_seen + tl.cumsum(tied, axis=0) - tied
        kept = above | ((tied != 0) & (tied_before < still_needed))
        slot = kept_seen + tl.cumsum(kept.to(tl.int32), axis=0) - 1
        # at most k: a NaN key would pass `threshold` here though no count above had it
        tl.store(
            row_out + slot, (tile + offset).to(row_out.dtype.element_ty), mask=kept & (slot < k)
        )
        tied_seen += tl.sum(tied, axis=0)
        kept_seen += tl.sum(kept.to(tl.int32), axis=0)


@triton.jit
def _kth_key(keys, k):
    """`_kth_key_rows` of one row held as keys [N] (the whole-row path: 1-D, as it was measured)."""
    prefix = tl.zeros([], dtype=tl.uint32)
    shift = tl.full([], 31, tl.int32)
    searching = shift >= 0  # a scalar True; False once exactly k keys reach `prefix`
    while searching:
        candidate = prefix | (tl.full([], 1, tl.uint32) << shift.to(tl.uint32))
        reaching = tl.sum((keys >= candidate).to(tl.int32), axis=0)
        prefix = tl.where(reaching >= k, candidate, prefix)
        shift -= 1
        searching = (shift >= 0) & (reaching != k)
    return prefix


@triton.jit
def _store_kept(keys, positions, threshold, k, row_out, offset):
    """`_store_kept_rows` of one row held as keys/positions [N]."""
    still_needed = k - tl.sum((keys > threshold).to(tl.int32), axis=0)
    above = keys > threshold
    tied = keys == threshold
    tied_before = tl.cumsum(tied.to(tl.int32), axis=0) - tied.to(tl.int32)
    kept = above | (tied & (tied_before < still_needed))
    slot = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    tl.store(row_out + slot, (positions + offset).to(row_out.dtype.element_ty), mask=kept)


@triton.jit
def _whole_row_topk(keys, offsets, row_scores, row_out, offset, n, k, OUTPUT_TILE: tl.constexpr):
    """The row held in registers (keys, offsets [N]): walk it, then store the kept positions. 1-D
    helpers here: the [1, N] forms of the row-vectorised ones take 15.3 ms instead of 0.112 for 8192
    rows of 2048 entries (k 64) on the H200."""
    threshold = _kth_key(keys, k)
    if OUTPUT_TILE == 0:  # the whole row's prefix sums at once, from the keys held in registers
        _store_kept(keys, offsets, threshold, k, row_out, offset)
    else:  # re-read the row in tiles, carrying the counts: fewer live registers than whole-row sums
        above_total = tl.sum((keys > threshold).to(tl.int32), axis=0)
        _store_kept_tiles(row_scores, row_out, offset, n, k, threshold, above_total, OUTPUT_TILE)


@triton.jit
def _count_above(row_scores, n, bound, TILE: tl.constexpr):
    """How many keys of the row, read in tiles, are above `bound`."""
    count = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, TILE):
        tile_keys = _order_keys(row_scores, start + tl.arange(0, TILE), n)
        count += tl.sum((tile_keys > bound).to(tl.int32), axis=0)
    return count


@triton.jit
def _streamed_topk(row_scores, row_out, offset, n, k, TILE: tl.constexpr):
    """The whole-row walk without holding the row: each step re-reads it in tiles from the cache. For
    rows the prefilter cannot narrow (heavy ties): slow, but it keeps the common path's registers low."""
    prefix = tl.zeros([], dtype=tl.uint32)
    shift = tl.full([], 31, tl.int32)
    searching = shift >= 0
    while searching:
        candidate = prefix | (tl.full([], 1, tl.uint32) << shift.to(tl.uint32))
        reaching = _count_above(
            row_scores, n, candidate - 1, TILE
        )  # keys >= candidate (candidate >= 1)
        prefix = tl.where(reaching >= k, candidate, prefix)
        shift -= 1
        searching = (shift >= 0) & (reaching != k)
    above_total = _count_above(row_scores, n, prefix, TILE)
    _store_kept_tiles(row_scores, row_out, offset, n, k, prefix, above_total, TILE)


@triton.jit
def _kth_key_rows(keys, k, active):
    """Per row of keys [ROWS, N]: the k-th largest key, or (early stop) a prefix reached by exactly k
    keys and tied by none ([ROWS] uint32). One block-wide reduction per step serves every row; the walk
    ends once every `active` row has stopped (inactive rows' results are meaningless).

    A runtime loop, not an unrolled one: 32 inlined copies of a step over a long row compiled for
    minutes. One bit per step: histograms resolving 2, 4 or 8 bits per step are slower on the H200
    at every row length.
    """
    prefix = tl.zeros([keys.shape[0]], dtype=tl.uint32)
    done = ~active  # per row: exactly k keys reach its prefix, which stays as it is
    shift = tl.full([], 31, tl.int32)
    searching = shift >= 0
    while searching:
        candidate = prefix | (tl.full([], 1, tl.uint32) << shift.to(tl.uint32))
        reaching = tl.sum((keys >= candidate[:, None]).to(tl.int32), axis=1)
        prefix = tl.where(~done & (reaching >= k), candidate, prefix)
        done = done | (reaching == k)
        shift -= 1
        searching = (shift >= 0) & (tl.min(done.to(tl.int32), axis=0) == 0)
    return prefix


@triton.jit
def _store_kept_rows(keys, positions, threshold, k, rows_out, offset, rows_ok):
    """Store, ascending, the positions of the keys above `threshold` and of the first keys equal to it,
    k in all, for each row of keys/positions [ROWS, N] (in position order) whose `rows_ok` holds;
    threshold [ROWS], rows_out [ROWS] pointers."""
    above = keys > threshold[:, None]
    still_needed = k - tl.sum(above.to(tl.int32), axis=1)
    tied = (keys == threshold[:, None]).to(tl.int32)
    tied_before = tl.cumsum(tied, axis=1) - tied
    kept = above | ((tied != 0) & (tied_before < still_needed[:, None]))
    slot = tl.cumsum(kept.to(tl.int32), axis=1) - 1
    kept_ids = (positions + offset).to(rows_out.dtype.element_ty)
    tl.store(rows_out[:, None] + slot, kept_ids, mask=kept & rows_ok[:, None])


@triton.jit
def _out_rows(out_ptr, row, out_inner, out_stride_outer, out_stride_inner):
    """The output rows of rows `row` (int64): row r is `(r // out_inner, r % out_inner)` of an
    output addressed by two strides (a [rows, k] output has one outer row)."""
    return out_ptr + (row // out_inner) * out_stride_outer + (row % out_inner) * out_stride_inner


@triton.jit
def _prefiltered_rows(
    scores_ptr,
    out_ptr,
    slots_ptr,
    n_rows,
    n,
    k,
    stride_row,
    out_inner,
    out_stride_outer,
    out_stride_inner,
    slot_stride,
    offset,
    ROWS: tl.constexpr,
    MAXIMA: tl.constexpr,
    CHUNK: tl.constexpr,
    PREFILTER_STAGES: tl.constexpr,
):
    """The prefilter path for ROWS rows of one program, every phase vectorised over the rows (their
    loads in flight together, one reduction per walk step for all of them); rows the prefilter leaves
    tied at the bound or heavily tied above it then take the one-row paths, one at a time."""
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    row = first_row + tl.arange(0, ROWS)
    rows_ok = row < n_rows
    row = tl.where(rows_ok, row, first_row)  # past the last row: re-read the first, store nothing
    rows_scores = scores_ptr + row * stride_row
    rows_out = _out_rows(out_ptr, row, out_inner, out_stride_outer, out_stride_inner)
    rows_slots = slots_ptr + row * slot_stride
    # group j = positions j, j + MAXIMA, ...: strided, so clustered high scores spread over groups.
    # Maxima of the scores, then their keys: the same keys as the maxima of the keys (the order is
    # the same, and a -0.0 maximum folds into +0.0's key). Every group holds real scores: the launch
    # narrows only blocks of at least 4·MAXIMA entries, so n > 2·MAXIMA.
    maxima = tl.full([ROWS, MAXIMA], float("-inf"), dtype=tl.float32)
    for start in tl.range(0, n, CHUNK, num_stages=PREFILTER_STAGES):
        chunk = start + tl.arange(0, CHUNK)
        chunk_scores = _load_scores(rows_scores[:, None], chunk[None, :], n)
        chunk_max = tl.max(tl.reshape(chunk_scores, [ROWS, CHUNK // MAXIMA, MAXIMA]), axis=1)
        maxima = tl.maximum(maxima, chunk_max)
    bound = _kth_key_rows(_keys_of(maxima), k, rows_ok)
    # At least k keys reach `bound` (k group maxima do). The keys above it are compacted in position
    # order into the row's 2k int32 slots (the int64 output row's own memory unless the caller
    # gave an output); stores past the slots are dropped
    # and the count says so. `key > bound` is `score > bound_score` (no NaN, zeros folded).
    bound_score = _score_of(bound)
    above_bound = tl.zeros([ROWS], dtype=tl.int32)
    for start in tl.range(0, n, CHUNK, num_stages=PREFILTER_STAGES):
        chunk = start + tl.arange(0, CHUNK)
        above = _load_scores(rows_scores[:, None], chunk[None, :], n) > bound_score[:, None]
        slot = above_bound[:, None] + tl.cumsum(above.to(tl.int32), axis=1) - 1
        fits = above & (slot < 2 * k) & rows_ok[:, None]
        tl.store(
            rows_slots[:, None] + slot, tl.broadcast_to(chunk[None, :], [ROWS, CHUNK]), mask=fits
        )
        above_bound += tl.sum(above.to(tl.int32), axis=1)
    tl.debug_barrier()  # the compacted positions are visible to every thread of the program
    # Between k and 2k keys above the bound (k to 1.4·k on normal random rows): walk those keys.
    narrow = (above_bound >= k) & (above_bound <= 2 * k) & rows_ok
    if tl.max(narrow.to(tl.int32), axis=0) > 0:
        j = tl.arange(0, MAXIMA)  # at most 2k <= MAXIMA survivors
        present = (j[None, :] < above_bound[:, None]) & narrow[:, None]
        positions = tl.load(rows_slots[:, None] + j[None, :], mask=present, other=0)
        narrow_keys = tl.where(present, _order_keys(rows_scores[:, None], positions, n), 0)
        threshold = _kth_key_rows(narrow_keys, k, narrow)
        tl.debug_barrier()  # every slot is read before the output overwrites it
        _store_kept_rows(narrow_keys, positions, threshold, k, rows_out, offset, narrow)
    if tl.max((~narrow & rows_ok).to(tl.int32), axis=0) > 0:
        lane = tl.arange(0, ROWS)
        for i in range(ROWS):  # a runtime loop: one copy of the one-row paths, not ROWS
            row_i = first_row + i
            above_i = tl.sum(tl.where(lane == i, above_bound, 0), axis=0)
            if (row_i < n_rows) & ((above_i < k) | (above_i > 2 * k)):
                row_scores = scores_ptr + row_i * stride_row
                row_out = _out_rows(out_ptr, row_i, out_inner, out_stride_outer, out_stride_inner)
                if above_i < k:
                    # Fewer than k keys above it and at least k reaching it: `bound` is the k-th
                    # largest key itself (a heavily tied value, e.g. relu-weighted scores at 0).
                    bound_i = tl.max(tl.where(lane == i, bound, 0), axis=0)
                    _store_kept_tiles(row_scores, row_out, offset, n, k, bound_i, above_i, CHUNK)
                else:  # heavy ties above the bound: the walk re-reads the row
                    _streamed_topk(row_scores, row_out, offset, n, k, CHUNK)


@triton.jit(
    do_not_specialize=["out_inner", "out_stride_outer", "out_stride_inner", "slot_stride", "offset"]
)
def _stable_topk_kernel(
    scores_ptr,
    out_ptr,
    slots_ptr,
    n_rows,
    n,
    k,
    stride_row,
    out_inner,
    out_stride_outer,
    out_stride_inner,
    slot_stride,
    offset,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    OUTPUT_TILE: tl.constexpr,
    MAXIMA: tl.constexpr,
    CHUNK: tl.constexpr,
    PREFILTER_STAGES: tl.constexpr,
):
    if MAXIMA > 0:  # the prefilter, streaming the rows in CHUNK-entry tiles (never a whole row)
        _prefiltered_rows(
            scores_ptr,
            out_ptr,
            slots_ptr,
            n_rows,
            n,
            k,
            stride_row,
            out_inner,
            out_stride_outer,
            out_stride_inner,
            slot_stride,
            offset,
            ROWS,
            MAXIMA,
            CHUNK,
            PREFILTER_STAGES,
        )
    else:
        row = tl.program_id(0).to(tl.int64)
        row_scores = scores_ptr + row * stride_row
        row_out = _out_rows(out_ptr, row, out_inner, out_stride_outer, out_stride_inner)
        offsets = tl.arange(0, BLOCK_N)
        keys = _order_keys(row_scores, offsets, n)
        _whole_row_topk(keys, offsets, row_scores, row_out, offset, n, k, OUTPUT_TILE)


# Entries the prefilter reads per step (at least MAXIMA): 8 per thread at 4 warps.
PREFILTER_CHUNK = 1024


@dataclass(frozen=True)
class LaunchConfig:
    """How a row maps onto one program; every config returns the same positions.

    num_warps: warps per program (row).
    output_tile: 0 = the output phase's prefix sums over the whole row from registers; a power of two =
        re-read the row in tiles of that many entries (fewer live registers).
    prefilter: 0, or narrow the row before the walk to the keys reaching the k-th largest maximum of
        this many strided groups (a power of two; it also holds the at most 2k compacted survivors).
        Applies where the row's block is at least 4× that and `2k <= prefilter`, else ignored.
    prefilter_chunk: entries the prefilter reads per step (a power of two; at least `prefilter` are
        read); the prefilter never holds the whole row.
    prefilter_stages: software-pipelining depth of the prefilter's chunk loads (`tl.range`'s
        `num_stages`; 1 = none: each chunk waits for its load). Deeper pipelines compile to cp.async
        loads for FP32 rows (offline sm_90 TTGIR; 16-bit rows get none).
    rows_per_program: rows one program narrows together where the prefilter applies (a power of two):
        their chunk loads are in flight at once and each walk step is one reduction for all of them.
        Slower than 1 on the H200 at every shape timed (Step-5 rows of 16383 entries: 1 row
        0.322 ms, 2 rows 0.371, 4 rows 0.483), so the rows are not latency-bound; kept for the
        sweep on other GPUs.
    """

    num_warps: int = 4
    output_tile: int = 0
    prefilter: int = 0
    prefilter_chunk: int = PREFILTER_CHUNK
    prefilter_stages: int = 3
    rows_per_program: int = 1

    def __post_init__(self):
        for name in ("prefilter_stages", "rows_per_program"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LaunchConfig: {name} must be an int >= 1; got {value!r}")
        if self.rows_per_program & (self.rows_per_program - 1):
            raise ValueError(
                f"LaunchConfig: rows_per_program must be a power of two; got {self.rows_per_program}"
            )


def default_config(block: int, k: int) -> LaunchConfig:
    """The H200 sweep's best for the streamed prefilter (`bench_stable_topk.py --sweep`, FP32 rows, k 512):
    4 warps, the output phase in 2048-entry tiles for blocks above 2048 entries, and for blocks of 8192
    entries or more the prefilter (1024 maxima) reading 1024-entry chunks through a 3-stage pipeline,
    one row per program: 2048 rows of 32768 entries 0.245 ms, of 16384 0.145, 4096 rows of 8192
    0.166 (the unpipelined 2048-entry chunks: 0.390, 0.208, 0.208). 4096-entry rows run the
    whole-row walk (0.129 ms; the pipelined prefilter took 0.119-0.122 in single samples, not enough
    to change the default). A k above half the maxima takes the next power of two of 2k maxima where
    the block still holds 4 entries per maximum (not timed), else no prefilter."""
    return LaunchConfig(
        num_warps=4,
        output_tile=2048 if block > 2048 else 0,
        prefilter=max(1024, triton.next_power_of_2(2 * k)) if block >= 8192 else 0,
    )


def _prefilter_maxima(config: LaunchConfig, block: int, k: int) -> int:
    """The maxima the launch narrows with, or 0 where the prefilter does not apply (a block of fewer
    than 4 entries per maximum, or more than half as many kept entries as maxima)."""
    maxima = config.prefilter
    return maxima if maxima > 0 and block >= 4 * maxima and 2 * k <= maxima else 0


def output_rows(
    out: torch.Tensor | None,
    addressing: tuple[int, int, int] | None,
    rows: int,
    k: int,
    device: torch.device,
    prefilter: bool,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """Where the kernels write: `(out, slots, (out_inner, out_stride_outer, out_stride_inner,
    slot_stride))`. No `out`: a new int64 [rows, k], whose rows double as the prefilter's 2k int32
    slots. `out` (int32 or int64, last-dim stride 1) with `addressing = (inner, stride_outer,
    stride_inner)`: row r goes to `(r // inner) * stride_outer + (r % inner) * stride_inner`, and
    the slots (where the `prefilter` runs; else `out`, unread) get their own int32 [rows, 2k]."""
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int64, device=device)
        return out, out.view(torch.int32), (max(rows, 1), 0, k, 2 * k)
    assert addressing is not None
    slots = torch.empty(rows, 2 * k, dtype=torch.int32, device=device) if prefilter else out
    return out, slots, (*addressing, 2 * k)


def stable_topk_rows(
    scores: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    addressing: tuple[int, int, int] | None = None,
    offset: int = 0,
    _config: LaunchConfig | None = None,
) -> torch.Tensor:
    """`stable_topk` of every row of `scores` (no validation: internal).

    Args:
        scores: [rows, n] float32/bfloat16/float16, last-dim stride 1, `1 <= k <= n <= TRITON_MAX_ROW`.
        out, addressing: where to write (`output_rows`), or None for a new int64 [rows, k].
        offset: added to every position written.
        _config: override the launch (benchmark sweeps; the result does not change).
    Returns:
        `out`, or the new int64 [rows, k]: ascending positions (+ offset) per row.
    """
    rows, n = scores.shape
    block = max(16, triton.next_power_of_2(n))
    config = _config or default_config(block, k)
    maxima = _prefilter_maxima(config, block, k)
    out, slots, addressing = output_rows(out, addressing, rows, k, scores.device, maxima > 0)
    if rows == 0:
        return out
    per_program = config.rows_per_program if maxima else 1
    _stable_topk_kernel[(triton.cdiv(rows, per_program),)](
        scores,
        out,
        slots,
        rows,
        n,
        k,
        scores.stride(0),
        *addressing,
        offset,
        BLOCK_N=block,
        ROWS=per_program,
        OUTPUT_TILE=min(config.output_tile, block),
        MAXIMA=maxima,
        CHUNK=max(maxima, config.prefilter_chunk),
        PREFILTER_STAGES=config.prefilter_stages,
        num_warps=config.num_warps,
    )
    return out
