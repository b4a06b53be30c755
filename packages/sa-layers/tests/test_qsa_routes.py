"""The route seam's mask build choice: "auto" skips the exact tile statistics of routes that a
sample of query tiles already shows too scattered for Flex (CPU)."""

import pytest
import torch

from sa_kernels import build_route_block_mask
from sa_kernels.sparse_gqa.block_mask import FLEX_MIN_OCCUPANCY
from sa_layers.routes import flex_build, sampled_occupancy, token_routes

QUERIES, RATIO = 4096, 4


def scattered_routes(blocks: int = 64, batch: int = 1, heads: int | None = None, seed: int = 0):
    """QSA-shaped routes: per query `blocks` random visible blocks of RATIO tokens (every visible
    block when fewer), ascending, then −1."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, QUERIES) if heads is None else (batch, heads, QUERIES)
    visible = (torch.arange(QUERIES)[:, None] + 1) // RATIO > torch.arange(QUERIES // RATIO)
    scores = torch.rand(*shape, QUERIES // RATIO, generator=generator).masked_fill(~visible, -1)
    top = scores.topk(blocks, dim=-1)
    chosen = torch.where(top.values >= 0, top.indices, QUERIES).sort(-1).values
    ids = (chosen[..., None] * RATIO + torch.arange(RATIO)).flatten(-2)
    return torch.where(ids < QUERIES, ids, -1).to(torch.int32)


def clustered_routes(window: int = 512):
    """Routes of whole tiles plus the causal cut: query q sees keys [tile(q) − window, q]."""
    q = torch.arange(QUERIES)[:, None]
    first = (q // 128 * 128 - window).clamp(min=0)
    ids = first + torch.arange(window + 128)
    return torch.where(ids <= q, ids, -1)[None].to(torch.int32)


def exact_occupancy(ids: torch.Tensor) -> float:
    return build_route_block_mask(ids, QUERIES, 8, build_flex=False).occupancy


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(lambda: scattered_routes(), id="scattered-shared"),
        pytest.param(lambda: scattered_routes(batch=2, heads=2, seed=1), id="scattered-per-group"),
        pytest.param(lambda: clustered_routes(), id="clustered"),
    ],
)
def test_sampled_occupancy_is_close_to_the_exact_tile_statistics(ids):
    ids = ids()
    estimate, exact = sampled_occupancy(ids, QUERIES), exact_occupancy(ids)
    assert abs(estimate - exact) < 0.05 + 0.2 * exact, (estimate, exact)


def test_auto_builds_gather_only_on_scattered_routes_and_exact_statistics_on_clustered_ones():
    scattered, clustered = scattered_routes(), clustered_routes()
    assert exact_occupancy(scattered) < FLEX_MIN_OCCUPANCY / 2 < FLEX_MIN_OCCUPANCY
    assert exact_occupancy(clustered) > FLEX_MIN_OCCUPANCY
    assert flex_build(scattered, QUERIES, "auto") is False
    assert flex_build(clustered, QUERIES, "auto") is None
    for ids in (scattered, clustered):
        assert flex_build(ids, QUERIES, "gather") is False
        assert flex_build(ids, QUERIES, "flex") is True
        assert flex_build(ids, QUERIES, "fa4") is True


def test_short_routes_are_not_sampled_and_padding_does_not_count():
    assert sampled_occupancy(scattered_routes()[:, :1024], QUERIES) is None  # 8 tiles <= 16
    ids = clustered_routes()
    padded = torch.cat((ids, torch.full_like(ids, -1)), dim=-1)
    assert sampled_occupancy(padded, QUERIES) == sampled_occupancy(ids, QUERIES)


def test_token_routes_keeps_the_ids_and_builds_the_gather_mask_of_the_backend():
    ids = scattered_routes()
    routes = token_routes(ids, QUERIES, 8, "gather")
    assert routes.token_ids is ids and routes.block_mask.flex is None
    expected = build_route_block_mask(ids, QUERIES, 8, build_flex=False)
    assert torch.equal(routes.block_mask.routes, expected.routes)
    assert torch.equal(routes.block_mask.counts, expected.counts)
    assert token_routes(ids, QUERIES, 8, "reference").block_mask is None
    assert token_routes(ids, QUERIES, 8, "auto").block_mask is None  # CPU: the reference reads ids
