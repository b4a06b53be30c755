"""Bitmap packing without a scatter workspace: a segmented OR scan over each row of sorted ids.

Within a sorted row, the ids of one 32-region word are contiguous. A scan along the slots that ORs bits while the
word stays the same leaves each word's full mask at the word's last slot; that slot stores it. The row is zeroed
first (words no id touches), then a barrier orders the zeros before the masks; the zeros and the masks meet in
L2, so HBM sees each word about once.

Why it is fast: each row is read from the 16-byte boundary at or below its start (`ALIGN`; the up-to-3 ids of the
previous row count as non-members), so the ids come in 16-byte vectors and each thread ORs 4 contiguous slots in
registers before the warp-level part of the scan (~480 SASS instructions per 512-slot step against ~820 with one
slot per thread, counted in an offline sm_90 compile). The row is scanned in `BLOCK_S` steps that stop short of its last slot, then one masked tail
step; the next slot's word comes from registers (`tl.gather`), and the word open at a step's end seeds the next
step's first slot. The masks go out through `tl.store`, which converts the scan's 4-slots-per-thread layout to
one slot per thread through shared memory: one warp store then spans ~32 words of the row instead of ~128 (by a
simulation, not a measurement: about 77 L2 sector writes per row of 513 ids instead of ~220). Storing straight from the scan's registers with inline
PTX skips that round trip but pays the writes: 0.1223 ms (0.52x copy) against the default's 0.0967 ms.

H200, [1, 4, 16384, 513] sorted ids, 16384 regions: 0.0967 ms = 0.66x the device-to-device copy bandwidth of
the same run; a kernel scanning one slot per thread takes 0.1433 ms (0.44x). Slower on the same shape: a
histogram + prefix sum + gather that writes each word once (2.7x), a [rows, slots] tile per program with its
warps split along the slots, 2 warps per row, and the ids loaded shifted by one instead of `tl.gather`.
"""

import torch
import triton
import triton.language as tl

# BLOCK_S: slots per full scan step; BLOCK_T: the least tail step (raised to cover the row's last 1..BLOCK_S
# positions); ALIGN: 4 reads from the 16-byte boundary at or below the row start, 2 from the 8-byte one, 1 from
# the row start; BLOCK_W: words zeroed per store step; ROWS: rows per program, one after another (saves per-row
# setup). Triton gives the scan the register layout of the widest vector access of the same shape: 4 slots per
# thread when ALIGN is 4 or the zeroing step has the scan's shape (BLOCK_W == BLOCK_S), else 2 (ALIGN 2) or 1.
#
# Default: the fastest of 16 configs on the H200 (torch 2.11, Triton 3.6, `bench_region_bitmap.py --quick
# --sweep`, [1, 4, 16384, 513] ids, 16384 regions): 0.0967 ms, 0.66x copy.
DEFAULT_CONFIG = {"BLOCK_S": 512, "BLOCK_T": 16, "ALIGN": 4, "BLOCK_W": 512, "ROWS": 2}
# The default and its closest rivals in that sweep (ms, x copy): ALIGN 2 with one row per program (0.0978,
# 0.65x), one row per program (0.1005, 0.63x), 128-slot steps (0.1075, 0.59x); 4 rows per program, the neighbour
# on the other side, was timed only with inline-PTX stores.
SWEEP_CONFIGS = [
    DEFAULT_CONFIG,
    *(
        {**DEFAULT_CONFIG, **change}
        for change in (
            {"ALIGN": 2, "BLOCK_W": 1024, "ROWS": 1},
            {"ROWS": 1},
            {"BLOCK_S": 128, "BLOCK_T": 32, "ROWS": 1},
            {"ROWS": 4},
        )
    ),
]


@triton.jit
def _or_within_word(word_a, bits_a, word_b, bits_b):
    return word_b, bits_b | tl.where(word_a == word_b, bits_a, 0)


@triton.jit
def _word_of(ids, regions):
    """Word index of each id, -1 for ids outside [0, regions) (an unsigned compare catches negatives)."""
    return tl.where(ids.to(tl.uint32, bitcast=True) < regions, ids >> 5, -1)


