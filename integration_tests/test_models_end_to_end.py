"""The tiny Step-5 and QSA models end to end, across sa-cp, sa-routing, sa-kernels and sa-layers:
checkpointed recompute with route replay under context parallelism, a 2-rank gloo CP run against
one rank (forward, backward, optimizer steps), a trained state dict through a file, and errors at
the model boundary (CPU).

The training objective is the staged recipe's sparse stage: LM loss plus the indexers' distillation
loss, every parameter trainable (`model_cases.total_loss`).
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sa_cp import ContextParallelLayout
from sa_cp.testing import run_on_ranks
from sa_layers import QSAModel, Step5Model
from sa_routing import QSAContextParallel

sys.path.insert(0, str(Path(__file__).parent))
import model_cases as cases
from model_cases import KINDS, SEQUENCE

STEPS = 3
ROUTED_LAYERS = {"step5": 1, "qsa": 2}


def _route_dim(kind: str) -> int:
    """The sequence dimension of an indexer's routes (Step-5: [B, groups, L, k]; QSA: [B, L, W])."""
    return 2 if kind == "step5" else 1


def _step(kind: str, stage: str, checkpointing: bool, shard=(0, 1), group=None):
    """One forward and backward of a fresh model: (loss, indexer loss, grads, routes)."""
    model = cases.build(kind)
    model.set_indexer_training(stage)
    if checkpointing:
        model.enable_activation_checkpointing()
    routes = cases.route_log(model)
    out = cases.run(kind, model, cases.batch(kind), shard=shard, group=group)
    cases.total_loss(out).backward()
    indexer_loss = None if out.indexer_loss is None else out.indexer_loss.detach()
    return out.loss.detach(), indexer_loss, cases.grads(model), routes


def _plain_and_checkpointed(rank, world_size, kind, stage):
    group = dist.group.WORLD if world_size > 1 else None
    return [
        _step(kind, stage, checkpointing, shard=(rank, world_size), group=group)
        for checkpointing in (False, True)
    ]


@pytest.mark.parametrize("stage", ["off", "sparse"])
@pytest.mark.parametrize("world_size", [1, 2], ids=["1rank", "2ranks"])
@pytest.mark.parametrize("kind", KINDS)
def test_checkpointed_recompute_replays_routes_and_gives_bitwise_equal_gradients(
    kind, world_size, stage
):
    if world_size == 1:
        results = [_plain_and_checkpointed(0, 1, kind, stage)]
    else:
        results = run_on_ranks(world_size, _plain_and_checkpointed, kind, stage)
    for plain, checkpointed in results:
        loss, indexer_loss, grads, routes = plain
        ck_loss, ck_indexer_loss, ck_grads, ck_routes = checkpointed
        # the recompute replays the forward's routes: one indexer call per routed layer
        assert len(routes) == len(ck_routes) == ROUTED_LAYERS[kind]
        assert all(torch.equal(a, b) for a, b in zip(routes, ck_routes, strict=True))
        assert torch.equal(loss, ck_loss)
        assert (indexer_loss is None) == (stage == "off")
        assert stage == "off" or torch.equal(indexer_loss, ck_indexer_loss)
        assert grads.keys() == ck_grads.keys()
        assert any("indexer" in name for name in grads) == (stage == "sparse")
        for name, grad in grads.items():
            assert torch.equal(grad, ck_grads[name]), name


# -- 2-rank context parallelism against one rank ----------------------------------------------------


def _train(kind, shard=(0, 1), group=None):
    """STEPS AdamW steps of the sparse stage on the padded batch; each step's logits, losses,
    gradients and routes. Under context parallelism the gradients are averaged over the group
    before the step (the models' CP loss makes that average the global-mean gradient)."""
    model = cases.build(kind)
    model.set_indexer_training("sparse")
    routes = cases.route_log(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = cases.batch(kind)
    history = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        out = cases.run(kind, model, inputs, shard=shard, group=group)
        cases.total_loss(out).backward()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)
        history.append(
            (
                out.logits.detach(),
                out.loss.detach(),
                out.indexer_loss.detach(),
                cases.grads(model),
            )
        )
        optimizer.step()
    return history, routes


