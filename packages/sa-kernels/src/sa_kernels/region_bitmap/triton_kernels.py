"""Bitmap packing without a scatter workspace: one row per program, every output word written once, coalesced.

Within a sorted row the ids of one 32-region word are contiguous, so:
1. a segmented OR scan over the slots leaves each word's full mask at the word's last slot;
2. per block of words, a histogram of the slots' words and its prefix sum give each word's last slot
   (`#slots with word <= w` − 1), and a gather moves the masks from slot space to word space.
Words no id touches get 0. No scattered stores, no zero pass, no int64 temporaries.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _or_within_word(word_a, bits_a, word_b, bits_b):
    return word_b, bits_b | tl.where(word_a == word_b, bits_a, 0)


@triton.jit
def _pack_region_bitmap_kernel(
    ids_ptr,
    out_ptr,
    slots,
    stride_row,
    regions,
    words,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + row * stride_row + s, mask=s < slots, other=regions)
    valid = (ids >= 0) & (ids < regions)
    # Sentinels keep `word` nondecreasing along the sorted row: negatives first, padding last.
    word = tl.where(valid, ids >> 5, tl.where(ids < 0, -1, words))
    bits = tl.where(valid, (1 << (ids & 31)).to(tl.int32), 0)
    _, word_masks = tl.associative_scan((word, bits), 0, _or_within_word)
    w_local = tl.arange(0, BLOCK_W)
    for w0 in range(0, words, BLOCK_W):
        local = word - w0
        in_block = valid & (local >= 0) & (local < BLOCK_W)
        outside = tl.sum((~in_block).to(tl.int32), axis=0)
        counts = tl.histogram(tl.where(in_block, local, 0), BLOCK_W)
        counts = counts - tl.where(w_local == 0, outside, 0)
        before = tl.sum((word < w0).to(tl.int32), axis=0)
        last = before + tl.cumsum(counts, axis=0) - 1
        gathered = tl.gather(word_masks, tl.maximum(last, 0), axis=0)
        w = w0 + w_local
        tl.store(out_ptr + row * words + w, tl.where(counts > 0, gathered, 0), mask=w < words)


def pack_region_bitmap(ids: torch.Tensor, regions: int, out: torch.Tensor) -> torch.Tensor:
    """Writes every word of `out` [..., words]."""
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
    _pack_region_bitmap_kernel[(rows,)](
        rows2d,
        out,
        slots,
        rows2d.stride(0),
        regions,
        words,
        BLOCK_S=triton.next_power_of_2(slots),
        BLOCK_W=min(1024, triton.next_power_of_2(words)),
        num_warps=4,
    )
    return out
