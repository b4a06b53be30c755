"""Hypothesis properties of region_metadata: regions partition documents, dense ids are complete, tiles cover."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sa_routing import region_metadata  # noqa: E402


@st.composite
def layouts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, int]:
    batch = draw(st.integers(1, 3))
    total = draw(st.integers(1, 70))
    rows_pos, rows_pad = [], []
    for _ in range(batch):
        valid = draw(st.integers(0, total))
        lengths, left = [], valid
        while left:
            n = draw(st.integers(1, left))
            lengths.append(n)
            left -= n
        pos = [p for n in lengths for p in range(n)] + [0] * (total - valid)
        rows_pos.append(pos)
        rows_pad.append([i >= valid for i in range(total)])
    region_size = draw(st.integers(1, 5))
    topk = draw(st.integers(1, 6))
    tile = draw(st.integers(1, 9))
    query_start = draw(st.integers(0, total - 1))
    queries = draw(st.integers(1, total - query_start))
    return (
        torch.tensor(rows_pos, dtype=torch.int64),
        torch.tensor(rows_pad, dtype=torch.bool),
        query_start,
        queries,
        region_size,
        topk,
        tile,
    )


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_metadata_invariants_hold_for_any_document_layout(case: tuple) -> None:
    pos, pad, query_start, queries, region_size, topk, tile = case
    m = region_metadata(pos, pad, query_start, queries, region_size, topk, tile_size=tile)
    n = m.region_count
    valid = ~pad

    # Every valid token lies in exactly one region, listed once in region_sources at its offset.
    for b in range(pos.shape[0]):
        sources = m.region_sources[b]
        listed = sources[sources >= 0].tolist()
        assert sorted(listed) == valid[b].nonzero().flatten().tolist()
        for t in valid[b].nonzero().flatten().tolist():
            r = int(m.token_regions[b, t])
            assert 0 <= r < n
            assert int(sources[r, int(pos[b, t]) % region_size]) == t
            # Regions never cross documents.
            assert int(m.region_documents[b, r]) == int(m.documents[b, t])
        assert (m.token_regions[b][pad[b]] == -1).all()

    rows = slice(query_start, query_start + queries)
    for b in range(pos.shape[0]):
        for i in range(queries):
            t = query_start + i
            ids = m.dense_region_ids[b, i]
            used = ids[ids < n].tolist()
            assert (ids[len(used) :] == n).all(), "unused slots trail"
            if pad[b, t] or m.sparse_queries[b, i]:
                assert used == []
                continue
            current = int(m.token_regions[b, t])
            first = current - int(pos[b, t]) // region_size
            # Dense ids: ascending and complete (every region of the document up to the current one).
            assert used == list(range(first, current + 1))
            assert int(pos[b, t]) // region_size <= topk
    assert torch.equal(m.sparse_queries, valid[:, rows] & (pos[:, rows] // region_size > topk))

    # Tiles cover every sparse query exactly once, hold at most `tile` queries and all their candidates.
    covered = torch.zeros_like(m.sparse_queries, dtype=torch.int64)
    for b, q0, q1, r0, r1 in m.score_tiles:
        assert 0 < q1 - q0 <= tile
        assert m.sparse_queries[b, q0] and m.sparse_queries[b, q1 - 1]
        covered[b, q0:q1] += 1
        sparse = m.sparse_queries[b, q0:q1]
        assert (m.query_first_region[b, q0:q1][sparse] >= r0).all()
        assert (m.current[b, q0:q1][sparse] <= r1).all()
        assert any(s[0] == b and s[1] <= r0 and r1 <= s[2] for s in m.summary_ranges)
    assert (covered <= 1).all()
    assert (covered[m.sparse_queries] == 1).all()
