"""The Triton QSA scorer and the selection built on it: FP32 scores vs FP64, bit-exact routes on exact
inputs, near-tie-only differences on real inputs, chunk-size invariance."""

import itertools

import pytest
import torch
from qsa_cases import assert_routes_equal_oracle, selection_inputs

from sa_routing import select_qsa_token_ids
from sa_routing.qsa.selection.reference import (
    qsa_block_scores,
    rows_differing_beyond_near_ties,
    select_qsa_token_ids_packed_reference,
    select_qsa_token_ids_reference,
)
from sa_routing.qsa.selection.triton_kernels import qsa_block_scores_triton

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _masked_fp64_scores(queries, keys, first_position, c):
    """The oracle's scores (FP64, rounded once to FP32) with the causal block mask."""
    exact = qsa_block_scores(queries, keys).double()
    visible = (first_position + torch.arange(queries.shape[0], device=queries.device) + 1) // c
    invisible = torch.arange(keys.shape[0], device=keys.device) >= visible[:, None]
    return exact.masked_fill(invisible, float("-inf")), invisible


# --- (a) scores ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "heads", "dim", "blocks", "first_position", "c"),
    [
        pytest.param(70, 3, 24, 40, 50, 3, id="R70-H3-D24-c3-pos50"),
        pytest.param(33, 4, 40, 37, 100, 4, id="R33-H4-D40-c4-pos100"),
        pytest.param(19, 1, 8, 21, 0, 2, id="R19-H1-D8-c2-pos0"),
    ],
)
def test_triton_scores_match_fp64_within_fp32_tolerance(
    rows, heads, dim, blocks, first_position, c, dtype
):
    queries, keys = selection_inputs("normal", 1, rows, heads, dim, blocks, dtype, seed=rows + dim)
    queries, keys = queries[0], keys[0, :, 0]
    out = torch.full((rows, blocks), float("nan"))
    scores = qsa_block_scores_triton(queries, keys, first_position, c, out=out)
    expected, invisible = _masked_fp64_scores(queries, keys, first_position, c)
    assert scores.data_ptr() == out.data_ptr()
    assert not scores.isnan().any(), "every (row, block) is written"
    assert torch.equal(scores.isneginf(), invisible), "exactly the invisible blocks are -inf"
    torch.testing.assert_close(
        scores[~invisible].double(), expected[~invisible], rtol=1e-5, atol=1e-5
    )
    assert (scores[~invisible] >= 0).all()


def test_triton_scores_do_not_depend_on_the_chunk_their_rows_land_in():
    """(d) Rows scored in one call or in shifted sub-chunks (other tile positions, other causal
    offsets) get the same scores and the same -inf blocks. To FP32 rounding, not bit for bit: the
    interpreter's dots are the CPU's BLAS, whose kernels (OpenBLAS's Haswell and Zen ones) round the
    rows at a tile's tail differently from the others."""
    queries, keys = selection_inputs("normal", 1, 90, 3, 40, 64, torch.float32, seed=4)
    queries, keys = queries[0], keys[0, :, 0]
    whole = qsa_block_scores_triton(queries, keys, 100, 2)
    for start, stop in [(0, 1), (5, 42), (41, 90), (17, 18), (3, 90)]:
        part = qsa_block_scores_triton(queries[start:stop], keys, 100 + start, 2)
        assert torch.equal(part.isneginf(), whole[start:stop].isneginf()), f"rows {start}:{stop}"
        torch.testing.assert_close(
            part, whole[start:stop], rtol=1e-5, atol=1e-6, msg=f"rows {start}:{stop}"
        )


# --- (b) exact selection on exact inputs -------------------------------------------------------------

