"""select_regions (tiles, running top-k, composite keys) against the plain PyTorch oracle."""

import contextlib
import gc
import zlib

import pytest
import torch
from step5_cases import document_positions

from sa_routing import region_metadata, select_regions
from sa_routing.step5.selection import (
    MERGE_WIDTH_GROWTH,
    _merge_tiles,
    score_call_bytes,
    select_regions_tiled,
)
from sa_routing.step5.selection.reference import (
    reference_select_regions,
    selections_differ_beyond_ties,
)

BACKENDS = ["reference", "triton"]
METHODS = ["threshold", "composite"]


def integer_inputs(
    batch: int,
    queries: int,
    regions: int,
    groups: int,
    heads: int,
    dim: int,
    spread: int,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Small integers: exact in E4M3 and in every FP32 summation order, so scores tie often and exactly."""
    query = torch.randint(-spread, spread + 1, (batch, queries, groups, heads, dim), device=device)
    weights = torch.randint(-spread, spread + 1, (batch, queries, groups, heads), device=device)
    summary = torch.randint(-spread, spread + 1, (batch, regions, dim), device=device)
    return query.to(torch.bfloat16), weights.float(), summary.to(torch.bfloat16)


# Two documents (7 and 5 tokens), two padding tokens; region 2, topk 1; regions 0-3 and 4-6.
HAND_POS, HAND_PAD = document_positions([7, 5], 14)
N = 7
DENSE_A = [[0, N], [0, N], [0, 1], [0, 1]]
DENSE_B = [[4, N], [4, N], [4, 5], [4, 5]]
PAD_ROWS = [[N, N], [N, N]]


def hand_inputs(values: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Region r scores relu(values[r]) in group 0 and -relu(values[r]) in group 1 (one head, dim 16)."""
    query = torch.zeros(1, 14, 2, 1, 16, dtype=torch.bfloat16)
    query[..., 0] = 1
    weights = torch.tensor([1.0, -1.0]).view(1, 1, 2, 1).expand(1, 14, 2, 1).contiguous()
    summary = torch.zeros(1, N, 16, dtype=torch.bfloat16)
    summary[0, :, 0] = torch.tensor(values)
    return query, weights, summary


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("values", "group0", "group1"),
    [
        (
            [1, 3, 2, 5, 4, 1, 2],
            [*DENSE_A, [1, 2], [1, 2], [1, 3], *DENSE_B, [4, 6], *PAD_ROWS],
            [*DENSE_A, [0, 2], [0, 2], [0, 3], *DENSE_B, [5, 6], *PAD_ROWS],
        ),
        (
            [3, 3, 2, 5, 4, 4, 2],
            [*DENSE_A, [0, 2], [0, 2], [0, 3], *DENSE_B, [4, 6], *PAD_ROWS],
            [*DENSE_A, [0, 2], [0, 2], [2, 3], *DENSE_B, [4, 6], *PAD_ROWS],
        ),
    ],
    ids=["distinct-scores", "tied-scores-lower-id-wins"],
)
def test_two_documents_region2_topk1_select_hand_computed_ids(
    method: str, backend: str, values: list[float], group0: list, group1: list
) -> None:
    m = region_metadata(HAND_POS[None], HAND_PAD[None], 0, 14, region_size=2, topk=1)
    query, weights, summary = hand_inputs(values)
    ids = select_regions(query, weights, summary, m, method=method, backend=backend)
    assert ids.dtype == torch.int32 and ids.shape == (1, 2, 14, 2)
    assert ids[0, 0].tolist() == group0
    assert ids[0, 1].tolist() == group1
    oracle = reference_select_regions(
        query, weights, summary, HAND_POS[None], HAND_PAD[None], 0, 2, 1
    )
    assert torch.equal(ids, oracle)


