"""The oracle for region bitmaps: a dense bool membership table packed 32 regions per int32 word."""

import torch


def pack_region_bitmap(ids: torch.Tensor, regions: int) -> torch.Tensor:
    """ids [..., slots] (any order; ids outside [0, regions) ignored) → int32 [..., ceil(regions / 32)].

    Bit `r % 32` of word `r // 32` is set iff region `r` appears in the row.
    """
    words = (regions + 31) // 32
    rows = ids.reshape(-1, ids.shape[-1]).long()
    valid = (rows >= 0) & (rows < regions)
    member = torch.zeros(rows.shape[0], words * 32 + 1, dtype=torch.bool, device=ids.device)
    member.scatter_(1, torch.where(valid, rows, words * 32), True)
    bits = member[:, : words * 32].reshape(-1, words, 32).long()
    packed = (bits << torch.arange(32, device=ids.device)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32).reshape(*ids.shape[:-1], words)
