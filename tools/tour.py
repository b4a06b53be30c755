"""A short tour of sa on CPU: context-parallel shards and recompute replay (more as packages land)."""

import torch
from torch.utils.checkpoint import checkpoint

from sa_cp import ContextParallelLayout, checkpoint_context_fn, shard_sequence
from sa_cp.testing import TOY_ROUTES, ToyRoutedLayer


def context_parallel_tour() -> None:
    print("== sa-cp: contiguous context-parallel shards ==")
    positions = torch.arange(100)[None]
    for rank in range(3):
        layout = ContextParallelLayout.create(100, multiple_of=8, pad=True, rank=rank, size=3)
        shard = shard_sequence(positions, layout, pad_value=-1)
        print(
            f"rank {rank}: positions [{layout.local_start}, {layout.local_stop}) -> first {shard[0, :3].tolist()} last {shard[0, -3:].tolist()}"
        )


def replay_tour() -> None:
    print("\n== sa-cp: recompute replay ==")
    torch.manual_seed(0)
    x = torch.randn(2, 64, 16, requires_grad=True)
    for label, context_fn in (
        ("checkpoint", None),
        ("checkpoint + replay", checkpoint_context_fn(None, TOY_ROUTES)),
    ):
        layer = ToyRoutedLayer(16, 8)
        kwargs = {"context_fn": context_fn} if context_fn else {}
        checkpoint(layer, x, use_reentrant=False, **kwargs).sum().backward()
        print(f"{label:<22} router ran {layer.router_calls}x per step")


if __name__ == "__main__":
    context_parallel_tour()
    replay_tour()
