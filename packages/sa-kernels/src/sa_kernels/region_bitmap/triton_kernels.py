"""Bitmap packing without a scatter workspace: a segmented OR scan over each row of sorted ids.

Within a sorted row, the ids of one 32-region word are contiguous. A scan along the slots that ORs bits while the
word stays the same leaves each word's full mask at the word's last slot; that slot stores it. The row is zeroed
first (words no id touches), then a barrier orders the zeros before the masks; the zeros and the masks meet in
L2, so HBM sees each word about once.

Where the time went in the previous kernel (0.143 ms = 0.44x copy at [1, 4, 16384, 513] ids, 16384 regions):
~270 SASS instructions per 128-slot step (~1400 per row): one slot per thread, so every slot paid the five
shuffle levels of the warp scan; scalar loads (rows of 513 ids are not 16-byte aligned); a second, masked load
of the ids shifted by one; 64-bit compares; two reductions per step for the carried word. This kernel (~690
per row at the default) reads each row from the 16-byte boundary at or below its start (`ALIGN`; the up-to-3 ids
of the previous row count as non-members), so the ids come in 16-byte vectors and each thread ORs 4 contiguous
slots in registers before the warp-level part of the scan; scans the row in `BLOCK_S` steps that stop short of
its last slot, then one masked tail step; takes the next slot's word from registers (`NEXT="gather"`); seeds the
carried word into the first slot instead of merging it into every slot; and stores through inline PTX
(`STORE="asm"`) so Triton keeps the scan's register layout rather than converting it through shared memory
for `tl.store`'s scatter (the interpreter always takes `tl.store`).

Every configuration writes the same bits; they trade SASS instructions against L2 sector writes (see
SWEEP_CONFIGS). (A histogram + prefix sum + gather variant that writes each word once measured 2.7x slower on
the H200; a [rows, slots] tile per program, its warps split along the slots, was slower too.)
"""

import torch
import triton
import triton.language as tl

