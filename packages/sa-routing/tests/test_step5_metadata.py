"""region_metadata: hand-computed layouts, tiles, shards, varlen layouts and every input error."""

import dataclasses

import pytest
import torch
from step5_cases import document_positions

from sa_routing import region_metadata
from sa_routing.step5.metadata.reference import reference_regions

# Two documents (7 and 5 tokens), two padding tokens; region 2, topk 1.
HAND_POS, HAND_PAD = document_positions([7, 5], 14)


def test_two_documents_region2_topk1_match_hand_computed_tensors() -> None:
    m = region_metadata(HAND_POS[None], HAND_PAD[None], 0, 14, region_size=2, topk=1)
    assert m.region_count == 7
    assert m.token_regions.tolist() == [[0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 5, 6, -1, -1]]
    assert m.documents.tolist() == [[0] * 7 + [1] * 5 + [-1, -1]]
    assert m.region_documents.tolist() == [[0, 0, 0, 0, 1, 1, 1]]
    assert m.region_first.tolist() == [[0, 0, 0, 0, 4, 4, 4]]
    assert m.current.tolist() == m.token_regions.tolist()
    assert m.query_documents.tolist() == m.documents.tolist()
    assert m.sparse_queries[0].nonzero().flatten().tolist() == [4, 5, 6, 11]
    n = 7
    assert m.dense_region_ids.dtype == torch.int32
    assert m.dense_region_ids[0].tolist() == [
        [0, n], [0, n], [0, 1], [0, 1], [n, n], [n, n], [n, n],
        [4, n], [4, n], [4, 5], [4, 5], [n, n], [n, n], [n, n],
    ]  # fmt: skip
    assert m.score_tiles == ((0, 4, 12, 0, 6),)
    assert m.summary_ranges == ((0, 0, 6),)
    assert m.region_sources.dtype == torch.int32
    assert m.region_sources[0].tolist() == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, -1],
        [7, 8],
        [9, 10],
        [11, -1],
    ]
    assert torch.equal(m.region_source_valid, m.region_sources >= 0)
    assert m.query_padding[0].tolist() == [False] * 12 + [True, True]
    assert not m.all_padding_key


def test_small_tiles_split_sparse_rows_and_skip_dense_chunks() -> None:
    m = region_metadata(HAND_POS[None], HAND_PAD[None], 0, 14, region_size=2, topk=1, tile_size=3)
    # chunks [0,3) dense, [3,6) sparse 4-5, [6,9) sparse 6, [9,12) sparse 11, [12,14) padding
    assert m.score_tiles == ((0, 4, 6, 0, 2), (0, 6, 7, 0, 3), (0, 11, 12, 4, 6))
    assert m.summary_ranges == ((0, 0, 3), (0, 4, 6))


def test_score_tiles_span_the_regions_of_their_sparse_queries() -> None:
    pos_a, pad_a = document_positions([37, 5, 60, 9], 120)
    pos_b, pad_b = document_positions([101, 3], 120)
    pos, pad = torch.stack([pos_a, pos_b]), torch.stack([pad_a, pad_b])
    m = region_metadata(pos, pad, 10, 100, region_size=3, topk=4, tile_size=16)
    assert len(m.score_tiles) > 2
    for b, q0, q1, first, past in m.score_tiles:
        sparse = m.sparse_queries[b, q0:q1]
        assert first == int(m.query_first_region[b, q0:q1][sparse].min())
        assert past == int(m.current[b, q0:q1][sparse].max())


def test_causal_and_window_layouts_of_a_shard_cover_its_documents() -> None:
    m = region_metadata(HAND_POS[None], HAND_PAD[None], 5, 6, region_size=2, topk=1, window=3)
    causal, window = m.causal_layout, m.window_layout
    assert causal is not None and window is not None
    # shard rows 5..10: doc 0 rows 5-6 (keys 0..6), doc 1 rows 7-10 (keys 7..10)
    assert causal.cu_seqlens_q.tolist() == [0, 2, 6]
    assert causal.cu_seqlens_k.tolist() == [0, 7, 11]
    assert (causal.max_seqlen_q, causal.max_seqlen_k) == (4, 7)
    assert causal.query_start.tolist() == [0, 2] and causal.query_stop.tolist() == [2, 6]
    assert causal.key_start.tolist() == [0, 7] and causal.key_stop.tolist() == [7, 11]
    assert window.key_start.tolist() == [3, 7]
    assert window.cu_seqlens_k.tolist() == [0, 4, 8]
    assert window.max_seqlen_k == 4