@triton.jit
def _scan_step(
    row_ids,
    out_row,
    q0,
    lead,
    span,
    regions,
    open_word,
    open_bits,
    BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Positions q0 .. q0 + BLOCK of the row read from `row_ids` (the row's slot 0 is position `lead`).

    Stores the mask of every word whose last slot lies in the step; returns the word open at the step's end and
    its mask so far. Full steps (TAIL False) must end before the row's last position.
    """
    lane = tl.arange(0, BLOCK)
    q = q0 + lane
    if TAIL:
        ids = tl.load(row_ids + q, mask=q < span, other=-1)
    else:
        ids = tl.load(row_ids + q)
    # Positions before slot 0 hold the previous row's ids: ignored like negatives. Every id that is not a member
    # gets word -1, so the slots of each member word stay one contiguous run. (The position test compares the
    # lane offsets with a scalar in 32 bits; `q >= lead` compiles to 64-bit compares.)
    word = tl.where(lane >= lead - q0, _word_of(ids, regions), -1)
    # Bits of non-members are never stored (their word is -1), so they need no masking. The word open at the
    # previous step's end seeds the first slot.
    bits = (1 << (ids & 31)).to(tl.int32)
    bits = tl.where((lane == 0) & (word == open_word), bits | open_bits, bits)
    _, masks = tl.associative_scan((word, bits), 0, _or_within_word)
    # The next slot's word from registers; only the step's last slot reads the id after the step.
    after = tl.load(row_ids + q0 + BLOCK, mask=q0 + BLOCK < span, other=-1)
    next_word = tl.gather(word, tl.minimum(lane + 1, BLOCK - 1), 0)
    next_word = tl.where(lane == BLOCK - 1, _word_of(after, regions), next_word)
    tl.store(out_row + word, masks, mask=(word >= 0) & (word != next_word))
    at_end = lane == BLOCK - 1
    open_word = tl.max(tl.where(at_end, word, -1), axis=0)
    open_bits = tl.max(tl.where(at_end, masks, -(2**31)), axis=0)
    return open_word, open_bits


@triton.jit
def _pack_row(
    ids_ptr,
    out_ptr,
    row,
    slots,
    stride_row,
    regions,
    words,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One row: zero its words, then scan its slots and store each member word's mask."""
    start = row * stride_row
    base = start // ALIGN * ALIGN
    lead = (start - base).to(tl.int32)
    span = lead + slots
    row_ids = ids_ptr + base
    out_row = out_ptr + row * words
    for w0 in range(0, words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        tl.store(out_row + w, tl.zeros([BLOCK_W], dtype=tl.int32), mask=w < words)
    tl.debug_barrier()
    open_word = -1
    open_bits = 0
    # Full steps stop short of the last position, so their loads and the id after them stay inside the row
    # unmasked; the tail (1..BLOCK_T positions, the launcher sizes BLOCK_T) is masked.
    full = (span - 1) // BLOCK_S * BLOCK_S
    for q0 in range(0, full, BLOCK_S):
        open_word, open_bits = _scan_step(
            row_ids, out_row, q0, lead, span, regions, open_word, open_bits, BLOCK_S, False
        )
    _scan_step(row_ids, out_row, full, lead, span, regions, open_word, open_bits, BLOCK_T, True)


@triton.jit
def _pack_region_bitmap_kernel(
    ids_ptr,
    out_ptr,
    n_rows,
    slots,
    stride_row,
    regions,
    words,
    ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALIGN: tl.constexpr,
):
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < n_rows:
            _pack_row(
                ids_ptr,
                out_ptr,
                row.to(tl.int64),
                slots,
                stride_row,
                regions,
                words,
                BLOCK_S,
                BLOCK_T,
                BLOCK_W,
                ALIGN,
            )


def pack_region_bitmap(
    ids: torch.Tensor, regions: int, out: torch.Tensor, *, _config: dict | None = None
) -> torch.Tensor:
    """Writes every word of `out` [..., words].

    `_config` ({"BLOCK_S", "BLOCK_T", "ALIGN", "BLOCK_W", "ROWS"}, one of SWEEP_CONFIGS) is for the benchmark
    sweep.
    """
    cfg = DEFAULT_CONFIG if _config is None else _config
    slots = ids.shape[-1]
    words = (regions + 31) // 32
    rows2d = ids.reshape(-1, slots)
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    rows = rows2d.shape[0]
    if rows == 0:
        return out
    if slots == 0:
        return out.zero_()
    align, block_s = cfg["ALIGN"], cfg["BLOCK_S"]
    # The tail holds the positions after the last full step: 1..block_s of them, depending on the row's lead.
    tail = max(span - (span - 1) // block_s * block_s for span in range(slots, slots + align))
    _pack_region_bitmap_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](
        rows2d,
        out,
        rows,
        slots,
        rows2d.stride(0),
        regions,
        words,
        ROWS=cfg["ROWS"],
        BLOCK_S=block_s,
        BLOCK_T=max(cfg["BLOCK_T"], triton.next_power_of_2(tail)),
        BLOCK_W=min(cfg["BLOCK_W"], triton.next_power_of_2(words)),
        ALIGN=align,
        num_warps=1,
    )
    return out
