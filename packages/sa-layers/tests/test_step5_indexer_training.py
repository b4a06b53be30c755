"""Step-5 indexer training: the distillation loss of the CSA layers, its gradient isolation, route
replay under checkpointing, context parallelism and sparsifying a dense model (CPU)."""

import functools

import model_checks as checks
import pytest
import torch
import torch.distributed as dist

from sa_cp.testing import run_on_ranks
from sa_kernels import sparse_region_attention
from sa_layers import Step5Attention, Step5Batch, Step5Model, testing
from sa_layers.testing import randomise_norms, tiny_step5_config, tiny_step5_model
from sa_routing import csa_indexer_distillation_loss

SEQUENCE = 48
# queries at document position >= (TOPK + 1) * REGION = 12 are sparse
REGION, TOPK = tiny_step5_config().sparse_config.region_size, tiny_step5_config().sparse_config.topk
# Row 0: a long document (sparse queries), then a short one. Row 1: two documents, a padding tail.
DOCUMENTS = [[30, 18], [21, 16]]
ROUTED = ("swa", "csa", "swa", "csa")
STAGES = ("dense_warmup", "sparse")


tiny_config = functools.partial(tiny_step5_config, layer_types=ROUTED)
tiny_model = functools.partial(tiny_step5_model, layer_types=ROUTED)


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 50, (2, SEQUENCE), generator=torch.Generator().manual_seed(seed))


def packed_positions() -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: back-to-back documents of DOCUMENTS' lengths, then padding."""
    return testing.packed_positions(DOCUMENTS, SEQUENCE)


def _step_loss(model: Step5Model, stage: str, with_indexer_loss: bool = True):
    """(model output, the loss a training step of `stage` backpropagates: the LM loss (sparse
    stage) plus the indexer loss)."""
    model.set_indexer_training(stage)
    positions, padding = packed_positions()
    out = model(token_ids(), positions, padding, labels=token_ids(seed=7))
    if stage == "dense_warmup":
        return out, out.indexer_loss
    return out, out.loss + out.indexer_loss if with_indexer_loss else out.loss


def run(model: Step5Model, stage: str, with_indexer_loss: bool = True):
    """One training step of `stage` (see `_step_loss`); returns the model output."""
    out, total = _step_loss(model, stage, with_indexer_loss)
    total.backward()
    return out


# -- gradient isolation --------------------------------------------------------------------------------


def test_sparse_stage_main_model_grads_are_identical_with_and_without_the_indexer_loss():
    lm_only, both = tiny_model(), tiny_model()
    run(lm_only, "sparse", with_indexer_loss=False)
    run(both, "sparse", with_indexer_loss=True)
    checks.assert_lm_loss_leaves_indexers_alone(lm_only, both)


@pytest.mark.parametrize("stage", STAGES)
def test_only_indexer_parameters_receive_the_indexer_loss_gradient(stage):
    model = tiny_model()
    model.set_indexer_training(stage)
    positions, padding = packed_positions()
    out = model(token_ids(), positions, padding)
    assert out.indexer_loss.item() > 0
    out.indexer_loss.backward()
    # two CSA layers: q/k/z/w projections, q norm, k norm weight and bias
    assert len(checks.indexer_names(model)) == 2 * 7
    checks.assert_only_indexers_have_gradients(model)


def test_stages_set_which_parameters_train_and_reject_an_unknown_stage():
    model = tiny_model()
    checks.assert_stages_set_trainable_parameters(model)
    for stage in ("dense_warmup", "sparse", "off"):
        model.set_indexer_training(stage)
        assert all(layer.self_attn.indexer_training == stage for layer in model.layers)
    positions, padding = packed_positions()
    assert model(token_ids(), positions, padding).indexer_loss is None
    with pytest.raises(ValueError, match=r"set_indexer_training: mode must be one of"):
        model.set_indexer_training("warmup")


