"""bench_step5_layer.py's CSA rows on the CPU: the synthetic selections replace the indexer's (which
still runs), and every route kind gives a record row."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from sa_layers import Step5Attention
from sa_layers.step5 import attention as step5_attention

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
LENGTH = 256


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # its `_timing` helper
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_step5_layer", BENCHMARKS / "bench_step5_layer.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def _layer(bench):
    config = bench.SMOKE.config(("csa",), bench.SMOKE.layer_hidden)
    layer = bench.init_normal(Step5Attention(config, 0, torch.bfloat16, "cpu"))
    return config, layer, *bench.layer_inputs(bench.SMOKE, config, LENGTH)


@pytest.mark.parametrize("kind", ["scattered", "clustered"])
def test_attending_over_swaps_the_selection_and_restores_the_layer(bench, kind):
    torch.manual_seed(0)
    config, layer, batch, hidden, _ = _layer(bench)
    ids = bench.synthetic_selection(kind, batch, config, LENGTH)
    real = step5_attention.region_routes
    calls = []
    layer.indexer.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        own = layer.select_routes(hidden, batch, LENGTH).region_ids
        with bench.attending_over(ids):
            swapped = layer.select_routes(hidden, batch, LENGTH).region_ids
        after = layer.select_routes(hidden, batch, LENGTH).region_ids
    assert calls == [1, 1, 1]  # the indexer runs inside the block too
    assert torch.equal(swapped, ids) and not torch.equal(own, ids)
    assert torch.equal(after, own) and step5_attention.region_routes is real
    assert ids.shape == own.shape and ids.dtype == own.dtype


def test_csa_rows_time_every_route_kind_on_its_routes(bench, monkeypatch):
    """One row per route kind, each timed on its own routes: the synthetic rows' calls attend over
    the synthetic ids, the indexer row's over the indexer's."""
    config, _, batch, _, _ = _layer(bench)
    synthetic = {
        k: bench.synthetic_selection(k, batch, config, LENGTH) for k in ("scattered", "clustered")
    }
    seen = []
    real = step5_attention.region_routes

    def spy(selection, *args):
        seen.append(selection.region_ids)
        return real(selection, *args)

    monkeypatch.setattr(step5_attention, "region_routes", spy)
    rows = bench.csa_rows(bench.SMOKE, LENGTH, tuple(bench.ROUTE_NAMES))
    names = [row["what"] for row in rows]
    assert len(rows) == 4 and names[1].startswith("Step-5 CSA route preparation")
    for row, kind in zip([rows[0], *rows[2:]], bench.ROUTE_NAMES.values(), strict=True):
        assert kind in row["what"] and "reference (auto's choice)" in row["what"]
        assert row["time_ms"] > 0 and row["baseline"] == "same layer with dense causal SDPA"
    matches = {k: sum(torch.equal(ids, want) for ids in seen) for k, want in synthetic.items()}
    own = sum(not any(torch.equal(ids, w) for w in synthetic.values()) for ids in seen)
    # each kind: its backend choice, then a warm-up and the timed calls (CPU: no peak-memory call)
    calls = 2 + bench.SMOKE.reps
    assert matches == {"scattered": calls, "clustered": calls} and own >= calls
