"""Workspace-wide pytest hooks: `gpu` and `multigpu` tests skip cleanly where the hardware is missing,
and `gpu` tests have room for one compiled Flex kernel per geometry."""

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    skip_multi = pytest.mark.skip(reason=f"needs at least 2 CUDA devices; {gpus} visible")
    for item in items:
        if gpus == 0 and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if gpus < 2 and "multigpu" in item.keywords:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _flex_compiles(request: pytest.FixtureRequest):
    """Dynamo's recompile limit (8) is per code object, so every compiled flex_attention of the
    process shares it: past it, a new geometry would silently run Flex eagerly (scores
    materialised in the input dtype). Inside `gpu` tests the limit is 64 (a count over the whole
    process, not per test)."""
    if "gpu" not in request.keywords:
        yield
        return
    name = next(
        n for n in ("recompile_limit", "cache_size_limit") if hasattr(torch._dynamo.config, n)
    )
    with torch._dynamo.config.patch(**{name: 64}):
        yield
