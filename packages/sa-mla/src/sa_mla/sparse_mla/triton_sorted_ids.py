"""The backward's id rows: each row's valid ids ascending, padded with `keys`, and their count.

The backward walks these rows: its kernels skip the invalid tail, and with ascending ids the dkv
programs in flight (slot ranges are the dkv grid's slowest axis) add into nearby dkv rows, which stay
in L2 (on the H200 the backward takes 26.59 ms with ascending ids against 27.67 without).

`reference.ascending_valid_ids_reference` is the PyTorch definition (also `canonical_topk`'s
compaction for the fused path). `ascending_valid_ids` marks the invalid slots and counts the valid
ones in one Triton pass (torch's form takes five elementwise and reduction kernels) and leaves the
sort to torch (a Triton `tl.sort` per row measured slower inside the backward).
"""

import torch
import triton
import triton.language as tl

from sa_kernels.backend import triton_interpret

from .reference import ascending_valid_ids_reference

# Rows up to this width are marked by one program (8192 ids over 8 warps: 32 per thread).
MAX_KERNEL_WIDTH = 8192


@triton.jit
def _valid_ids_or_keys_kernel(
    IDS,
    TOPK_LEN,
    MARKED,
    COUNTS,
    stride_in,
    stride_out,
    width,
    keys,
    HAS_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: MARKED = the valid ids where they stand and `keys` elsewhere (int32), COUNTS = the
    number of valid slots."""
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK)
    ids = tl.load(IDS + row * stride_in + slots, mask=slots < width, other=-1)
    valid = (ids >= 0) & (ids < keys) & (slots < width)
    if HAS_LEN:
        valid &= slots < tl.load(TOPK_LEN + row)
    marked = tl.where(valid, ids, keys).to(tl.int32)
    tl.store(MARKED + row * stride_out + slots, marked, mask=slots < width)
    tl.store(COUNTS + row, tl.sum(valid.to(tl.int32), axis=0))


def kernel_runs(ids: torch.Tensor) -> bool:
    """Whether the marking kernel can run on `ids`: CUDA tensors, or CPU ones under the interpreter."""
    return ids.is_cuda or (triton_interpret() and ids.device.type == "cpu")


def ascending_valid_ids(
    ids: torch.Tensor, keys: int, topk_length: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ascending_valid_ids_reference` (same arguments and results): the marking through the Triton
    kernel on CUDA or under the interpreter, for rows up to MAX_KERNEL_WIDTH slots with unit
    stride; elsewhere the reference."""
    rows, width = ids.shape
    if not kernel_runs(ids) or width > MAX_KERNEL_WIDTH or ids.stride(1) != 1 or rows * width == 0:
        return ascending_valid_ids_reference(ids, keys, topk_length)
    if topk_length is not None:
        topk_length = topk_length.contiguous()  # the kernel reads one entry per row
    marked = torch.empty(rows, width, dtype=torch.int32, device=ids.device)
    counts = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block = triton.next_power_of_2(width)
    _valid_ids_or_keys_kernel[(rows,)](
        ids,
        topk_length if topk_length is not None else counts,
        marked,
        counts,
        ids.stride(0),
        marked.stride(0),
        width,
        keys,
        HAS_LEN=topk_length is not None,
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
    return marked.sort(dim=1).values, counts