def _train_shard(rank, world_size, kind):
    history, routes = _train(kind, shard=(rank, world_size), group=dist.group.WORLD)
    losses = torch.stack([torch.stack([h[1], h[2]]) for h in history])
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)  # the CP group's mean: the global loss
    return history, losses, routes


@pytest.mark.parametrize("kind", KINDS)
def test_two_rank_context_parallel_training_equals_the_one_rank_run(kind):
    expected, expected_routes = _train(kind)
    results = run_on_ranks(2, _train_shard, kind)
    local = SEQUENCE // 2
    dim = _route_dim(kind)
    for rank, (history, losses, routes) in enumerate(results):
        cols = slice(rank * local, (rank + 1) * local)
        assert len(routes) == len(expected_routes) == STEPS * ROUTED_LAYERS[kind]
        for got, want in zip(routes, expected_routes, strict=True):
            assert torch.equal(got, want.narrow(dim, cols.start, local))
        for step, ((logits, *_, grads), (ref_logits, ref_loss, ref_aux, ref_grads)) in enumerate(
            zip(history, expected, strict=True)
        ):
            # after an AdamW step the logits carry the step's normalised FP32 gradient differences
            tolerance = 1e-5 if step == 0 else 1e-4
            torch.testing.assert_close(logits, ref_logits[:, cols], rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(losses[step, 0], ref_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(losses[step, 1], ref_aux, rtol=1e-5, atol=1e-6)
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():  # the distillation grads sum long FP32 series
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # the run really trains, and the step changed what the indexers route
    assert expected[-1][1] < expected[0][1]


# -- state dict through a file ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_trained_state_dict_loads_into_a_fresh_model_with_identical_outputs_and_next_step(
    kind, tmp_path
):
    inputs = cases.batch(kind)

    def trained_model_and_optimizer(seed: int):
        model = cases.build(kind, seed=seed)
        model.set_indexer_training("sparse")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, optimizer):
        optimizer.zero_grad()
        out = cases.run(kind, model, inputs)
        cases.total_loss(out).backward()
        optimizer.step()
        return out

    model, optimizer = trained_model_and_optimizer(seed=0)
    for _ in range(2):
        step(model, optimizer)
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)

    fresh, fresh_optimizer = trained_model_and_optimizer(seed=7)
    with torch.no_grad():
        assert not torch.equal(
            cases.run(kind, fresh, inputs).logits, cases.run(kind, model, inputs).logits
        )
    saved = torch.load(path, weights_only=True)
    assert any(".indexer." in key for key in saved["model"])
    fresh.load_state_dict(saved["model"], strict=True)
    fresh_optimizer.load_state_dict(saved["optimizer"])
    with torch.no_grad():
        want, got = cases.run(kind, model, inputs), cases.run(kind, fresh, inputs)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.loss, want.loss) and torch.equal(got.indexer_loss, want.indexer_loss)
    # resuming: the next optimizer step from the loaded state is the same step
    step(model, optimizer)
    step(fresh, fresh_optimizer)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name


