"""The sparse-stage losses in the slot layout: both backends (Triton through its interpreter) against
the float64 oracle on selections with repeats, -1 and sentinel ids, regions of other documents and
tied keys, over documents, padding and CP shards; the slot sort in chunks; and no tensor indexed by
every unit or as large as the selection in int64."""

import pytest
import torch
from distillation_cases import assert_matches_oracle, seeded
from step5_cases import document_positions
from test_distillation import _LargestOutput

from sa_routing import (
    csa_indexer_distillation_loss,
    qsa_indexer_distillation_loss,
    region_metadata,
    select_qsa_token_ids,
)
from sa_routing.distillation import slots
from sa_routing.distillation.reference import (
    csa_indexer_distillation_loss_reference,
    qsa_indexer_distillation_loss_reference,
)
from sa_routing.qsa.lengths import packed_block_starts
from sa_routing.step5.selection.reference import reference_select_regions

BACKENDS = ["torch", "triton"]


QSA_CASES = {
    # name: (batch, queries, total, query_start, lengths, cu_seqlens)
    "padded-B2-S27": (2, 27, 27, 0, [27, 20], None),
    "cp-shard-2-of-2-packed-docs-14-2-17": (1, 18, 36, 18, None, (0, 14, 16, 33)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", QSA_CASES, ids=list(QSA_CASES))
def test_qsa_slot_loss_with_repeated_blocks_and_tied_keys_equals_the_oracle(backend, case) -> None:
    """Main keys and compressed keys tied in pairs of blocks (equal targets and logits), and every
    sparse route's second block replaced by its first (a repeat counts once)."""
    batch, queries, total, start, lengths, cu = QSA_CASES[case]
    c, budget = 3, 9
    units = packed_block_starts(cu, c)[-1] if cu else total // c
    g = seeded(len(case))
    query = torch.randn(batch, queries, 4, 8, generator=g)
    key = torch.randn(batch, total, 2, 8, generator=g)
    key[:, 3:6] = key[:, 0:3]  # blocks 0 and 1 of the first document: equal keys
    iq = torch.randn(batch, queries, 3, 6, generator=g)
    ck = torch.randn(batch, units, 1, 6, generator=g)
    ck[:, 1] = ck[:, 0]
    iq, ck = iq.requires_grad_(), ck.requires_grad_()
    routes = select_qsa_token_ids(
        iq.detach(),
        ck.detach(),
        lengths,
        token_budget=budget,
        compress_ratio=c,
        query_position_offset=start,
        global_sequence_length=total,
        cu_seqlens=cu,
    ).clone()
    routes[:, 1::2, c : 2 * c] = routes[:, 1::2, :c]  # odd rows: block 2 := block 1
    common = dict(
        token_budget=budget,
        compress_ratio=c,
        mode="sparse",
        routes=routes,
        sequence_lengths=lengths,
        cu_seqlens=cu,
        query_start=start,
        softmax_scale=0.4,
    )
    loss = qsa_indexer_distillation_loss(query, key, iq, ck, **common, backend=backend)
    oracle, _ = qsa_indexer_distillation_loss_reference(query, key, iq, ck, **common)
    assert_matches_oracle(
        loss, torch.autograd.grad(loss, (iq, ck)), oracle, torch.autograd.grad(oracle, (iq, ck))
    )


def _csa_layout() -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0: documents 14 + 4 + 18; row 1: a 30-token document with 3 padding tokens inside it (after
    its position 11), then padding."""
    pos0, pad0 = document_positions([14, 4, 18], 36)
    pos1 = torch.tensor([*range(12), 0, 0, 0, *range(12, 30)] + [0] * 3)
    pad1 = torch.tensor([False] * 12 + [True] * 3 + [False] * 18 + [True] * 3)
    return torch.stack([pos0, pos1]), torch.stack([pad0, pad1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("start", "queries"), [(0, 36), (12, 24)], ids=["unsharded", "cp-rows-12-36"]
)
def test_csa_slot_loss_with_repeats_invalid_ids_and_foreign_regions_equals_the_oracle(
    backend, start, queries
) -> None:
    """Region ids with a repeated region, -1 and sentinel ids, and a region of another document
    (a candidate without mass); region keys tied in one pair of regions."""
    region, topk = 3, 3
    pos, pad = _csa_layout()
    m = region_metadata(pos, pad, start, queries, region, topk, tile_size=8)
    g = seeded(start + queries)
    query = torch.randn(2, queries, 4, 8, generator=g)
    key = torch.randn(2, 36, 2, 8, generator=g)
    iq = torch.randn(2, queries, 2, 3, 6, generator=g).requires_grad_()
    iw = torch.randn(2, queries, 2, 3, generator=g).requires_grad_()
    summaries = torch.randn(2, m.region_count, 6, generator=g)
    summaries[:, 1] = summaries[:, 0]
    summaries.requires_grad_()
    ids = reference_select_regions(
        iq.detach(), iw.detach(), summaries.detach(), pos, pad, start, region, topk
    ).clone()  # [2, G, Q, topk + 1], ascending, the current region last for sparse queries
    ids[:, :, ::3, 1] = ids[:, :, ::3, 0]  # a repeat
    ids[0, 1, 1::3, 0] = -1
    ids[1, 0, 2::3, 1] = m.region_count
    ids[0, 0, 2::3, 0] = 0  # row 0's region 0 lies in the first document: foreign to later ones
    kwargs = dict(mode="sparse", selection=ids, softmax_scale=0.4)
    loss = csa_indexer_distillation_loss(
        query, key, iq, iw, summaries, m, **kwargs, query_block=5, backend=backend
    )
    oracle, _ = csa_indexer_distillation_loss_reference(
        query, key, iq, iw, summaries, pos, pad, region_size=region, topk=topk, mode="sparse",
        region_ids=ids, query_start=start, softmax_scale=0.4,
    )  # fmt: skip
    inputs = (iq, iw, summaries)
    assert_matches_oracle(
        loss, torch.autograd.grad(loss, inputs), oracle, torch.autograd.grad(oracle, inputs)
    )


def test_no_tensor_of_a_2k_token_sparse_loss_is_indexed_by_every_unit() -> None:
    """2048 tokens, 1024 blocks, 16 selected: nothing larger than the inputs, the slot layout
    `[queries, 16]` or one tile's gathered keys exists in the forward or the backward; a tile of 128
    queries against every block (131k elements) already exceeds that bound."""
    total, c, budget, query_block = 2048, 2, 32, 128
    g = seeded(11)
    query = torch.randn(1, total, 2, 8, generator=g)
    key = torch.randn(1, total, 1, 8, generator=g)
    iq = torch.randn(1, total, 2, 6, generator=g).requires_grad_()
    ck = torch.randn(1, total // c, 1, 6, generator=g).requires_grad_()
    routes = select_qsa_token_ids(
        iq.detach(), ck.detach(), None, token_budget=budget, compress_ratio=c
    )
    slots = budget // c
    inputs = max(t.numel() for t in (query, key, iq, ck, routes))
    gathered = query_block * (slots * c + c) * 8  # one tile's main keys of one KV head
    bound = max(inputs, total * slots * 2, gathered)
    assert bound < query_block * (total // c + 1)
    with _LargestOutput() as record:
        loss = qsa_indexer_distillation_loss(
            query, key, iq, ck, token_budget=budget, compress_ratio=c, mode="sparse",
            routes=routes, query_block=query_block, backend="torch",
        )  # fmt: skip
        loss.backward()
    assert loss.item() > 0 and iq.grad.abs().sum() > 0 and ck.grad.abs().sum() > 0
    assert record.numel <= bound, (record.numel, bound)


def _sorted_slots_at_once(ids, units, exclude):
    keep = (ids >= 0) & (ids < units) & (ids != exclude)
    ordered = torch.where(keep, ids, units).sort(dim=-1).values
    previous = torch.nn.functional.pad(ordered[..., :-1], (1, 0), value=-1)
    return ordered.to(torch.int32), (ordered < units) & (ordered != previous)


@pytest.mark.parametrize("per_query_exclude", [True, False], ids=["exclude-per-query", "exclude-1"])
def test_slots_sorted_in_chunks_equal_one_sort(monkeypatch, per_query_exclude) -> None:
    """Chunks of 3 query rows (of 2 x 3 x 10 rows): -1, sentinel and int64 ids beyond int32 (2^32 + 3
    would wrap to the valid id 3), repeats, and excluded ids, against one sort of the whole."""
    monkeypatch.setattr(slots, "_SORT_ELEMENTS", 3 * 6 * 7)
    units = 9
    g = seeded(5)
    ids = torch.randint(-1, units + 2, (2, 3, 10, 7), generator=g)
    ids[:, :, ::2, 1] = ids[:, :, ::2, 0]
    ids[0, 1, 4, 2] = 2**32 + 3
    shape = (2, 1, 10, 1) if per_query_exclude else (1, 1, 1, 1)
    exclude = torch.randint(-1, units, shape, generator=g)
    exclude[exclude == 3] = 5  # 3 stays a valid id: only the range check drops the wrapped one
    got = slots.sorted_slots(ids, units, exclude=exclude)
    want = _sorted_slots_at_once(ids, units, exclude)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].any() and not got[1].all()


def test_no_tensor_of_a_4k_token_csa_sparse_loss_outgrows_the_selection_in_bytes(
    monkeypatch,
) -> None:
    """4096 tokens, top-16 regions of 8 per group: the selection is int32 [1, 2, 4096, 17]; no tensor
    of the forward or backward takes more bytes than it, an input or a tile of 64 queries (an
    int64 copy of the selection would take twice its bytes)."""
    monkeypatch.setattr(slots, "_SORT_ELEMENTS", 1 << 12)
    total, region, topk, groups = 4096, 8, 16, 2
    pos, pad = document_positions([total], total)
    m = region_metadata(pos[None], pad[None], 0, total, region, topk)
    g = seeded(13)
    query = torch.randn(1, total, 4, 8, generator=g)
    key = torch.randn(1, total, groups, 8, generator=g)
    iq = torch.randn(1, total, groups, 2, 6, generator=g).requires_grad_()
    iw = torch.randn(1, total, groups, 2, generator=g).requires_grad_()
    summaries = torch.randn(1, m.region_count, 6, generator=g).requires_grad_()
    ids = reference_select_regions(
        iq.detach(), iw.detach(), summaries.detach(), pos[None], pad[None], 0, region, topk
    ).to(torch.int32)
    inputs = max(t.numel() * t.element_size() for t in (query, key, iq, iw, summaries, ids))
    # one tile of 64 queries, FP32: main keys of one (group, KV head), or every group's index keys
    tile = 64 * (topk + 1) * max(region * 8, groups * 6) * 4
    bound = max(inputs, tile, 8 * (1 << 12))
    assert bound < 2 * ids.numel() * ids.element_size()
    with _LargestOutput() as record:
        loss = csa_indexer_distillation_loss(
            query, key, iq, iw, summaries, m, mode="sparse", selection=ids, query_block=64,
            backend="torch",
        )  # fmt: skip
        loss.backward()
    assert loss.item() > 0 and iq.grad.abs().sum() > 0 and summaries.grad.abs().sum() > 0
    assert record.bytes <= bound, (record.bytes, bound)
