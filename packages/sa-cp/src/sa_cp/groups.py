"""Process groups as sa-cp reads them: `None` is the single-rank group everywhere (no communication)."""

from typing import Any

import torch.distributed as dist


def group_rank_and_size(group: Any | None) -> tuple[int, int]:
    """`(rank, size)` of this process in `group`; `(0, 1)` for `None`.

    `None` never means "the default group": pass `torch.distributed.group.WORLD` for that, so a layout
    and the collectives that use it always agree on who takes part.
    """
    if group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "sa_cp: a process group was given but torch.distributed is not initialised"
        )
    return dist.get_rank(group), dist.get_world_size(group)