CASES = [
    # (documents per row, total, region_size, topk, tile, region_chunk, groups, heads, dim)
    ([[37, 5, 60], [101, 3]], 110, 3, 4, 16, 7, "short-docs-padding-chunked"),
    ([[2, 1, 90], [1, 1, 1, 50]], 97, 1, 6, 32, 1000, "region1-tiny-docs"),
    ([[130]], 131, 5, 2, 128, 3, "one-doc-padding-at-region-end"),
    ([[25, 25, 24]], 80, 8, 2, 9, 4, "sparse-threshold-exactly"),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("spread", "groups", "heads", "dim"),
    [(1, 2, 3, 16), (2, 4, 1, 24)],
    ids=["G2-H3-D16", "G4-H1-D24"],
)
@pytest.mark.parametrize(
    ("docs", "total", "region", "topk", "tile", "chunk", "case_id"),
    CASES,
    ids=[c[-1] for c in CASES],
)
def test_fast_selection_equals_oracle_bit_for_bit_with_exact_ties(
    method: str,
    backend: str,
    spread: int,
    groups: int,
    heads: int,
    dim: int,
    docs: list,
    total: int,
    region: int,
    topk: int,
    tile: int,
    chunk: int,
    case_id: str,
) -> None:
    torch.manual_seed(zlib.crc32(case_id.encode()))
    rows = [document_positions(d, total) for d in docs]
    pos, pad = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    m = region_metadata(pos, pad, 0, total, region, topk, tile_size=tile)
    assert m.score_tiles, "the case must exercise scoring"
    query, weights, summary = integer_inputs(
        len(docs), total, m.region_count, groups, heads, dim, spread
    )
    out = select_regions(
        query, weights, summary, m, region_chunk=chunk, method=method, backend=backend
    )
    oracle = reference_select_regions(query, weights, summary, pos, pad, 0, region, topk)
    assert torch.equal(out, oracle)


def test_queries_exactly_at_the_sparse_threshold_are_dense_and_one_past_are_scored() -> None:
    region, topk = 4, 3
    pos, pad = document_positions([40], 40)
    m = region_metadata(pos[None], pad[None], 0, 40, region, topk)
    # history = pos // 4: pos 15 has 3 historical regions (dense); pos 16 has 4 (sparse).
    assert not m.sparse_queries[0, 15] and m.sparse_queries[0, 16]
    assert m.dense_region_ids[0, 15].tolist() == [0, 1, 2, 3]
    torch.manual_seed(3)
    query, weights, summary = integer_inputs(1, 40, m.region_count, 2, 2, 16, 2)
    out = select_regions(query, weights, summary, m)
    assert out[0, :, 15].tolist() == [[0, 1, 2, 3]] * 2
    assert (out[0, :, 16, -1] == 4).all()  # the current region is always kept
    assert torch.equal(
        out,
        reference_select_regions(query, weights, summary, pos[None], pad[None], 0, region, topk),
    )


@pytest.mark.parametrize("shards", [2, 4], ids=lambda n: f"cp{n}")
def test_shard_selection_equals_the_slice_of_the_unsharded_selection(shards: int) -> None:
    torch.manual_seed(shards)
    total, region, topk = 120, 3, 4
    rows = [document_positions([50, 2, 44], total), document_positions([101], total)]
    pos, pad = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    full_meta = region_metadata(pos, pad, 0, total, region, topk, tile_size=16)
    query, weights, summary = integer_inputs(2, total, full_meta.region_count, 2, 2, 16, 1)
    full = select_regions(query, weights, summary, full_meta)
    local = total // shards
    for rank in range(shards):
        rows_ = slice(rank * local, (rank + 1) * local)
        m = region_metadata(pos, pad, rank * local, local, region, topk, tile_size=16)
        shard = select_regions(query[:, rows_], weights[:, rows_], summary, m)
        assert torch.equal(shard, full[:, :, rows_])


def test_real_valued_scores_select_the_oracle_ids_up_to_fp32_near_ties() -> None:
    torch.manual_seed(11)
    total, region, topk = 150, 2, 5
    pos, pad = document_positions([61, 80], total)
    m = region_metadata(pos[None], pad[None], 0, total, region, topk, tile_size=32)
    query = torch.randn(1, total, 2, 4, 32).to(torch.float8_e4m3fn).to(torch.bfloat16)
    weights = torch.randn(1, total, 2, 4)
    summary = torch.randn(1, m.region_count, 32).to(torch.float8_e4m3fn).to(torch.bfloat16)
    out = select_regions(query, weights, summary, m, region_chunk=11)
    oracle = reference_select_regions(
        query, weights, summary, pos[None], pad[None], 0, region, topk, torch.float64
    )
    differing, beyond_ties = selections_differ_beyond_ties(
        out, oracle, query, weights, summary, m.region_count
    )
    assert beyond_ties == []
    assert differing <= 2


