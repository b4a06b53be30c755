"""Region membership bitmaps: sorted region ids per (batch, group, query) packed 32 regions per int32 word."""

import torch

from sa_kernels.backend import check_out, resolve_backend
from sa_kernels.region_bitmap import reference

__all__ = ["pack_region_bitmap"]

MAX_TRITON_SLOTS = 16384


def pack_region_bitmap(
    ids: torch.Tensor, regions: int, *, out: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Pack each row of selected region ids into a bitmap: bit `r % 32` of word `r // 32` is set iff `r` is selected.

    Args:
        ids: int32 [batch, groups, queries, slots] (any leading dims), each row sorted ascending; ids >= `regions`
            are padding (e.g. the `region_count` sentinel of `RegionSelection.region_ids`), repeats are allowed;
            negative ids are ignored too. The Triton path relies on the rows being sorted.
        regions: number of regions (>= 1); ids in `[0, regions)` are members.
        out: optional int32 [..., ceil(regions / 32)] contiguous tensor on ids' device to write into.
        backend: "auto" (Triton on CUDA, reference on CPU), "triton" or "reference".
    Returns:
        int32 [batch, groups, queries, ceil(regions / 32)], contiguous; bit 31 is the sign bit (word values wrap).
    Raises:
        TypeError: ids not an int32 tensor, regions not an int.
        ValueError: ids is a scalar, regions < 1 or >= 2**31 − 32, more than 16384 slots on Triton, `out` of the
            wrong shape/dtype/layout, bad backend.
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
    """
    fn = "pack_region_bitmap"
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{fn}: ids must be a tensor; got {type(ids).__name__}")
    if ids.dtype != torch.int32:
        raise TypeError(f"{fn}: ids must be int32; got {ids.dtype}")
    if ids.dim() < 1:
        raise ValueError(f"{fn}: ids must be [..., slots]; got a scalar")
    if isinstance(regions, bool) or not isinstance(regions, int):
        raise TypeError(f"{fn}: regions must be an int; got {type(regions).__name__}")
    if not 1 <= regions < 2**31 - 32:
        raise ValueError(f"{fn}: regions must be in [1, 2**31 - 32); got {regions}")
    shape = (*ids.shape[:-1], (regions + 31) // 32)
    check_out(fn, out, shape, torch.int32, ids.device, dtype_name="int32")
    chosen = resolve_backend(fn, backend, ids)
    if ids.numel() == 0:  # no rows, or rows without slots (they select nothing): no launch
        result = torch.zeros(shape, dtype=torch.int32, device=ids.device)
        return result if out is None else out.copy_(result)
    if chosen == "reference":
        result = reference.pack_region_bitmap(ids, regions)
        return result if out is None else out.copy_(result)
    if ids.shape[-1] > MAX_TRITON_SLOTS:
        raise ValueError(
            f"{fn}: the Triton path takes at most {MAX_TRITON_SLOTS} slots; got {ids.shape[-1]}"
        )
    from sa_kernels.region_bitmap import triton_kernels

    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=ids.device)
    return triton_kernels.pack_region_bitmap(ids, regions, out)
