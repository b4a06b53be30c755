"""Layouts and collectives on real gloo process groups of 2 and 4 ranks, against one-process references."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sa_cp import (
    ContextParallelLayout,
    gather_halo,
    gather_no_grad,
    gather_sequence,
    group_rank_and_size,
    shard_sequence,
)
from sa_cp.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))  # cp_cases: importable by spawned NCCL ranks too
from cp_cases import gather_then_weighted_sum, halo_roundtrip

WORLD_SIZES = pytest.mark.parametrize("world_size", [2, 4], ids=["2ranks", "4ranks"])


def global_inputs(world_size: int, local: int = 6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, world_size * local, 5, generator=generator, dtype=torch.float64)
    weight = torch.randn(3, world_size * local, 5, generator=generator, dtype=torch.float64)
    return x, weight


def halo_reference(x: torch.Tensor, world_size: int, halo: int) -> list[torch.Tensor]:
    """Each rank's `[previous shard's last halo tokens ; own shard]`, computed in one process."""
    shards = x.chunk(world_size, dim=1)
    out = []
    for rank, shard in enumerate(shards):
        previous = shards[rank - 1][:, -halo:] if rank > 0 else torch.zeros_like(shard[:, :halo])
        out.append(torch.cat([previous, shard], dim=1))
    return out


@WORLD_SIZES
def test_gather_sequence_output_and_gradients_match_single_process(world_size):
    x, weight = global_inputs(world_size)
    results = run_on_ranks(world_size, gather_then_weighted_sum, x, weight)
    xs = x.clone().requires_grad_(True)
    layouts = [r[2] for r in results]
    total = sum(
        (xs * weight * (rank + 1)).sum() + xs[:, lay.local_start : lay.local_stop].square().sum()
        for rank, lay in enumerate(layouts)
    )
    total.backward()
    for rank, (full, grad, layout) in enumerate(results):
        assert layout.rank == rank and layout.size == world_size
        assert torch.equal(full, x)
        torch.testing.assert_close(grad, xs.grad[:, layout.local_start : layout.local_stop])


@WORLD_SIZES
@pytest.mark.parametrize("halo", [1, 4, 6], ids=["halo1", "halo4", "halo-whole-shard"])
def test_gather_halo_output_and_gradients_match_single_process(world_size, halo):
    x, weight = global_inputs(world_size)
    results = run_on_ranks(world_size, halo_roundtrip, x, weight, halo)
    xs = x.clone().requires_grad_(True)
    expected = halo_reference(xs, world_size, halo)
    loss = 0
    for rank, out in enumerate(expected):
        w = weight.chunk(world_size, dim=1)[rank].roll(1, dims=1).repeat(1, 2, 1)[:, : out.size(1)]
        loss = loss + (out * w).sum()
    loss.backward()
    for rank, (out, grad) in enumerate(results):
        assert torch.equal(out, expected[rank].detach())
        torch.testing.assert_close(grad, xs.grad.chunk(world_size, dim=1)[rank])


def _gather_positions_no_grad(rank, world_size, positions):
    layout = ContextParallelLayout.create(positions.size(1), group=dist.group.WORLD, multiple_of=2)
    local = shard_sequence(positions, layout)
    gathered = gather_no_grad(local.float().requires_grad_(True), group=dist.group.WORLD)
    return gather_no_grad(local, group=dist.group.WORLD), gathered.requires_grad


@WORLD_SIZES
def test_gather_no_grad_returns_the_global_tensor_without_autograd(world_size):
    positions = torch.arange(world_size * 4).repeat(2, 1)
    for gathered, requires_grad in run_on_ranks(world_size, _gather_positions_no_grad, positions):
        assert torch.equal(gathered, positions)
        assert not requires_grad


def _gather_mismatched(rank, world_size, kind):
    if kind == "shape":
        x = torch.randn(1, 3 + rank, 2)
    else:  # float32 and int32: the same byte size, so only the check tells them apart
        x = torch.ones(1, 3, 2, dtype=torch.float32 if rank == 0 else torch.int32)
    try:
        gather_no_grad(x, group=dist.group.WORLD, validate_shapes=True)
    except ValueError as error:
        return str(error)
    return None


def test_gather_with_mismatched_shapes_across_ranks_raises():
    messages = run_on_ranks(2, _gather_mismatched, "shape")
    assert all(m is not None and "[(1, 3, 2), (1, 4, 2)]" in m for m in messages)


def test_gather_with_mismatched_dtypes_across_ranks_raises():
    messages = run_on_ranks(2, _gather_mismatched, "dtype")
    assert all(m is not None and "['torch.float32', 'torch.int32']" in m for m in messages)


@pytest.mark.parametrize(
    ("dtype", "pad_value"),
    [(torch.int64, 0.5), (torch.bool, 2), (torch.int32, float("nan")), (torch.uint8, -1)],
)
def test_shard_sequence_rejects_a_pad_value_the_dtype_cannot_hold(dtype, pad_value):
    layout = ContextParallelLayout.create(6, rank=1, size=2, multiple_of=4, pad=True)
    with pytest.raises(ValueError, match="is not a torch"):
        shard_sequence(torch.zeros(1, 6, dtype=dtype), layout, pad_value=pad_value)
    padded = shard_sequence(torch.zeros(1, 6, dtype=dtype), layout, pad_value=np.int64(1))
    assert padded.shape == (1, 4) and padded[0, -1] == 1


def _layouts_with_a_group(rank, world_size):
    group = dist.group.WORLD
    agreeing = ContextParallelLayout.create(16, group, size=world_size)  # a partial, agreeing hint
    try:
        ContextParallelLayout.create(16, group, rank=0 if rank else 1)
    except ValueError as error:
        return agreeing.rank, str(error)
    return agreeing.rank, None


def test_create_takes_rank_and_size_from_its_group():
    results = run_on_ranks(2, _layouts_with_a_group)
    assert [r for r, _ in results] == [0, 1]
    assert all(m is not None and "come from it" in m for _, m in results)


def test_a_failing_rank_is_reported_with_its_traceback():
    def fail_on_rank_one(rank, world_size):
        if rank == 1:
            raise ValueError("rank one failed")
        return rank

    with pytest.raises(RuntimeError, match="rank one failed"):
        run_on_ranks(2, fail_on_rank_one, timeout=30)


def test_single_rank_collectives_are_identities_and_halo_is_zeros():
    x = torch.randn(2, 5, 3, requires_grad=True)
    assert gather_sequence(x) is x
    assert torch.equal(gather_no_grad(x), x.detach())
    out = gather_halo(x, 2)
    assert torch.equal(out[:, :2], torch.zeros(2, 2, 3)) and torch.equal(out[:, 2:], x.detach())


@pytest.mark.parametrize(
    ("global_length", "multiple_of", "rank", "size", "local"),
    [(64, 8, 0, 4, 16), (64, 8, 3, 4, 16), (100, 4, 2, 3, 36)],
    ids=["even-rank0", "even-last-rank", "padded"],
)
def test_layout_shards_are_contiguous_and_aligned(global_length, multiple_of, rank, size, local):
    layout = ContextParallelLayout.create(
        global_length, multiple_of=multiple_of, rank=rank, size=size, pad=True
    )
    assert layout.local_length == local and layout.local_length % multiple_of == 0
    assert (
        layout.local_start == rank * local and layout.padded_length == size * local >= global_length
    )
    x = torch.arange(global_length)[None]
    shard = shard_sequence(x, layout, pad_value=-1)
    expected = torch.arange(layout.local_start, layout.local_stop)
    expected[expected >= global_length] = -1
    assert torch.equal(shard[0], expected)


def test_single_rank_layout_without_a_group():
    layout = ContextParallelLayout.create(37)
    assert (layout.rank, layout.size, layout.local_start, layout.local_length) == (0, 1, 0, 37)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_length": 10, "size": 4, "rank": 0}, "divisible by size"),
        ({"global_length": 16, "size": 2, "rank": 0, "multiple_of": 3}, "divisible by size"),
        ({"global_length": 16, "size": 2, "rank": 2}, "rank must be in"),
        ({"global_length": 16, "size": 2, "rank": -1}, "rank must be in"),
        ({"global_length": 16, "size": 0, "rank": 0}, "size must be >= 1"),
        ({"global_length": 0, "size": 1, "rank": 0}, "global_length must be >= 1"),
        ({"global_length": 16, "size": 2, "rank": 0, "multiple_of": 0}, "multiple_of must be >= 1"),
    ],
    ids=[
        "length-not-divisible",
        "not-multiple-of-unit",
        "rank-too-large",
        "rank-negative",
        "size-zero",
        "empty",
        "unit-zero",
    ],
)
def test_invalid_layouts_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ContextParallelLayout.create(**kwargs)


def test_shard_sequence_rejects_a_tensor_of_another_length():
    layout = ContextParallelLayout.create(16, rank=0, size=2)
    with pytest.raises(ValueError, match="global_length"):
        shard_sequence(torch.zeros(1, 15), layout)


def test_gather_halo_rejects_halo_larger_than_the_shard():
    with pytest.raises(ValueError, match="halo must be"):
        gather_halo(torch.randn(1, 4, 2), 5)
    with pytest.raises(ValueError, match="halo must be"):
        gather_halo(torch.randn(1, 4, 2), True)


@pytest.mark.parametrize("dim", [3, -4])
def test_collectives_reject_a_dim_outside_the_tensor_instead_of_wrapping_it(dim):
    x = torch.randn(1, 4, 2)
    for fn in (gather_sequence, gather_no_grad):
        with pytest.raises(ValueError, match=r"dim must be an int in \[-3, 3\)"):
            fn(x, None, dim)
    with pytest.raises(ValueError, match=r"dim must be an int in \[-3, 3\)"):
        gather_halo(x, 1, None, dim)
    with pytest.raises(TypeError, match="at least one dim; got a 0-d tensor"):
        gather_no_grad(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"dim must be an int; got 1\.0"):
        gather_sequence(x, None, 1.0)
    assert gather_sequence(x, None, np.int64(-2)) is x  # NumPy integers are ints


@pytest.mark.parametrize(
    "kwargs",
    [{"global_length": 10.0, "size": 2, "rank": 0}, {"global_length": 16, "size": 2, "rank": True}],
    ids=["float-length", "bool-rank"],
)
def test_layouts_take_ints_only(kwargs):
    assert ContextParallelLayout(np.int64(0), 2, 10, 5).rank == 0
    with pytest.raises(TypeError, match="must be an int"):
        ContextParallelLayout.create(**kwargs)
    with pytest.raises(TypeError, match="local_length must be an int"):
        ContextParallelLayout(0, 2, 10, 5.0)


def _none_group_is_single_rank(rank, world_size):
    x = torch.full((1, 3, 2), float(rank))
    layout = ContextParallelLayout.create(6)
    return layout.size, gather_sequence(x).shape, gather_no_grad(x).shape, group_rank_and_size(None)


def test_group_none_is_the_single_rank_group_even_under_torch_distributed():
    for size, gathered, no_grad, rank_size in run_on_ranks(2, _none_group_is_single_rank):
        assert size == 1
        assert gathered == no_grad == (1, 3, 2)
        assert rank_size == (0, 1)


@pytest.mark.multigpu
@pytest.mark.parametrize("case", ["gather", "halo"])
def test_nccl_collectives_match_the_gloo_results(case, monkeypatch):
    """The NCCL path (reduce_scatter_tensor in backward) against the same cases on gloo."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    x, weight = global_inputs(2)
    fn, args = (
        (gather_then_weighted_sum, (x, weight))
        if case == "gather"
        else (halo_roundtrip, (x, weight, 4))
    )
    on_gloo = run_on_ranks(2, fn, *args)
    on_nccl = run_on_ranks(2, fn, *args, backend="nccl", timeout=300)
    for gloo_rank, nccl_rank in zip(on_gloo, on_nccl, strict=True):
        torch.testing.assert_close(nccl_rank[0], gloo_rank[0])
        torch.testing.assert_close(nccl_rank[1], gloo_rank[1])


def test_run_on_ranks_rejects_unknown_backends():
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        run_on_ranks(2, print, backend="mpi")
