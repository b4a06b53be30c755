"""QSA under context parallelism on real gloo ranks: each shard's routes equal the slice of the unsharded routes."""

import pytest
import torch
import torch.distributed as dist
from qsa_cases import document_positions, small_indexer

from sa_cp import ContextParallelLayout, shard_sequence
from sa_cp.testing import run_on_ranks
from sa_routing import QSAContextParallel, rotary_table

GLOBAL_LENGTH = (
    90  # 2 ranks: shards of 45; 4 ranks: shards of 24, padded to 96 (multiples of c = 3)
)
CU_SEQLENS = (0, 20, 22, 59, 85)  # documents straddle shard boundaries at unaligned starts


def _inputs(packed: bool):
    torch.manual_seed(11)
    batch = 1 if packed else 2
    hidden = torch.randn(batch, GLOBAL_LENGTH, 40).to(torch.bfloat16)
    positions = (
        document_positions(CU_SEQLENS, GLOBAL_LENGTH) if packed else torch.arange(GLOBAL_LENGTH)
    )
    freqs = rotary_table(positions.expand(batch, GLOBAL_LENGTH), 8)
    mask = (
        None
        if packed
        else torch.tensor([[1] * GLOBAL_LENGTH, [1] * 61 + [0] * (GLOBAL_LENGTH - 61)])
    )
    return hidden, freqs, mask


def _routes_on_rank(rank: int, world_size: int, packed: bool) -> torch.Tensor:
    indexer = small_indexer(torch.bfloat16)
    hidden, freqs, mask = _inputs(packed)
    layout = ContextParallelLayout.create(GLOBAL_LENGTH, dist.group.WORLD, multiple_of=3, pad=True)
    assert (layout.rank, layout.size) == (rank, world_size)
    ctx = QSAContextParallel.from_layout(
        layout, attention_mask=mask, cu_seqlens=torch.tensor(CU_SEQLENS) if packed else None
    )
    assert (ctx.local_start, ctx.local_length) == (layout.local_start, layout.local_length)
    return indexer(shard_sequence(hidden, layout), shard_sequence(freqs, layout), cp_context=ctx)


@pytest.mark.parametrize("packed", [False, True], ids=["padded-B2", "packed-B1"])
@pytest.mark.parametrize("world_size", [2, 4], ids=["ranks2", "ranks4"])
def test_shard_routes_equal_the_slice_of_unsharded_routes(world_size, packed):
    shards = run_on_ranks(world_size, _routes_on_rank, packed)
    indexer = small_indexer(torch.bfloat16)
    hidden, freqs, mask = _inputs(packed)
    if packed:
        expected = indexer(hidden, freqs, cu_seqlens=CU_SEQLENS)
    else:
        expected = indexer(hidden, freqs, attention_mask=mask)
    routes = torch.cat(shards, dim=1)
    assert routes.shape[1] == {2: 90, 4: 96}[world_size]
    assert torch.equal(routes[:, :GLOBAL_LENGTH], expected)
    assert (routes[:, GLOBAL_LENGTH:] == -1).all()
    assert (expected[:, 30:] >= 0).sum() > 0 and (
        expected[:, 30:].max() >= 30
    )  # later ranks route to earlier shards
