"""sa_cp: context-parallel layouts and collectives, and recompute replay of routing decisions."""

from .collectives import gather_halo, gather_no_grad, gather_sequence
from .groups import group_rank_and_size
from .layout import ContextParallelLayout, shard_sequence
from .replay import (
    RecomputeReplay,
    RecomputeReplayRecorder,
    ReplayBinding,
    checkpoint_context_fn,
    route_selection_region,
)

__all__ = [
    "ContextParallelLayout",
    "RecomputeReplay",
    "RecomputeReplayRecorder",
    "ReplayBinding",
    "checkpoint_context_fn",
    "gather_halo",
    "gather_no_grad",
    "gather_sequence",
    "group_rank_and_size",
    "route_selection_region",
    "shard_sequence",
]
