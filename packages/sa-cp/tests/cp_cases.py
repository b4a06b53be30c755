"""Rank functions shared by the gloo tests (forked) and the NCCL tests (spawned: importable by name)."""

import torch
import torch.distributed as dist

from sa_cp import ContextParallelLayout, gather_halo, gather_sequence, shard_sequence


def _device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def gather_then_weighted_sum(rank, world_size, x, weight):
    x, weight = x.to(_device()), weight.to(_device())
    layout = ContextParallelLayout.create(x.size(1), group=dist.group.WORLD)
    local = shard_sequence(x, layout).clone().requires_grad_(True)
    full = gather_sequence(local, group=dist.group.WORLD)
    # A rank-dependent loss, so the reduce-scatter has to sum different gradients.
    loss = (full * weight * (rank + 1)).sum() + full[
        :, layout.local_start : layout.local_stop
    ].square().sum()
    loss.backward()
    return full.detach(), local.grad, layout


def halo_roundtrip(rank, world_size, x, weight, halo):
    x, weight = x.to(_device()), weight.to(_device())
    layout = ContextParallelLayout.create(x.size(1), group=dist.group.WORLD)
    local = shard_sequence(x, layout).clone().requires_grad_(True)
    out = gather_halo(local, halo, group=dist.group.WORLD)
    (
        out * shard_sequence(weight, layout).roll(1, dims=1).repeat(1, 2, 1)[:, : out.size(1)]
    ).sum().backward()
    return out.detach(), local.grad
