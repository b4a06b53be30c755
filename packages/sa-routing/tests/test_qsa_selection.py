"""select_qsa_token_ids: the hand case, dense equivalence, oracle equality (ties included), packing, errors."""

import itertools

import pytest
import torch
from qsa_cases import assert_routes_equal_oracle, selection_inputs

from sa_routing import select_qsa_token_ids
from sa_routing.qsa.selection.reference import (
    select_qsa_token_ids_packed_reference,
    select_qsa_token_ids_reference,
)


def _as_sets(routes: torch.Tensor) -> list[list[int]]:
    return [[i for i in row if i >= 0] for row in routes.tolist()]


def test_hand_case_matches_the_issue():
    queries = torch.ones(1, 6, 1, 1)
    queries[0, 5] = -1.0
    keys = torch.tensor([-1.0, 2.0, 1.0]).view(1, 3, 1, 1)
    routes = select_qsa_token_ids(queries, keys, None, token_budget=2, compress_ratio=2)
    assert routes.dtype == torch.int32
    assert routes.shape == (1, 6, 3)
    assert _as_sets(routes[0]) == [[0], [0, 1], [0, 1, 2], [2, 3], [2, 3, 4], [0, 1]]
    assert torch.equal(
        routes,
        select_qsa_token_ids_reference(queries, keys, None, token_budget=2, compress_ratio=2),
    )


