"""The demo's recipe learns routes: a short indexer warm-up on a tiny retrieval problem lifts the
answer query's routing recall to at least 0.9, far above a fresh indexer's (within 3x of chance,
budget / length), and the sparse stage keeps it, for both models, when each fact fills one unit of
the indexer; with one-token facts (a unit holding one fact token and `unit − 1` filler tokens) the
same warm-up stays far below (CPU)."""

import pytest
import torch

from sa_layers.demo.train import DemoSettings, run

LENGTH, BUDGET = 128, 16  # chance: 16 / 128 = 0.125


def warmed_up(model: str, span: int | None) -> dict:
    torch.manual_seed(0)
    settings = DemoSettings(
        model=model,
        seq_len=LENGTH,
        budget=BUDGET,
        steps=(120, 60, 20),
        eval_every=1000,
        span=span,
        warmup_lr=3e-3,
    )
    return run(settings)["stages"]


@pytest.mark.parametrize("model", ["step5", "qsa"])
def test_warm_up_lifts_recall_of_unit_sized_facts_far_above_one_token_facts(model):
    whole = warmed_up(model, None)  # facts fill one unit (the demo's task)
    assert whole["dense"]["accuracy"] > 0.9  # the dense model retrieves the fact
    fresh, learned = whole["random_indexer"]["recall"], whole["warmup"]["recall"]
    assert fresh <= 3 * BUDGET / LENGTH  # a frozen random indexer: within 3x of chance
    assert learned >= 0.9 and learned > fresh + 0.6
    assert whole["sparse"]["recall"] >= 0.9  # sparse training keeps the learned routes
    one_token = warmed_up(model, 1)["warmup"]["recall"]
    assert learned > one_token + 0.3