def test_layout_flat_offsets_include_the_batch_row() -> None:
    pos_a, pad_a = document_positions([9], 10)
    pos_b, pad_b = document_positions([4, 3], 10)
    m = region_metadata(
        torch.stack([pos_a, pos_b]), torch.stack([pad_a, pad_b]), 2, 8, region_size=2, topk=1
    )
    layout = m.causal_layout
    assert layout is not None
    # row 0: rows 2..8 valid (doc 0); row 1: rows 2,3 (doc 0), 4..6 (doc 1), 7..9 padding
    assert layout.query_start.tolist() == [0, 8, 10]
    assert layout.query_stop.tolist() == [7, 10, 13]
    assert layout.key_start.tolist() == [0, 10, 14]
    assert layout.key_stop.tolist() == [9, 14, 17]
    assert layout.cu_seqlens_q.tolist() == [0, 7, 9, 12]


def test_interior_padding_keeps_regions_but_drops_the_varlen_layout() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 3, 4, 5, 6]])
    pad = torch.tensor([[False, False, False, True, False, False, False, False]])
    m = region_metadata(pos, pad, 0, 8, region_size=2, topk=1)
    assert m.causal_layout is None and m.window_layout is None
    assert m.token_regions.tolist() == [[0, 0, 1, -1, 1, 2, 2, 3]]
    assert m.region_sources[0].tolist() == [[0, 1], [2, 4], [5, 6], [7, -1]]
    with pytest.raises(ValueError, match="right-padded tail"):
        region_metadata(pos, pad, 0, 8, region_size=2, topk=1, require_varlen_layout=True)


def test_fully_padded_shard_scores_nothing_and_gets_a_singleton_layout() -> None:
    pos, pad = document_positions([10], 16)
    m = region_metadata(pos[None], pad[None], 12, 4, region_size=2, topk=1, window=4)
    assert m.all_padding_key
    assert m.score_tiles == () and not m.sparse_queries.any()
    assert (m.dense_region_ids == m.region_count).all()
    assert m.causal_layout is not None
    assert m.causal_layout.cu_seqlens_q.tolist() == [0, 1]
    assert m.causal_layout.key_start.tolist() == [12]


@pytest.mark.parametrize("shards", [2, 3, 4], ids=lambda n: f"cp{n}")
def test_shard_metadata_equals_the_slice_of_the_unsharded_metadata(shards: int) -> None:
    torch.manual_seed(shards)
    total = 96
    rows = [document_positions([40, 3, 30], total), document_positions([71], total)]
    pos = torch.stack([r[0] for r in rows])
    pad = torch.stack([r[1] for r in rows])
    full = region_metadata(pos, pad, 0, total, region_size=3, topk=4, tile_size=8)
    local = total // shards
    for rank in range(shards):
        m = region_metadata(pos, pad, rank * local, local, region_size=3, topk=4, tile_size=8)
        rows_ = slice(rank * local, (rank + 1) * local)
        for name in ("token_regions", "documents", "region_documents", "region_sources"):
            assert torch.equal(getattr(m, name), getattr(full, name)), name
        for name in (
            "current",
            "query_documents",
            "sparse_queries",
            "dense_region_ids",
            "query_first_region",
        ):
            assert torch.equal(getattr(m, name), getattr(full, name)[:, rows_]), name
        assert m.region_count == full.region_count