def test_tiles_spanning_documents_never_select_an_earlier_documents_regions() -> None:
    # one merged tile holds the sparse tails of documents A and B; A's regions score highest for
    # every query, so any unmasked column of A in B's rows would be chosen
    torch.manual_seed(3)
    region, topk, total = 1, 2, 64
    pos, pad = document_positions([27, 31], total)
    m = region_metadata(pos[None], pad[None], 0, total, region, topk, tile_size=8)
    regions_a = int(m.token_regions[0, 26]) + 1
    query = torch.rand(1, total, 2, 3, 16).add(0.5).to(torch.bfloat16)
    weights = torch.rand(1, total, 2, 3).add(0.5)
    summary = torch.rand(1, m.region_count, 16).to(torch.bfloat16)
    summary[0, :regions_a] += 8
    out = select_regions(query, weights, summary, m)
    oracle = reference_select_regions(
        query, weights, summary, pos[None], pad[None], 0, region, topk
    )
    assert torch.equal(out, oracle)
    rows_b = m.sparse_queries[0] & (m.query_documents[0] == 1)
    assert rows_b.any() and (out[0][:, rows_b] >= regions_a).all()
    call_bytes = score_call_bytes("threshold", "cpu", 16384, topk)
    merged = _merge_tiles(m.score_tiles, groups=2, budget=2**30, call_bytes=call_bytes)
    assert any(t[3] < regions_a <= t[4] and t[2] > 30 for t in merged), "a tile spans A and B"


def test_the_score_budget_counts_the_bytes_each_method_allocates() -> None:
    # threshold: FP32 scores, plus stable_topk's PyTorch workspace (12 bytes) off its GPU kernels,
    # plus, over several chunks, the running candidates (score and int64 id over topk + chunk)
    on_gpu = score_call_bytes("threshold", "cuda", 1000, 64)
    assert on_gpu(10, 800) == 10 * 800 * 4
    # score rows are padded to 16 entries: a 1000-region chunk holds 1008 per row
    assert on_gpu(10, 3000) == 10 * 1008 * 4 + 10 * 1064 * 12
    assert score_call_bytes("threshold", "cpu", 1000, 64)(10, 800) == 10 * 800 * 16
    assert score_call_bytes("composite", "cuda", 1000, 64)(10, 3000) == 10 * (1008 * 4 + 1000 * 16)
    pos, pad = document_positions([3000], 3000)
    m = region_metadata(pos[None], pad[None], 0, 3000, 8, 4, tile_size=16)
    wide = _merge_tiles(m.score_tiles, 4, 2**20, score_call_bytes("threshold", "cuda", 16384, 4))
    narrow = _merge_tiles(m.score_tiles, 4, 2**20, score_call_bytes("composite", "cuda", 16384, 4))
    assert len(wide) < len(narrow)
    for tiles in (wide, narrow):  # the same rows, each call within the budget
        assert tiles[0][1] == m.score_tiles[0][1]
        assert sum(t[2] - t[1] for t in tiles) == sum(t[2] - t[1] for t in m.score_tiles)
    assert all((q1 - q0) * 4 * (r1 - r0) * 4 <= 2**20 for _, q0, q1, r0, r1 in wide if q1 - q0 > 16)


def test_merged_calls_grow_at_most_by_the_width_bound() -> None:
    # one long document: tile widths grow with the position, so a call over many tiles scores a
    # rectangle much larger than its rows' causal ranges unless its width is bounded
    pos, pad = document_positions([6000], 6000)
    m = region_metadata(pos[None], pad[None], 0, 6000, 8, 16, tile_size=32)
    call_bytes = score_call_bytes("threshold", "cuda", 16384, 16)
    bounded = _merge_tiles(m.score_tiles, 4, 2**30, call_bytes)
    unbounded = _merge_tiles(m.score_tiles, 4, 2**30, call_bytes, max_growth=float("inf"))
    assert len(unbounded) == 1 < len(bounded)
    first_width = {q0: r1 - r0 for _, q0, _, r0, r1 in m.score_tiles}
    for _, q0, _, r0, r1 in bounded:
        assert r1 - r0 <= MERGE_WIDTH_GROWTH * first_width[q0]
    rows = lambda tiles: sorted(q for t in tiles for q in range(t[1], t[2]))
    assert rows(bounded) == rows(m.score_tiles)