# -- errors at the model boundary ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: Step5Model(cases.qsa_config()),
            TypeError,
            r"^Step5Model: config must be a Step5Config",
        ),
        (
            lambda: QSAModel(cases.step5_config()),
            TypeError,
            r"^QSAModel: config must be a QSAConfig",
        ),
        (
            lambda: cases.step5_config(num_attention_heads=5),
            ValueError,
            r"^Step5Config: num_attention_heads \(5\) must be a multiple of num_attention_groups",
        ),
        (
            lambda: cases.step5_config(hidden_size=64),
            ValueError,
            r"^Step5Config: sparse_config.hidden_size \(32\) must equal hidden_size \(64\)",
        ),
        (
            lambda: cases.qsa_config(indexer_budget=9),
            ValueError,
            r"^QSAConfig: indexer_budget \(9\) must be divisible by indexer_compress_ratio",
        ),
        (
            lambda: cases.qsa_config(layer_types=("qsa", "csa")),
            ValueError,
            r"^QSAConfig: layer_types must be 'qsa' or 'dense'",
        ),
        (
            lambda: cases.build("step5").set_indexer_training("warm"),
            ValueError,
            r"^Step5Model.set_indexer_training: mode must be one of",
        ),
        (
            lambda: cases.build("qsa").set_indexer_training("warm"),
            ValueError,
            r"^QSAModel.set_indexer_training: mode must be one of",
        ),
    ],
    ids=[
        "step5-model-of-a-qsa-config",
        "qsa-model-of-a-step5-config",
        "step5-heads",
        "step5-sparse-width",
        "qsa-budget",
        "qsa-layer-type",
        "step5-stage",
        "qsa-stage",
    ],
)
def test_bad_configs_fail_at_construction_naming_the_field(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _ids(length: int = 8, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, cases.VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))


def _left_padded_mask() -> torch.Tensor:
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[0, 0] = 0
    return mask


BAD_BATCHES = {
    "step5-float-ids": ("step5", dict(input_ids=_ids().float()), TypeError, "input_ids"),
    "step5-labels-shape": ("step5", dict(labels=_ids(7)), ValueError, "labels"),
    "step5-float-labels": ("step5", dict(labels=_ids().float()), ValueError, "labels"),
    "step5-positions-gap": (
        "step5",
        dict(positions=torch.tensor([[0, 1, 2, 4, 5, 6, 7, 8]] * 2)),
        ValueError,
        "positions",
    ),
    "step5-padding-first": (
        "step5",
        dict(padding_mask=torch.tensor([[True] + [False] * 7] * 2)),
        ValueError,
        "padding_mask",
    ),
    "step5-cp-type": ("step5", dict(cp_group="ranks"), TypeError, "cp_group"),
    "step5-cp-shard-of-partial-regions": (
        "step5",
        dict(input_ids=_ids(6, rows=1), cp_group=ContextParallelLayout(0, 2, 12, 6)),
        ValueError,
        "cp_group",
    ),
    "qsa-float-ids": ("qsa", dict(input_ids=_ids().float()), TypeError, "input_ids"),
    "qsa-labels-shape": ("qsa", dict(labels=_ids(7)), ValueError, "labels"),
    "qsa-left-padded-mask": (
        "qsa",
        dict(attention_mask=_left_padded_mask()),
        ValueError,
        "attention_mask",
    ),
    "qsa-packed-batch-of-two": ("qsa", dict(cu_seqlens=(0, 3, 8)), ValueError, "cu_seqlens"),
    "qsa-cp-type": ("qsa", dict(cp_context="ranks"), TypeError, "cp_context"),
    "qsa-cp-shard-of-partial-blocks": (
        "qsa",
        dict(
            input_ids=_ids(7, rows=1),
            cp_context=QSAContextParallel(ContextParallelLayout(0, 2, 14, 7)),
        ),
        ValueError,
        "cp_context",
    ),
}


@pytest.mark.parametrize(
    ("kind", "kwargs", "error", "argument"), BAD_BATCHES.values(), ids=BAD_BATCHES.keys()
)
def test_bad_batches_fail_at_the_model_boundary_naming_the_argument(kind, kwargs, error, argument):
    model = cases.build(kind)
    op = "Step5Model.forward" if kind == "step5" else "QSAModel.forward"
    with pytest.raises(error) as raised:
        model(**{"input_ids": _ids(), **kwargs})
    message = str(raised.value)
    assert message.startswith(f"{op}: "), message
    assert argument in message.split(":", 1)[1], message