def test_metadata_matches_the_token_walk_of_the_reference() -> None:
    torch.manual_seed(1)
    pos_a, pad_a = document_positions([13, 1, 29, 8], 60)
    pos_b, pad_b = document_positions([2, 44], 60)
    pos, pad = torch.stack([pos_a, pos_b]), torch.stack([pad_a, pad_b])
    m = region_metadata(pos, pad, 0, 60, region_size=4, topk=2)
    token_regions, region_documents, region_first = reference_regions(pos, pad, 4)
    assert m.token_regions.tolist() == token_regions
    for b in range(2):
        n = len(region_documents[b])
        assert m.region_documents[b, :n].tolist() == region_documents[b]
        assert m.region_first[b, :n].tolist() == region_first[b]
        assert (m.region_documents[b, n:] == -1).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"key_positions": torch.zeros(1, 8, dtype=torch.int32)}, TypeError, "int64"),
        ({"key_positions": torch.zeros(8, dtype=torch.int64)}, ValueError, "batch, global_length"),
        (
            {"key_padding": torch.zeros(1, 8, dtype=torch.int64)},
            TypeError,
            "key_padding must be a bool",
        ),
        ({"key_padding": torch.zeros(1, 7, dtype=torch.bool)}, ValueError, "shape"),
        ({"key_positions": torch.tensor([[0, 1, -2, 0, 1, 2, 3, 4]])}, ValueError, ">= 0"),
        (
            {"key_positions": torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])},
            ValueError,
            "start every document at 0",
        ),
        (
            {"key_positions": torch.tensor([[0, 1, 2, 4, 5, 6, 7, 8]])},
            ValueError,
            "count up by one",
        ),
        ({"query_start": 5, "queries": 4}, ValueError, "global length 8"),
        ({"queries": 0}, ValueError, "queries"),
        ({"region_size": 0}, ValueError, "region_size"),
        ({"topk": 0}, ValueError, "topk"),
        ({"window": 0}, ValueError, "window"),
        ({"tile_size": 129}, ValueError, "tile_size"),
        (
            {"key_positions": torch.zeros(0, 8, dtype=torch.int64)},
            ValueError,
            "at least one batch row and one token",
        ),
    ],
    ids=[
        "positions-int32",
        "positions-1d",
        "padding-int",
        "padding-shape",
        "negative-position",
        "document-not-at-0",
        "position-gap",
        "queries-past-end",
        "no-queries",
        "region-size-0",
        "topk-0",
        "window-0",
        "tile-129",
        "batch-0",
    ],
)
def test_bad_inputs_raise_naming_the_argument(kwargs: dict, error: type, match: str) -> None:
    args = {
        "key_positions": torch.arange(8)[None],
        "key_padding": None,
        "query_start": 0,
        "queries": 8,
        "region_size": 2,
        "topk": 1,
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        region_metadata(**args)


def test_default_tiles_hold_at_most_128_queries_and_cover_each_sparse_query_once() -> None:
    pos, pad = document_positions([300, 500, 211], 1100)
    m = region_metadata(pos[None], pad[None], 0, 1100, region_size=8, topk=16)
    covered = torch.zeros(1100, dtype=torch.int64)
    for _, q0, q1, _, _ in m.score_tiles:
        assert 0 < q1 - q0 <= 128
        covered[q0:q1] += 1
    assert covered.max() == 1
    assert (covered[m.sparse_queries[0]] == 1).all()


@pytest.mark.gpu
def test_metadata_at_128k_uses_one_host_sync_on_cuda() -> None:
    import warnings

    lengths = [16384 + 37 * (i - 4) for i in range(8)]  # 8 documents, 130,924 tokens
    total = sum(lengths) + 512  # then a padding tail
    pos, pad = document_positions(lengths, total)
    pos, pad = pos[None].cuda(), pad[None].cuda()
    region_metadata(pos, pad, 0, total, region_size=8, topk=512)  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = region_metadata(pos, pad, 0, total, region_size=8, topk=512)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
    cpu = region_metadata(pos.cpu(), pad.cpu(), 0, total, region_size=8, topk=512)
    assert m.score_tiles == cpu.score_tiles
    assert torch.equal(m.dense_region_ids.cpu(), cpu.dense_region_ids)
    assert torch.equal(m.region_sources.cpu(), cpu.region_sources)


def test_region_metadata_is_frozen_and_holds_only_immutable_host_values() -> None:
    m = region_metadata(HAND_POS[None], HAND_PAD[None], 0, 14, region_size=2, topk=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.region_count = 0  # type: ignore[misc]
    for field in dataclasses.fields(m):
        value = getattr(m, field.name)
        assert not isinstance(value, dict | list | set), field.name
        if isinstance(value, tuple):
            assert all(isinstance(part, tuple) for part in value), field.name