# -- the loss is the distillation loss of the layer's own tensors --------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_layer_loss_equals_a_direct_distillation_call_on_the_layer_tensors(stage):
    config = tiny_config()
    torch.manual_seed(3)
    layer = Step5Attention(config, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    randomise_norms(layer)
    layer.indexer.requires_grad_(True)
    layer.indexer_training = stage
    seen = []
    layer.indexer.register_forward_hook(lambda _m, _i, out: seen.append(out))
    positions, padding = packed_positions()
    batch = Step5Batch.create(
        config, token_ids(), positions, padding, dense_warmup=stage == "dense_warmup"
    )
    metadata = batch.sparse_metadata
    assert torch.equal(batch.sparse_query_count, metadata.sparse_queries.sum())
    hidden = torch.randn(2, SEQUENCE, 32, generator=torch.Generator().manual_seed(4))
    _, loss = layer(hidden, batch)
    assert len(seen) == (stage == "sparse")  # the warm-up attends densely: nothing to route
    params = list(layer.indexer.parameters())
    grads = torch.autograd.grad(loss, params)

    indexer = layer.indexer
    query, key, value = layer.project(hidden, batch)
    keys, logits = indexer.training_keys(hidden, positions)
    lse = None  # the sparse stage hands the loss the sparse attention's log-sum-exp
    if stage == "sparse":
        _, lse = sparse_region_attention(
            query, key, value, seen[0].region_ids, metadata.region_sources,
            softmax_scale=layer.scale, backend="reference", return_lse=True,
        )  # fmt: skip
    total = csa_indexer_distillation_loss(
        query,
        key,
        *indexer.training_queries(hidden, positions),
        indexer.training_summaries(keys, logits, metadata),
        metadata,
        mode=stage,
        selection=seen[0] if stage == "sparse" else None,
        lse=lse,
        reduction="sum",
    )
    direct = total / metadata.sparse_queries.sum()  # one rank: the mean over its sparse queries
    assert direct.item() > 0
    assert torch.equal(loss, direct)
    for got, want in zip(grads, torch.autograd.grad(direct, params), strict=True):
        assert torch.equal(got, want)


def test_model_indexer_loss_is_the_sum_of_its_csa_layers_losses():
    model = tiny_model()
    model.set_indexer_training("sparse")
    losses = []
    for layer in model.layers:
        layer.self_attn.register_forward_hook(lambda _m, _i, out: losses.append(out[1]))
    positions, padding = packed_positions()
    out = model(token_ids(), positions, padding)
    assert [loss is None for loss in losses] == [True, False, True, False]
    assert torch.equal(out.indexer_loss, losses[1] + losses[3])


# -- route replay under activation checkpointing ---------------------------------------------------------


def checkpointed_step(stage: str, checkpointing: str):
    return checks.checkpointed_step(
        tiny_model(), checkpointing, lambda model: _step_loss(model, stage)[1]
    )


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
@pytest.mark.parametrize("stage", STAGES)
def test_checkpointing_with_indexer_training_routes_once_per_layer_and_grads_are_bitwise_equal(
    stage, checkpointing
):
    ref_loss, ref_grads, ref_calls = checkpointed_step(stage, "none")
    loss, grads, calls = checkpointed_step(stage, checkpointing)
    # sparse: two CSA layers, one indexer forward each (the recompute replays); warm-up: none
    assert ref_calls == calls == (2 if stage == "sparse" else 0)
    assert torch.equal(loss, ref_loss)
    assert len(grads) == len(ref_grads) > 0
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


# -- context parallelism on gloo ranks --------------------------------------------------------------------


def _sharded_stages(rank, world_size, ids, positions, padding, labels):
    local = SEQUENCE // world_size
    rows = slice(rank * local, (rank + 1) * local)
    results = {}
    for stage in STAGES:
        model = tiny_model()
        model.set_indexer_training(stage)
        out = model(
            ids[:, rows],
            positions[:, rows],
            padding[:, rows],
            labels[:, rows],
            cp_group=dist.group.WORLD,
        )
        total = out.indexer_loss if stage == "dense_warmup" else out.loss + out.indexer_loss
        total.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results[stage] = (out.indexer_loss.detach(), grads)
    return results


def test_2ranks_context_parallel_indexer_loss_and_grads_equal_one_rank():
    ids, labels = token_ids(), token_ids(seed=7)
    positions, padding = packed_positions()
    ranks = run_on_ranks(2, _sharded_stages, ids, positions, padding, labels)
    for stage in STAGES:
        model = tiny_model()
        out = run(model, stage)
        ref_grads = [p.grad for p in model.parameters() if p.requires_grad]
        losses = [r[stage][0] for r in ranks]
        torch.testing.assert_close(sum(losses) / 2, out.indexer_loss.detach(), rtol=1e-5, atol=0)
        for i, ref in enumerate(ref_grads):
            total = sum(r[stage][1][i] for r in ranks) / 2
            torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-6)


# -- sparsifying a dense model ------------------------------------------------------------------------------


def test_sparsify_keeps_the_dense_weights_and_its_warmup_computes_the_dense_logits():
    dense = tiny_model(layer_types=("swa", "dense", "swa", "dense"))
    sparse = Step5Model.sparsify(dense, indexer_std=0.05)
    assert sparse.config.layer_types == ("swa", "dense", "swa", "csa")  # the Step-5 pattern
    dense_state = dense.state_dict()
    state = sparse.state_dict()
    indexer = {k for k in state if ".indexer." in k}
    assert indexer and set(state) - indexer == set(dense_state)
    assert all(torch.equal(state[k], v) for k, v in dense_state.items())
    dense.load_state_dict({k: v for k, v in state.items() if k not in indexer})  # strict
    ix = sparse.indexers()[0]
    assert torch.equal(ix.q_norm.weight, torch.zeros_like(ix.q_norm.weight))
    assert torch.equal(ix.k_norm.weight, torch.ones_like(ix.k_norm.weight))
    assert 0.03 < ix.q_proj.weight.std().item() < 0.07

    positions, padding = packed_positions()
    want = dense(token_ids(), positions, padding).logits
    sparse.set_indexer_training("dense_warmup")
    warmup = sparse(token_ids(), positions, padding)
    assert torch.equal(warmup.logits, want)  # the CSA layer attends exactly as the dense one
    assert warmup.indexer_loss.item() > 0
    sparse.set_indexer_training("sparse")
    assert not torch.allclose(sparse(token_ids(), positions, padding).logits, want)

    every = Step5Model.sparsify(dense, layer_types=ROUTED)
    assert every.config.layer_types == ROUTED and len(every.indexers()) == 2
    with pytest.raises(TypeError, match="sparsify: dense must be a Step5Model"):
        Step5Model.sparsify(dense.state_dict())