# BLOCK_S: slots per full scan step; BLOCK_T: the least tail step (raised to cover the row's last 1..BLOCK_S
# positions); ALIGN: 4 reads from the 16-byte boundary at or below the row start, 2 from the 8-byte one, 1 from
# the row start; NEXT: "gather" takes the next slot's word from registers (`tl.gather`), "load" loads the ids
# shifted by one; STORE: "asm" or "tl" (see the module docstring); BLOCK_W: words zeroed per store step; ROWS:
# rows per program, one after another (saves ~50 of ~690 SASS instructions of per-row setup).
#
# Triton gives the scan the register layout of the widest vector access of the same shape: 4 slots per thread
# when ALIGN is 4 or the zeroing step has the scan's shape (BLOCK_W == BLOCK_S), else 2 (ALIGN 2) or 1. Four per
# thread is the fewest instructions (~480 SASS per 512-slot step vs ~620 for 2 and ~820 for 1), but one warp
# store then spans ~128 words: ~220 L2 sector writes per row of 513 ids against ~135 for 2 and ~77 for 1 slot
# per thread, on top of 64 for the zeros and 64 for the ids. "tl" stores convert 4 per thread to 1 through
# shared memory.
# The sweep weighs instructions against L2 sector writes.
DEFAULT_CONFIG = {
    "BLOCK_S": 512,
    "BLOCK_T": 16,
    "ALIGN": 4,
    "NEXT": "gather",
    "STORE": "asm",
    "BLOCK_W": 512,
    "ROWS": 1,
    "num_warps": 1,
}
SWEEP_CONFIGS = [
    DEFAULT_CONFIG,
    *(
        {**DEFAULT_CONFIG, **change}
        for change in (
            {"ROWS": 2},
            {"ROWS": 4},
            {"BLOCK_S": 128, "BLOCK_T": 32},
            {"BLOCK_S": 256},
            {"NEXT": "load"},
            {"STORE": "tl"},
            {"STORE": "tl", "ROWS": 2},
            {"STORE": "tl", "BLOCK_S": 128, "BLOCK_T": 32},
            {"ALIGN": 2, "BLOCK_W": 1024},
            {"ALIGN": 2, "BLOCK_W": 1024, "STORE": "tl"},
            {"ALIGN": 1, "BLOCK_W": 1024},
            {"ALIGN": 1, "BLOCK_W": 1024, "ROWS": 2},
            {"ALIGN": 1, "BLOCK_W": 1024, "BLOCK_S": 128, "BLOCK_T": 32},
            {"ALIGN": 1, "NEXT": "load"},
            {"num_warps": 2},
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
    GATHER_NEXT: tl.constexpr,
    ASM_STORE: tl.constexpr,
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
    if GATHER_NEXT:
        # The next slot's word from registers; only the step's last slot reads the id after the step.
        after = tl.load(row_ids + q0 + BLOCK, mask=q0 + BLOCK < span, other=-1)
        next_word = tl.gather(word, tl.minimum(lane + 1, BLOCK - 1), 0)
        next_word = tl.where(lane == BLOCK - 1, _word_of(after, regions), next_word)
    elif TAIL:
        next_word = _word_of(tl.load(row_ids + q + 1, mask=q + 1 < span, other=-1), regions)
    else:
        next_word = _word_of(tl.load(row_ids + q + 1), regions)
    last_of_word = (word >= 0) & (word != next_word)
    ptrs = out_row + word
    if ASM_STORE:
        tl.inline_asm_elementwise(
            "{ .reg .pred %bm_p; setp.ne.s32 %bm_p, $3, 0; @%bm_p st.global.b32 [$1], $2; }"
            " mov.u32 $0, 0;",
            "=r,l,r,r",
            [ptrs, masks, last_of_word.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptrs, masks, mask=last_of_word)
    at_end = lane == BLOCK - 1
    open_word = tl.max(tl.where(at_end, word, -1), axis=0)
    open_bits = tl.max(tl.where(at_end, masks, -(2**31)), axis=0)
    return open_word, open_bits


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
    GATHER_NEXT: tl.constexpr,
    ASM_STORE: tl.constexpr,
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
                GATHER_NEXT,
                ASM_STORE,
            )


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
    GATHER_NEXT: tl.constexpr,
    ASM_STORE: tl.constexpr,
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
    # Full steps stop short of the last position, so their shifted loads stay inside the row unmasked; the tail
    # (1..BLOCK_T positions, the launcher sizes BLOCK_T) is masked.
    full = (span - 1) // BLOCK_S * BLOCK_S
    for q0 in range(0, full, BLOCK_S):
        open_word, open_bits = _scan_step(
            row_ids,
            out_row,
            q0,
            lead,
            span,
            regions,
            open_word,
            open_bits,
            BLOCK_S,
            False,
            GATHER_NEXT,
            ASM_STORE,
        )
    _scan_step(
        row_ids,
        out_row,
        full,
        lead,
        span,
        regions,
        open_word,
        open_bits,
        BLOCK_T,
        True,
        GATHER_NEXT,
        ASM_STORE,
    )


def pack_region_bitmap(
    ids: torch.Tensor, regions: int, out: torch.Tensor, *, _config: dict | None = None
) -> torch.Tensor:
    """Writes every word of `out` [..., words].

    `_config` ({"BLOCK_S", "BLOCK_T", "ALIGN", "NEXT", "STORE", "BLOCK_W", "ROWS", "num_warps"}, one of
    SWEEP_CONFIGS) is for the benchmark sweep.
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
        GATHER_NEXT=cfg["NEXT"] == "gather",
        # The interpreter runs no PTX: CPU tensors always store through tl.store.
        ASM_STORE=cfg["STORE"] == "asm" and ids.is_cuda,
        num_warps=cfg["num_warps"],
    )
    return out