@pytest.mark.parametrize("rows", [5, 500], ids=["tail-of-a-long-tile", "whole-tile"])
def test_causal_bound_masks_every_region_from_the_current_one_on(rows: int) -> None:
    # scores grow with the region id, so a region at or after a query's current one would win if any
    # column of the causal bound were left unmasked
    region, topk, total = 1, 4, rows + 20
    pos, pad = document_positions([total], total)
    m = region_metadata(pos[None], pad[None], 0, total, region, topk)
    query = torch.ones(1, total, 1, 1, 16, dtype=torch.bfloat16)
    weights = torch.ones(1, total, 1, 1)
    summary = torch.arange(m.region_count).float().div(8).view(1, -1, 1).expand(1, -1, 16)
    summary = summary.to(torch.bfloat16).contiguous()
    out = select_regions(query, weights, summary, m, region_chunk=7)
    oracle = reference_select_regions(
        query, weights, summary, pos[None], pad[None], 0, region, topk
    )
    assert torch.equal(out, oracle)
    q = total - 1  # history of q regions: its topk best are the last four before its own
    assert out[0, 0, q].tolist() == [q - 4, q - 3, q - 2, q - 1, q]


def test_merged_tiles_score_exactly_the_rows_of_the_metadata_tiles() -> None:
    # doc 1's first 10 rows are dense and hold no tile: merging must not bridge them
    pos, pad = document_positions([30, 12, 40], 82)
    m = region_metadata(pos[None], pad[None], 0, 82, region_size=2, topk=4, tile_size=8)
    call_bytes = score_call_bytes("threshold", "cpu", 64, 4)
    merged = _merge_tiles(m.score_tiles, groups=2, budget=2**30, call_bytes=call_bytes)
    assert len(merged) < len(m.score_tiles)
    rows = lambda tiles: sorted(q for t in tiles for q in range(t[1], t[2]))
    assert rows(merged) == rows(m.score_tiles)
    assert not any(m.sparse_queries[0, 30:40])


