"""Head dims that are not a power of two, as a power-of-two part and a remainder.

Triton tiles have power-of-two sides, so a `[rows, 192]` tile padded to 256 columns spends a quarter
of its load lanes and of every dot over it on zeros. Kernels here hold such rows as two tiles
instead: `D_HI`, the largest power of two not above the head dim, and `D_LO`, the remainder rounded
up to a power of two (both at least 16, the least side of `tl.dot`): 192 = 128 + 64 with no padding,
40 = 32 + 16 with 8 columns of it. A dot over the head dim is the sum of the two parts' dots; a dot
into it (`P · V`) is two dots, one per part. With no remainder (`HAS_LO` false) no dot, store or
atomic reads a `lo` tile: `load_split` returns zeros for it, and `write_split` takes any placeholder.
The distillation target kernels of sa-routing use the same split.
"""

import triton
import triton.language as tl


def head_split(head_dim: int) -> tuple[int, int, bool]:
    """(D_HI, D_LO, HAS_LO) of `head_dim` (>= 1)."""
    hi = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - hi
    return hi, max(16, triton.next_power_of_2(rest)) if rest > 0 else 16, rest > 0


@triton.jit
def split_masks(ok, HEAD_DIM: tl.constexpr, D_HI: tl.constexpr, D_LO: tl.constexpr):
    """Masks of rows `ok` [R] over the hi [R, D_HI] and lo [R, D_LO] columns: a column mask only
    where a part runs past HEAD_DIM, so that loads of whole rows stay unmasked along them."""
    if D_HI > HEAD_DIM:
        hi = ok[:, None] & (tl.arange(0, D_HI)[None, :] < HEAD_DIM)
    else:
        hi = ok[:, None]
    if D_HI + D_LO > HEAD_DIM:
        lo = ok[:, None] & (D_HI + tl.arange(0, D_LO)[None, :] < HEAD_DIM)
    else:
        lo = ok[:, None]
    return hi, lo


@triton.jit
def load_split(
    ptr, rows, ok,
    HEAD_DIM: tl.constexpr, D_HI: tl.constexpr, D_LO: tl.constexpr, HAS_LO: tl.constexpr,
):  # fmt: skip
    """(hi [R, D_HI], lo [R, D_LO]) of the rows at element offsets `rows` [R] (int64) from `ptr`,
    last stride 1; 0 where `ok` [R] is false and past HEAD_DIM."""
    m_hi, m_lo = split_masks(ok, HEAD_DIM, D_HI, D_LO)
    hi = tl.load(ptr + rows[:, None] + tl.arange(0, D_HI)[None, :], mask=m_hi, other=0.0)
    if HAS_LO:
        cols = D_HI + tl.arange(0, D_LO)
        lo = tl.load(ptr + rows[:, None] + cols[None, :], mask=m_lo, other=0.0)
    else:
        lo = tl.zeros([rows.shape[0], D_LO], dtype=ptr.dtype.element_ty)
    return hi, lo


@triton.jit
def write_split(
    ptr, rows, ok, hi, lo,
    HEAD_DIM: tl.constexpr, D_HI: tl.constexpr, D_LO: tl.constexpr, HAS_LO: tl.constexpr,
    ATOMIC: tl.constexpr,
):  # fmt: skip
    """Writes hi and lo at the rows of `load_split`: relaxed atomic adds into an FP32 buffer where
    ATOMIC, else stores cast to `ptr`'s dtype."""
    m_hi, m_lo = split_masks(ok, HEAD_DIM, D_HI, D_LO)
    cols_hi = rows[:, None] + tl.arange(0, D_HI)[None, :]
    cols_lo = rows[:, None] + D_HI + tl.arange(0, D_LO)[None, :]
    if ATOMIC:
        tl.atomic_add(ptr + cols_hi, hi, mask=m_hi, sem="relaxed")
        if HAS_LO:
            tl.atomic_add(ptr + cols_lo, lo, mask=m_lo, sem="relaxed")
    else:
        tl.store(ptr + cols_hi, hi.to(ptr.dtype.element_ty), mask=m_hi)
        if HAS_LO:
            tl.store(ptr + cols_lo, lo.to(ptr.dtype.element_ty), mask=m_lo)