def test_rows_are_dense_until_the_threshold_with_default_budget():
    budget, c = 2048, 4
    threshold = (budget // c + 1) * c - 1  # 2051
    rows = threshold + 9
    torch.manual_seed(0)
    queries = torch.randn(1, rows, 2, 8)
    keys = torch.randn(1, rows // c, 1, 8)
    routes = select_qsa_token_ids(queries, keys, None, token_budget=budget, compress_ratio=c)
    slots = torch.arange(budget + c - 1)
    dense = torch.where(slots <= torch.arange(threshold)[:, None], slots, -1).to(torch.int32)
    assert torch.equal(routes[0, :threshold], dense)
    first_sparse = routes[0, threshold]
    assert (first_sparse >= 0).sum() == budget  # 512 of the 513 visible blocks, no tail at p = 2051
    assert not torch.equal(
        first_sparse[first_sparse >= 0], torch.arange(threshold + 1)[:budget].to(torch.int32)
    )
    assert torch.equal(
        routes[0, threshold:],
        select_qsa_token_ids_reference(
            queries[:, threshold:],
            keys,
            None,
            token_budget=budget,
            compress_ratio=c,
            query_position_offset=threshold,
        )[0],
    )


CASES = [
    # batch, rows, heads, dim, c, budget, offset, lengths
    pytest.param(2, 61, 3, 24, 2, 8, 0, [61, 40], id="B2-S61-c2-budget8-padded"),
    pytest.param(1, 97, 4, 16, 3, 12, 0, None, id="B1-S97-c3-budget12"),
    pytest.param(3, 45, 1, 8, 4, 8, 30, [75, 50, 0], id="B3-S45-c4-budget8-offset30"),
    pytest.param(2, 130, 2, 12, 5, 20, 7, [137, 100], id="B2-S130-c5-budget20-offset7"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("batch", "rows", "heads", "dim", "c", "budget", "offset", "lengths"), CASES
)
def test_chunked_path_equals_the_oracle_with_ties(
    batch, rows, heads, dim, c, budget, offset, lengths, dtype
):
    queries, keys = selection_inputs(
        "tied", batch, rows, heads, dim, (offset + rows) // c, dtype, seed=rows
    )
    assert_routes_equal_oracle(
        queries,
        keys,
        lengths,
        token_budget=budget,
        compress_ratio=c,
        query_position_offset=offset,
        chunk_sizes=(None, 1, 7, 64),
    )


def test_ties_go_to_the_lower_block_id():
    queries = torch.ones(1, 12, 1, 2)
    keys = torch.ones(1, 6, 1, 2)  # every block scores the same
    routes = select_qsa_token_ids(queries, keys, None, token_budget=4, compress_ratio=2)
    # p = 11: v = 6 > 2 → blocks 0 and 1 (lowest ids), no tail
    assert routes[0, 11].tolist() == [0, 1, 2, 3, -1]
    # p = 8: v = 4 → blocks 0, 1, then tail token 8
    assert routes[0, 8].tolist() == [0, 1, 2, 3, 8]


def test_rows_past_their_length_are_all_padding():
    torch.manual_seed(1)
    queries, keys = torch.randn(2, 20, 2, 4), torch.randn(2, 10, 1, 4)
    routes = select_qsa_token_ids(
        queries, keys, torch.tensor([13, 0]), token_budget=4, compress_ratio=2
    )
    assert (routes[0, 13:] == -1).all()
    assert (routes[1] == -1).all()
    assert (routes[0, :13] >= 0).any(dim=1).all()
    host = select_qsa_token_ids(queries, keys, [13, 0], token_budget=4, compress_ratio=2)
    assert torch.equal(host, routes)  # host lengths: same routes, no read-back


def test_packed_routes_are_per_document_routes_shifted_by_the_start():
    c, budget = 3, 9
    cu = (0, 25, 31, 70, 95)
    rows = 100  # 5 tail tokens belong to no document
    torch.manual_seed(2)
    queries = torch.randn(1, rows, 2, 8)
    keys = torch.randn(1, sum((b - a) // c for a, b in itertools.pairwise(cu)), 1, 8)
    routes = select_qsa_token_ids(
        queries, keys, None, token_budget=budget, compress_ratio=c, cu_seqlens=torch.tensor(cu)
    )
    assert torch.equal(
        routes,
        select_qsa_token_ids_packed_reference(
            queries, keys, cu, token_budget=budget, compress_ratio=c
        ),
    )
    first = 0
    for start, stop in itertools.pairwise(cu):
        doc = select_qsa_token_ids(
            queries[:, start:stop],
            keys[:, first : first + (stop - start) // c],
            None,
            token_budget=budget,
            compress_ratio=c,
        )
        assert torch.equal(routes[:, start:stop], torch.where(doc >= 0, doc + start, -1))
        inside = routes[0, start:stop]
        assert ((inside == -1) | ((inside >= start) & (inside < stop))).all()
        first += (stop - start) // c
    assert (routes[0, cu[-1] :] == -1).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"token_budget": 7}, ValueError, "multiple of compress_ratio"),
        ({"compress_ratio": 1, "token_budget": 4}, ValueError, "compress_ratio must be > 1"),
        ({"keys": torch.randn(2, 10, 1, 5)}, ValueError, "compressed_keys must be"),
        ({"keys": torch.randn(2, 10, 2, 4)}, ValueError, "compressed_keys must be"),
        ({"keys": torch.randn(2, 3, 1, 4)}, ValueError, "needs 10"),
        ({"lengths": torch.tensor([21, 3])}, ValueError, r"lie in \[0, 20\]"),
        ({"lengths": torch.tensor([2.0, 3.0])}, TypeError, "integer tensor"),
        ({"lengths": torch.tensor([True, True])}, TypeError, "integer tensor"),
        ({"lengths": [3]}, ValueError, "hold 2 ints"),
        ({"lengths": [3, 2.0]}, ValueError, "hold 2 ints"),
        ({"query_position_offset": -1}, ValueError, "query_position_offset"),
        ({"global_sequence_length": 10}, ValueError, "global_sequence_length"),
        ({"cu_seqlens": torch.tensor([0, 5, 9])}, ValueError, "needs batch 1"),
        ({"query_chunk_size": 0}, ValueError, "query_chunk_size"),
        ({"queries": torch.randn(2, 20, 0, 4)}, ValueError, "at least one head and one dim"),
        (
            {"queries": torch.randn(2, 20, 2, 0), "keys": torch.randn(2, 10, 1, 0)},
            ValueError,
            "at least one head and one dim",
        ),
    ],
    ids=[
        "budget-not-multiple",
        "ratio-1",
        "dim-mismatch",
        "two-key-heads",
        "too-few-blocks",
        "length-too-long",
        "float-lengths",
        "bool-lengths",
        "host-lengths-too-few",
        "host-lengths-float",
        "negative-offset",
        "global-too-short",
        "packed-batch-2",
        "zero-chunk",
        "no-heads",
        "no-dims",
    ],
)
def test_invalid_arguments_raise_with_the_reason(kwargs, error, message):
    args = {
        "queries": torch.randn(2, 20, 2, 4),
        "keys": torch.randn(2, 10, 1, 4),
        "lengths": None,
        "token_budget": 4,
        "compress_ratio": 2,
    }
    args.update(kwargs)
    queries, keys, lengths = args.pop("queries"), args.pop("keys"), args.pop("lengths")
    with pytest.raises(error, match=message):
        select_qsa_token_ids(queries, keys, lengths, **args)


def test_packed_with_lengths_or_non_increasing_bounds_raises():
    queries, keys = torch.randn(1, 20, 2, 4), torch.randn(1, 10, 1, 4)
    with pytest.raises(ValueError, match="not both"):
        select_qsa_token_ids(
            queries, keys, torch.tensor([20]), token_budget=4, compress_ratio=2, cu_seqlens=(0, 20)
        )
    with pytest.raises(ValueError, match="strictly increasing"):
        select_qsa_token_ids(
            queries, keys, None, token_budget=4, compress_ratio=2, cu_seqlens=(0, 12, 8, 20)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp64_path_equals_the_oracle_on_cuda_at_real_size(dtype):
    """backend="reference" on CUDA scores in FP64 like the oracle: equal routes, ties included.
    (The default CUDA path, the Triton scorer, is tested in test_qsa_triton_scores.py.)"""
    budget, c, heads, dim = 2048, 4, 4, 128
    rows, offset = 1500, 6700  # every row sparse, ~2k blocks visible
    total = offset + rows
    queries, keys = selection_inputs("tied", 2, rows, heads, dim, total // c, dtype, seed=3)
    assert_routes_equal_oracle(
        queries.cuda(),
        keys.cuda(),
        [total, offset + 1001],
        token_budget=budget,
        compress_ratio=c,
        query_position_offset=offset,
        backend="reference",
    )


def test_auto_chunks_keep_score_temporaries_within_the_budget(monkeypatch):
    """With the budget shrunk to 64 KiB, every scored chunk fits it and the routes do not change."""
    from sa_routing.qsa.selection import chunked

    budget_bytes = 64 * 1024
    scored = []
    original_scores = chunked.qsa_block_scores

    def recording_scores(queries, keys):
        scored.append((queries.shape[0], keys.shape[0]))
        return original_scores(queries, keys)

    queries, keys = selection_inputs("tied", 2, 700, 2, 8, 700 // 2, torch.bfloat16, seed=5)
    expected = select_qsa_token_ids(queries, keys, None, token_budget=16, compress_ratio=2)
    monkeypatch.setattr(chunked, "SCORE_TEMP_BUDGET_BYTES", budget_bytes)
    monkeypatch.setattr(chunked, "qsa_block_scores", recording_scores)
    routes = select_qsa_token_ids(queries, keys, None, token_budget=16, compress_ratio=2)
    assert torch.equal(routes, expected)
    assert len(scored) > 10
    assert all(
        rows * blocks * chunked._TEMP_BYTES_PER_SCORE <= budget_bytes for rows, blocks in scored
    )
