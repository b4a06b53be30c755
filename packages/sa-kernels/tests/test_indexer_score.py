"""indexer_score_tile: the fused Triton scoring kernel vs the reference, the formula itself, out=, errors."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from sa_kernels import indexer_score_tile, round_to_e4m3
from sa_kernels.indexer_score import reference, triton_kernels


def _inputs(
    batch, queries, groups, heads, dim, regions, dtype=torch.bfloat16, device="cpu", seed=0
):
    gen = torch.Generator().manual_seed(seed)
    query = round_to_e4m3(torch.randn(batch, queries, groups, heads, dim, generator=gen).to(dtype))
    weights = torch.randn(batch, queries, groups, heads, generator=gen) * heads**-0.5
    summary = round_to_e4m3(torch.randn(batch, regions, dim, generator=gen).to(dtype))
    return query.to(device), weights.to(device), summary.to(device)


CASES = [
    pytest.param((2, 50, 3, 4, 40, 70, 7, 45), id="B2-Q50-G3-H4-D40-R70-q7:45"),
    pytest.param((1, 9, 2, 3, 24, 33, 0, 9), id="B1-Q9-G2-H3-D24-R33-all-queries"),
    pytest.param((1, 40, 1, 1, 16, 17, 39, 40), id="B1-Q40-G1-H1-D16-R17-last-query"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference_and_fills_a_nan_poisoned_out(case, dtype):
    batch, queries, groups, heads, dim, regions, start, stop = case
    query, weights, summary = _inputs(batch, queries, groups, heads, dim, regions, dtype)
    out = torch.full((batch, groups, stop - start, regions), float("nan"))
    result = indexer_score_tile(query, weights, summary, start, stop, out=out, backend="triton")
    assert result is out and not out.isnan().any()
    expected = reference.indexer_score_tile(query, weights, summary, start, stop)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def _config_id(cfg: dict) -> str:
    return "m{BLOCK_M}-r{BLOCK_R}-d{BLOCK_D}-w{num_warps}-s{num_stages}".format(**cfg)


@pytest.mark.parametrize(
    "cfg",
    [
        {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_D": 16, "num_warps": 1, "num_stages": 1},
        {"BLOCK_M": 64, "BLOCK_R": 32, "BLOCK_D": 64, "num_warps": 4, "num_stages": 2},
    ],
    ids=_config_id,
)
def test_launch_configs_match_the_reference_and_repeat_bit_for_bit(cfg):
    query, weights, summary = _inputs(1, 30, 2, 4, 40, 37)
    out = torch.full((1, 2, 27, 37), float("nan"))
    triton_kernels.indexer_score_tile(query, weights, summary, 2, 29, out, _config=cfg)
    again = triton_kernels.indexer_score_tile(
        query, weights, summary, 2, 29, torch.empty_like(out), _config=cfg
    )
    assert torch.equal(out, again)
    expected = reference.indexer_score_tile(query, weights, summary, 2, 29)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_reference_is_the_weighted_sum_of_relu_dot_products():
    query, weights, summary = _inputs(1, 3, 2, 3, 16, 5, torch.float32)
    got = reference.indexer_score_tile(query, weights, summary, 1, 3)
    for g in range(2):
        for i, q in enumerate(range(1, 3)):
            for r in range(5):
                dots = [
                    float(query[0, q, g, h].double() @ summary[0, r].double()) for h in range(3)
                ]
                want = sum(float(weights[0, q, g, h]) * max(d, 0.0) for h, d in enumerate(dots))
                assert abs(float(got[0, g, i, r]) - want) < 1e-4


def test_strided_summary_slice_and_empty_tile():
    query, weights, summary = _inputs(2, 20, 2, 4, 32, 60, torch.bfloat16)
    part = summary[:, 5:41]
    got = indexer_score_tile(query, weights, part, 3, 19, backend="triton")
    torch.testing.assert_close(
        got, reference.indexer_score_tile(query, weights, part, 3, 19), atol=1e-4, rtol=1e-5
    )
    assert indexer_score_tile(query, weights, summary, 4, 4, backend="triton").shape == (
        2,
        2,
        0,
        60,
    )


def test_errors_name_the_argument_and_the_values():
    query, weights, summary = _inputs(1, 8, 2, 4, 32, 10, torch.bfloat16)
    with pytest.raises(
        TypeError,
        match=r"indexer_score_tile: summary must have query's dtype \(torch.bfloat16\); got torch.float32",
    ):
        indexer_score_tile(query, weights, summary.float(), 0, 8)
    with pytest.raises(TypeError, match=r"weights must be float32; got torch.bfloat16"):
        indexer_score_tile(query, weights.bfloat16(), summary, 0, 8)
    with pytest.raises(
        ValueError,
        match=r"weights must be \[batch, queries, groups, heads_per_group\] = \(1, 8, 2, 4\); got \(1, 8, 2, 3\)",
    ):
        indexer_score_tile(query, weights[..., :3], summary, 0, 8)
    with pytest.raises(
        ValueError,
        match=r"summary must be \[batch, regions, dim\] with batch 1 and dim 32; got \(1, 10, 16\)",
    ):
        indexer_score_tile(query, weights, summary[..., :16], 0, 8)
    with pytest.raises(
        ValueError, match=r"0 <= start <= stop <= queries \(8\); got start=5, stop=9"
    ):
        indexer_score_tile(query, weights, summary, 5, 9)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor"):
        indexer_score_tile(query, weights, summary, 0, 8, out=torch.empty(1, 2, 7, 10))
    with pytest.raises(ValueError, match=r"last-dim stride 1"):
        indexer_score_tile(
            query,
            weights,
            summary.transpose(1, 2).contiguous().transpose(1, 2),
            0,
            8,
            backend="triton",
        )


@pytest.mark.gpu
def test_cuda_matches_reference_on_a_128_query_tile_against_4096_regions():
    query, weights, summary = _inputs(1, 300, 4, 4, 256, 4096, device="cuda")
    got = indexer_score_tile(query, weights, summary, 100, 228)
    expected = reference.indexer_score_tile(query, weights, summary, 100, 228)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", triton_kernels.SWEEP_CONFIGS, ids=_config_id)
def test_cuda_sweep_configs_match_the_reference_and_repeat_bit_for_bit(cfg):
    # 128 queries and 1008 regions specialise like the benchmark's shape, so the sweep reuses these compilations.
    query, weights, summary = _inputs(1, 200, 4, 4, 256, 1008, device="cuda", seed=3)
    out = torch.full((1, 4, 128, 1008), float("nan"), device="cuda")
    try:
        triton_kernels.indexer_score_tile(query, weights, summary, 16, 144, out, _config=cfg)
    except OutOfResources as err:
        pytest.skip(f"config needs more shared memory than this GPU has: {err}")
    again = triton_kernels.indexer_score_tile(
        query, weights, summary, 16, 144, torch.empty_like(out), _config=cfg
    )
    assert torch.equal(out, again)
    expected = reference.indexer_score_tile(query, weights, summary, 16, 144)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-5)