@contextlib.contextmanager
def _uninitialised_memory_filled():
    """New tensors filled with a sentinel (torch's deterministic mode): a result that leaves part
    of its output unwritten then differs from the oracle."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]


@pytest.mark.parametrize("project_rows", [1, 20, 45, 10_000])
def test_every_scored_row_is_projected_once_in_spans_of_whole_calls(project_rows: int) -> None:
    # two batch rows, dense gaps inside the first (documents' first rows hold no tile), 1-byte budget
    # (no merging) and 2**30 (merged calls)
    pos_a, pad_a = document_positions([30, 12, 40], 90)
    pos_b, pad_b = document_positions([85], 90)
    pos, pad = torch.stack([pos_a, pos_b]), torch.stack([pad_a, pad_b])
    m = region_metadata(pos, pad, 0, 90, region_size=2, topk=4, tile_size=8)
    query, weights, summary = integer_inputs(2, 90, m.region_count, 2, 2, 16, spread=3)
    for budget in (1, 2**30):
        asked: list[tuple[int, int, int]] = []

        def tile_inputs(b: int, q0: int, q1: int, asked=asked) -> tuple[torch.Tensor, torch.Tensor]:
            asked.append((b, q0, q1))
            return query[b : b + 1, q0:q1], weights[b : b + 1, q0:q1]

        with _uninitialised_memory_filled():  # a row the selection never writes shows
            ids = select_regions_tiled(
                tile_inputs, 2, summary, m, score_budget_bytes=budget, project_rows=project_rows
            )
        oracle = reference_select_regions(query, weights, summary, pos, pad, 0, 2, 4)
        assert torch.equal(ids, oracle)
        rows = sorted((b, q) for b, q0, q1 in asked for q in range(q0, q1))
        assert rows == sorted((t[0], q) for t in m.score_tiles for q in range(t[1], t[2]))
        call_bytes = score_call_bytes("threshold", "cpu", 16384, 4)
        calls = _merge_tiles(m.score_tiles, 2, budget, call_bytes)
        ends = {(b, q1) for b, _, q1, _, _ in calls}
        longest_call = max(q1 - q0 for _, q0, q1, _, _ in calls)
        for b, q0, q1 in asked:
            assert (b, q1) in ends, "a span ends where a scoring call ends"
            assert q1 - q0 <= max(project_rows, longest_call)
        if project_rows == 10_000 and budget == 1:
            # row 0's sparse rows: [10, 30), [40, 42), [52, 82) (dense rows between); row 1's [10, 85)
            assert asked == [(0, 10, 30), (0, 40, 42), (0, 52, 82), (1, 10, 85)]
    with pytest.raises(ValueError, match="project_rows must be an int >= 1; got 0"):
        select_regions_tiled(tile_inputs, 2, summary, m, project_rows=0)


def test_layers_of_a_forward_reuse_the_scoring_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import sa_routing.step5.selection as selection

    pos, pad = document_positions([30, 12, 40], 82)
    m = region_metadata(pos[None], pad[None], 0, 82, region_size=2, topk=4, tile_size=8)
    query, weights, summary = integer_inputs(1, 82, m.region_count, 2, 2, 16, spread=3)
    planned: list[int] = []

    def counting_merge(*args, **kwargs):
        planned.append(1)
        return _merge_tiles(*args, **kwargs)

    monkeypatch.setattr(selection, "_merge_tiles", counting_merge)
    oracle = reference_select_regions(query, weights, summary, pos[None], pad[None], 0, 2, 4)
    for budget, plans in ((2**30, 1), (2**30, 1), (1, 2)):  # two layers, then other options
        assert torch.equal(
            select_regions(query, weights, summary, m, score_budget_bytes=budget), oracle
        )
        assert len(planned) == len(selection.host_plans(m)) == plans
    # another metadata (a replaced field) plans afresh: it may have other tiles
    other = dataclasses.replace(m, score_tiles=m.score_tiles[:1])
    assert selection.host_plans(other) == {}
    # the plans are held beside the frozen metadata, and dropped with it
    key = id(other)
    del other
    gc.collect()
    assert key not in selection._HOST_PLANS and id(m) in selection._HOST_PLANS


def test_select_regions_rejects_shapes_that_disagree_with_metadata() -> None:
    m = region_metadata(HAND_POS[None], HAND_PAD[None], 0, 14, region_size=2, topk=1)
    query, weights, summary = hand_inputs([1] * N)
    with pytest.raises(ValueError, match="query must be"):
        select_regions(query[:, :13], weights[:, :13], summary, m)
    with pytest.raises(ValueError, match="weights must be"):
        select_regions(query, weights[:, :, :1], summary, m)
    with pytest.raises(ValueError, match="at least one group, head and dim"):
        select_regions(query[..., :0, :], weights[..., :0], summary, m)
    with pytest.raises(ValueError, match="at least one group, head and dim"):
        select_regions(query[..., :0], weights, summary[..., :0], m)
    with pytest.raises(ValueError, match="summary must be"):
        select_regions(query, weights, summary[:, :6], m)
    with pytest.raises(ValueError, match="method must be one of"):
        select_regions(query, weights, summary, m, method="sort")
    with pytest.raises(ValueError, match="region_chunk"):
        select_regions(query, weights, summary, m, region_chunk=0)


@pytest.mark.gpu
def test_selection_at_32k_tokens_equals_oracle_bit_for_bit_on_cuda() -> None:
    torch.manual_seed(0)
    total, region, topk = 32768, 8, 512
    docs = [3000, 17, 20000, 9000]
    pos, pad = document_positions(docs, total)
    pos, pad = pos[None].cuda(), pad[None].cuda()
    m = region_metadata(pos, pad, 0, total, region, topk)
    query, weights, summary = integer_inputs(1, total, m.region_count, 4, 4, 256, 1, device="cuda")
    oracle = reference_select_regions(
        query, weights, summary, pos, pad, 0, region, topk, query_chunk=128
    )
    for method, chunk in (("threshold", 16384), ("composite", 16384), ("threshold", 1000)):
        out = select_regions(query, weights, summary, m, method=method, region_chunk=chunk)
        assert torch.equal(out, oracle), (method, chunk)
    # a CP shard of the same sequence equals its slice
    rows = slice(8192, 16384)
    shard = region_metadata(pos, pad, 8192, 8192, region, topk)
    assert torch.equal(
        select_regions(query[:, rows], weights[:, rows], summary, shard), oracle[:, :, rows]
    )
