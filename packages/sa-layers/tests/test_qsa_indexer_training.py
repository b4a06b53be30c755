"""QSA indexer training: gradient isolation of the distillation loss, the stages' trainable
parameters, route replay under checkpointing in both stages, and sparsifying a dense model (CPU)."""

import model_checks as checks
import pytest
import torch

from sa_layers import QSAModel
from sa_layers.testing import tiny_qsa_model as tiny_model

SEQUENCE = 40  # queries past position indexer_budget + compress_ratio - 1 = 9 are sparse
STAGES = ("dense_warmup", "sparse")


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 50, (2, SEQUENCE), generator=torch.Generator().manual_seed(seed))


def attention_mask() -> torch.Tensor:
    """Row 1 right-padded after 29 tokens."""
    mask = torch.ones(2, SEQUENCE, dtype=torch.long)
    mask[1, 29:] = 0
    return mask


def step_loss(model: QSAModel, stage: str, with_indexer_loss: bool = True) -> torch.Tensor:
    """The loss a training step of `stage` backpropagates: the indexer loss (warm-up), the LM loss
    plus the indexer loss (sparse stage)."""
    model.set_indexer_training(stage)
    out = model(token_ids(), attention_mask=attention_mask(), labels=token_ids(seed=7))
    if stage == "dense_warmup":
        return out.indexer_loss
    return out.loss + out.indexer_loss if with_indexer_loss else out.loss


# -- gradient isolation --------------------------------------------------------------------------------


def test_sparse_stage_main_model_grads_are_identical_with_and_without_the_indexer_loss():
    lm_only, both = tiny_model(), tiny_model()
    step_loss(lm_only, "sparse", with_indexer_loss=False).backward()
    step_loss(both, "sparse").backward()
    assert len(checks.indexer_names(both)) == 2 * 3  # two QSA layers: qk_proj, q_norm, k_norm
    checks.assert_lm_loss_leaves_indexers_alone(lm_only, both)


@pytest.mark.parametrize("stage", STAGES)
def test_only_indexer_parameters_receive_the_indexer_loss_gradient(stage):
    model = tiny_model()
    model.set_indexer_training(stage)
    out = model(token_ids(), attention_mask=attention_mask())
    assert out.indexer_loss.item() > 0
    out.indexer_loss.backward()
    checks.assert_only_indexers_have_gradients(model)


def test_stages_set_which_parameters_train():
    model = tiny_model()
    checks.assert_stages_set_trainable_parameters(model)
    assert model(token_ids(), attention_mask=attention_mask()).indexer_loss is None


# -- route replay under activation checkpointing ---------------------------------------------------------


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
@pytest.mark.parametrize("stage", STAGES)
def test_checkpointing_with_indexer_training_routes_once_per_layer_and_grads_are_bitwise_equal(
    stage, checkpointing
):
    ref_loss, ref_grads, ref_calls = checks.checkpointed_step(
        tiny_model(), "none", lambda model: step_loss(model, stage)
    )
    loss, grads, calls = checks.checkpointed_step(
        tiny_model(), checkpointing, lambda model: step_loss(model, stage)
    )
    # sparse: two QSA layers, one indexer forward each (the recompute replays); warm-up: none
    assert ref_calls == calls == (2 if stage == "sparse" else 0)
    assert torch.equal(loss, ref_loss)
    assert len(grads) == len(ref_grads) > 0
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


# -- sparsifying a dense model ------------------------------------------------------------------------------


def test_sparsify_keeps_the_dense_weights_and_its_warmup_computes_the_dense_logits():
    dense = tiny_model(layer_types=("dense", "dense"))
    sparse = QSAModel.sparsify(dense, indexer_std=0.05)
    assert sparse.config.layer_types == ("qsa", "qsa")
    dense_state, state = dense.state_dict(), sparse.state_dict()
    indexer = {k for k in state if ".indexer." in k}
    assert indexer and set(state) - indexer == set(dense_state)
    assert all(torch.equal(state[k], v) for k, v in dense_state.items())
    dense.load_state_dict({k: v for k, v in state.items() if k not in indexer})  # strict
    projection = sparse.indexers()[0].qk_proj.weight
    assert 0.03 < projection.std().item() < 0.07

    want = dense(token_ids(), attention_mask=attention_mask()).logits
    sparse.set_indexer_training("dense_warmup")
    warmup = sparse(token_ids(), attention_mask=attention_mask())
    assert torch.equal(warmup.logits, want)  # the routed layers attend exactly as the dense ones
    assert warmup.indexer_loss.item() > 0
    sparse.set_indexer_training("sparse")
    assert not torch.allclose(sparse(token_ids(), attention_mask=attention_mask()).logits, want)

    mixed = QSAModel.sparsify(dense, layer_types=("qsa", "dense"))
    assert mixed.config.layer_types == ("qsa", "dense") and len(mixed.indexers()) == 1
    with pytest.raises(TypeError, match="sparsify: dense must be a QSAModel"):
        QSAModel.sparsify(dense.state_dict())
    with pytest.raises(ValueError, match="layer_types must be 'qsa' or 'dense'"):
        QSAModel.sparsify(dense, layer_types=("qsa", "swa"))
