"""Hypothesis: route invariants of select_qsa_token_ids on random shapes, padding, offsets and packing."""

import itertools

import pytest
import torch
from qsa_cases import assert_routes_equal_oracle, selection_inputs

from sa_routing import select_qsa_token_ids

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


def _check_row(row: list[int], position: int, c: int, budget: int, start: int, stop: int) -> None:
    """One valid row: prefix of ascending ids inside [start, start + position], the exact count, dense rows exact."""
    valid = [i for i in row if i >= 0]
    assert row[: len(valid)] == valid, "valid ids must form a prefix"
    assert valid == sorted(set(valid)), "ids ascending and distinct"
    assert all(start <= i <= start + position < stop for i in valid), (
        "ids causal and inside the document"
    )
    visible = (position + 1) // c
    kept = budget // c
    assert len(valid) == min(visible, kept) * c + (position + 1 - visible * c)
    if visible <= kept:
        assert valid == list(range(start, start + position + 1)), "dense rows are exactly 0 … p"


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    batch=st.integers(1, 3),
    rows=st.integers(1, 70),
    offset=st.integers(0, 40),
    c=st.integers(2, 5),
    blocks_kept=st.integers(1, 6),
    heads=st.integers(1, 3),
    data=st.data(),
)
def test_padded_routes_keep_the_invariants(batch, rows, offset, c, blocks_kept, heads, data):
    budget = blocks_kept * c
    total = offset + rows
    lengths = data.draw(st.lists(st.integers(0, total), min_size=batch, max_size=batch))
    seed = data.draw(st.integers(0, 2**16))
    queries, keys = selection_inputs(
        "normal", batch, rows, heads, 6, total // c, torch.bfloat16, seed
    )
    routes = assert_routes_equal_oracle(
        queries,
        keys,
        lengths,
        token_budget=budget,
        compress_ratio=c,
        query_position_offset=offset,
        chunk_sizes=(data.draw(st.sampled_from([None, 1, 5])),),
    )
    assert routes.shape == (batch, rows, budget + c - 1)
    for b in range(batch):
        for i, row in enumerate(routes[b].tolist()):
            position = offset + i
            if position >= lengths[b]:
                assert all(x == -1 for x in row)
            else:
                _check_row(row, position, c, budget, 0, total)


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
    documents=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    tail=st.integers(0, 4),
    c=st.integers(2, 4),
    blocks_kept=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_packed_routes_never_leave_their_document(documents, tail, c, blocks_kept, seed):
    budget = blocks_kept * c
    cu = [0]
    for length in documents:
        cu.append(cu[-1] + length)
    rows = cu[-1] + tail
    blocks = sum(n // c for n in documents)
    queries, keys = selection_inputs("normal", 1, rows, 2, 4, blocks, torch.float32, seed)
    routes = select_qsa_token_ids(
        queries, keys, None, token_budget=budget, compress_ratio=c, cu_seqlens=tuple(cu)
    )
    table = routes[0].tolist()
    for start, stop in itertools.pairwise(cu):
        for token in range(start, stop):
            _check_row(table[token], token - start, c, budget, start, stop)
    assert all(x == -1 for row in table[cu[-1] :] for x in row)
