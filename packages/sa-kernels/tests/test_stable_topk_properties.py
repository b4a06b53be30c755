"""Property tests for stable_topk: random rows full of ties, both paths and both output phases equal the
stable-sort oracle (hypothesis, CPU; the Triton kernel through TRITON_INTERPRET=1)."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sa_kernels import stable_topk  # noqa: E402
from sa_kernels.stable_topk import reference  # noqa: E402
from sa_kernels.stable_topk.triton_kernels import LaunchConfig, stable_topk_rows  # noqa: E402

SPECIALS = [0.0, -0.0, float("-inf"), float("inf"), 1e-38, -1e-38, 3.0e38, -3.0e38]


@st.composite
def rows_and_k(draw):
    rows, n = draw(st.integers(1, 4)), draw(st.integers(1, 300))
    k = draw(st.integers(1, n))
    distinct = draw(st.integers(1, 6))  # few distinct values: ties everywhere
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    palette = torch.tensor(
        SPECIALS + torch.randn(distinct, generator=generator).tolist(), dtype=torch.float32
    )
    scores = palette[torch.randint(len(palette), (rows, n), generator=generator)]
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return scores.to(dtype), k


@settings(max_examples=40, deadline=None)
@given(
    case=rows_and_k(),
    output_tile=st.sampled_from([0, 16, 64]),
    prefilter=st.sampled_from([0, 16, 64]),
)
def test_every_path_equals_the_stable_sort(case, output_tile, prefilter):
    scores, k = case
    expected = reference.stable_topk(scores, k)
    assert torch.equal(stable_topk(scores, k, backend="reference"), expected)
    config = LaunchConfig(output_tile=output_tile, prefilter=prefilter)
    assert torch.equal(stable_topk_rows(scores, k, _config=config), expected)


@st.composite
def narrowable_rows(draw):
    """Rows the prefilter applies to (a block of at least 4 entries per maximum, 2k <= maxima):
    continuous scores (mostly narrowed) or a few tied values with specials (mostly the fallback)."""
    maxima = draw(st.sampled_from([8, 16, 32]))
    n = draw(st.integers(3 * maxima + 1, 300))
    k = draw(st.integers(1, maxima // 2))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scores = torch.randn(3, n, generator=generator)
    if draw(st.booleans()):
        palette = torch.tensor(SPECIALS + torch.randn(4, generator=generator).tolist())
        scores[1] = palette[torch.randint(len(palette), (n,), generator=generator)]
    if draw(st.booleans()):
        scores[2, : draw(st.integers(0, n))] = float("-inf")
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return scores.to(dtype), k, maxima


@settings(max_examples=30, deadline=None)
@given(
    case=narrowable_rows(),
    output_tile=st.sampled_from([0, 32]),
    chunk=st.sampled_from([8, 64, 2048]),  # several chunks per row, or the whole row in one
)
def test_prefiltered_rows_equal_the_stable_sort(case, output_tile, chunk):
    scores, k, maxima = case
    config = LaunchConfig(output_tile=output_tile, prefilter=maxima, prefilter_chunk=chunk)
    assert torch.equal(
        stable_topk_rows(scores, k, _config=config), reference.stable_topk(scores, k)
    )
