"""Workspace-wide pytest hooks: `gpu` and `multigpu` tests skip cleanly where the hardware is missing."""

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