EXACT_CASES = [
    # batch, rows, heads, dim, c, budget, offset, lengths
    pytest.param(2, 61, 3, 24, 2, 8, 0, [61, 40], id="B2-S61-c2-budget8-dense-and-padded"),
    pytest.param(1, 97, 4, 16, 3, 12, 0, None, id="B1-S97-c3-budget12-tails"),
    pytest.param(3, 45, 2, 20, 4, 8, 30, [75, 50, 0], id="B3-S45-c4-budget8-offset30-shard"),
    pytest.param(2, 80, 1, 16, 5, 20, 7, [87, 60], id="B2-S80-c5-budget20-offset7"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "rows", "heads", "dim", "c", "budget", "offset", "lengths"), EXACT_CASES
)
def test_triton_selection_equals_the_oracle_bit_for_bit_on_integer_inputs(
    batch, rows, heads, dim, c, budget, offset, lengths, dtype
):
    queries, keys = selection_inputs(
        "integer", batch, rows, heads, dim, (offset + rows) // c, dtype, seed=rows
    )
    assert_routes_equal_oracle(
        queries,
        keys,
        lengths,
        token_budget=budget,
        compress_ratio=c,
        query_position_offset=offset,
        chunk_sizes=(None, 7),
        backend="triton",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_selection_equals_the_packed_oracle_bit_for_bit_on_integer_inputs(dtype):
    c, budget = 3, 9
    cu = (0, 25, 31, 70, 95)
    rows = 100  # 5 tail tokens belong to no document
    blocks = sum((b - a) // c for a, b in itertools.pairwise(cu))
    queries, keys = selection_inputs("integer", 1, rows, 3, 16, blocks, dtype, seed=9)
    routes = select_qsa_token_ids(
        queries, keys, None, token_budget=budget, compress_ratio=c, cu_seqlens=cu, backend="triton"
    )
    expected = select_qsa_token_ids_packed_reference(
        queries, keys, cu, token_budget=budget, compress_ratio=c
    )
    assert torch.equal(routes, expected)


def test_triton_selection_breaks_all_equal_scores_towards_the_lower_block():
    queries = torch.ones(1, 12, 1, 2)
    keys = torch.ones(1, 6, 1, 2)  # every block scores the same
    routes = select_qsa_token_ids(
        queries, keys, None, token_budget=4, compress_ratio=2, backend="triton"
    )
    assert routes[0, 11].tolist() == [0, 1, 2, 3, -1]
    assert routes[0, 8].tolist() == [0, 1, 2, 3, 8]


# --- (c) real inputs: near-ties only; (d) chunk-size invariance ------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_selection_differs_from_the_oracle_only_at_near_ties(dtype):
    batch, rows, heads, dim, c, budget, offset = 2, 150, 4, 32, 2, 16, 20
    total = offset + rows
    queries, keys = selection_inputs("normal", batch, rows, heads, dim, total // c, dtype, seed=12)
    lengths = torch.tensor([total, 131])
    kwargs = dict(token_budget=budget, compress_ratio=c, query_position_offset=offset)
    expected = select_qsa_token_ids_reference(queries, keys, lengths, **kwargs)
    routes = select_qsa_token_ids(
        queries, keys, lengths, global_sequence_length=total, backend="triton", **kwargs
    )
    assert rows_differing_beyond_near_ties(queries, keys, routes, expected, **kwargs) == []
    assert (routes == expected).all(dim=-1).float().mean() >= 0.95


def test_near_tie_check_rejects_a_real_difference():
    """The checker used above is not vacuous: swapping a clearly chosen block for a clearly unchosen one is caught."""
    queries, keys = selection_inputs("normal", 1, 40, 2, 16, 20, torch.float32, seed=3)
    kwargs = dict(token_budget=8, compress_ratio=2)
    expected = select_qsa_token_ids_reference(queries, keys, None, **kwargs)
    routes = expected.clone()
    row = 39  # v = 20 > 4 kept: sparse
    chosen = set((expected[0, row, :8:2] // 2).tolist())
    outsider = min(set(range(20)) - chosen)
    routes[0, row, 0], routes[0, row, 1] = outsider * 2, outsider * 2 + 1
    assert rows_differing_beyond_near_ties(queries, keys, routes, expected, **kwargs) == [(0, row)]


def test_triton_selection_does_not_depend_on_the_chunk_size():
    queries, keys = selection_inputs("normal", 2, 130, 3, 24, 70, torch.bfloat16, seed=6)
    lengths = torch.tensor([137, 100])
    kwargs = dict(
        token_budget=20,
        compress_ratio=2,
        query_position_offset=7,
        global_sequence_length=137,
        backend="triton",
    )
    routes = [
        select_qsa_token_ids(queries, keys, lengths, query_chunk_size=chunk, **kwargs)
        for chunk in (None, 1, 9, 64)
    ]
    for chunk, other in zip((1, 9, 64), routes[1:], strict=True):
        assert torch.equal(other, routes[0]), f"query_chunk_size={chunk}"


def test_triton_auto_chunks_keep_score_temporaries_within_the_budget(monkeypatch):
    """With the budget shrunk to 64 KiB, every scored chunk fits it and the routes do not change."""
    from sa_routing.qsa.selection import chunked, triton_kernels

    budget_bytes = 64 * 1024
    scored = []
    original = triton_kernels.qsa_block_scores_triton

    def recording_scores(queries, keys, *args, **kwargs):
        scored.append((queries.shape[0], keys.shape[0]))
        return original(queries, keys, *args, **kwargs)

    queries, keys = selection_inputs("normal", 2, 700, 2, 8, 350, torch.bfloat16, seed=5)
    kwargs = dict(token_budget=16, compress_ratio=2, backend="triton")
    expected = select_qsa_token_ids(queries, keys, None, **kwargs)
    monkeypatch.setattr(chunked, "SCORE_TEMP_BUDGET_BYTES", budget_bytes)
    monkeypatch.setattr(triton_kernels, "qsa_block_scores_triton", recording_scores)
    routes = select_qsa_token_ids(queries, keys, None, **kwargs)
    assert torch.equal(routes, expected)
    assert len(scored) > 10
    assert all(
        rows * blocks * chunked.triton_bytes_per_score(blocks, torch.device("cpu")) <= budget_bytes
        for rows, blocks in scored
    )


def test_triton_backend_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    queries, keys = selection_inputs("normal", 1, 8, 1, 4, 4, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        select_qsa_token_ids(
            queries, keys, None, token_budget=2, compress_ratio=2, backend="triton"
        )


# --- GPU, 32k ----------------------------------------------------------------------------------------

GPU_BUDGET, GPU_C, GPU_HEADS, GPU_DIM = 2048, 4, 4, 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_triton_scores_match_fp64_at_32k(dtype):
    rows, first_position = 777, 31991  # 8192 blocks, the last rows see all of them
    queries, keys = selection_inputs(
        "normal", 1, rows, GPU_HEADS, GPU_DIM, 8192, dtype, seed=1, device="cuda"
    )
    queries, keys = queries[0], keys[0, :, 0]
    out = torch.full((rows, 8192), float("nan"), device="cuda")
    scores = qsa_block_scores_triton(queries, keys, first_position, GPU_C, out=out)
    expected, invisible = _masked_fp64_scores(queries, keys, first_position, GPU_C)
    assert not scores.isnan().any()
    assert torch.equal(scores.isneginf(), invisible)
    torch.testing.assert_close(
        scores[~invisible].double(), expected[~invisible], rtol=1e-4, atol=1e-4
    )
    whole_rows = qsa_block_scores_triton(queries[100:300], keys, first_position + 100, GPU_C)
    assert torch.equal(whole_rows, scores[100:300]), "a row's scores do not depend on its tile"


@pytest.mark.gpu
def test_cuda_selection_equals_the_oracle_bit_for_bit_on_integer_inputs_at_32k():
    """Padded batch with a dense prefix and tails, then a CP-like shard (offset), then packed documents."""
    total = 32768
    queries, keys = selection_inputs(
        "integer",
        2,
        total,
        GPU_HEADS,
        GPU_DIM,
        total // GPU_C,
        torch.bfloat16,
        seed=2,
        device="cuda",
    )
    kwargs = dict(token_budget=GPU_BUDGET, compress_ratio=GPU_C)
    lengths = torch.tensor([total, 20001], device="cuda")
    routes = select_qsa_token_ids(queries, keys, lengths, **kwargs)
    expected = select_qsa_token_ids_reference(queries, keys, lengths, **kwargs)
    assert torch.equal(routes, expected)

    offset = 3 * 8192
    shard = select_qsa_token_ids(
        queries[:, offset:],
        keys,
        lengths,
        query_position_offset=offset,
        global_sequence_length=total,
        **kwargs,
    )
    assert torch.equal(shard, expected[:, offset:])

    cu = (0, 9000, 9003, 30001)
    blocks = sum((b - a) // GPU_C for a, b in itertools.pairwise(cu))
    packed = select_qsa_token_ids(queries[:1], keys[:1, :blocks], None, cu_seqlens=cu, **kwargs)
    packed_expected = select_qsa_token_ids_packed_reference(
        queries[:1], keys[:1, :blocks], cu, **kwargs
    )
    assert torch.equal(packed, packed_expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_selection_differs_from_the_oracle_only_at_near_ties_at_32k(dtype):
    total = 32768
    queries, keys = selection_inputs(
        "normal", 1, total, GPU_HEADS, GPU_DIM, total // GPU_C, dtype, seed=3
    )
    queries, keys = queries.cuda(), keys.cuda()
    kwargs = dict(token_budget=GPU_BUDGET, compress_ratio=GPU_C)
    routes = select_qsa_token_ids(queries, keys, None, **kwargs)
    expected = select_qsa_token_ids_reference(queries, keys, None, **kwargs)
    # the fraction first, so that a broken path fails fast
    assert (routes == expected).all(dim=-1).float().mean() >= 0.99
    assert rows_differing_beyond_near_ties(queries, keys, routes, expected, **kwargs) == []
    for chunk in (1000, 333):
        chunked = select_qsa_token_ids(queries, keys, None, query_chunk_size=chunk, **kwargs)
        assert torch.equal(chunked, routes), f"query_chunk_size={chunk}"
