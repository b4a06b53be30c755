"""The routed layers hand the main attention's log-sum-exp to the indexer's distillation loss: in the
sparse stage the loss receives the LSE the sparse attention returned (`return_lse=True`) and its
value and gradients equal those of the loss that computes its own LSE (`lse=None`)."""

import pytest
import torch

from sa_layers import testing
from sa_layers.qsa import attention as qsa_attention
from sa_layers.step5 import attention as step5_attention
from sa_layers.testing import tiny_qsa_model, tiny_step5_model

SEQUENCE = 40
# Step-5 rows: a long document (sparse queries from position 12 on) then a short one; two documents
# and a padding tail.
DOCUMENTS = [[28, 12], [21, 14]]


def token_ids(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 50, (batch, SEQUENCE), generator=torch.Generator().manual_seed(seed))


def spy_on_loss(monkeypatch, module, name: str) -> list[dict]:
    """Wrap `module.name` (the layer's distillation loss): each call records the `lse` it got, its
    loss and the loss of the same call with `lse=None`, and the gradients of both with respect to
    the indexer's queries (the third argument)."""
    real = getattr(module, name)
    calls: list[dict] = []

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        own = real(*args, **{**kwargs, "lse": None})
        index_queries = args[2]
        calls.append(
            {
                "lse": kwargs.get("lse"),
                "loss": got.detach(),
                "own": own.detach(),
                "grad": torch.autograd.grad(got, index_queries, retain_graph=True)[0],
                "own_grad": torch.autograd.grad(own, index_queries)[0],
                "shape": (*args[0].shape[:3],),
            }
        )
        return got

    monkeypatch.setattr(module, name, spy)
    return calls


def assert_wired(calls: list[dict], layers: int, atol: float = 1e-6) -> None:
    assert len(calls) == layers
    for call in calls:
        lse = call["lse"]
        assert lse is not None, "the sparse stage must hand the attention's LSE to the loss"
        assert lse.shape == call["shape"] and lse.dtype == torch.float32
        assert not lse.requires_grad
        assert call["loss"].item() > 0
        torch.testing.assert_close(call["loss"], call["own"], rtol=1e-5, atol=atol)
        torch.testing.assert_close(call["grad"], call["own_grad"], rtol=1e-4, atol=atol)


@pytest.mark.parametrize("backend", ["reference", "gather"])
def test_qsa_sparse_stage_loss_gets_the_attention_lse_and_equals_its_own_lse_pass(
    monkeypatch, backend
):
    calls = spy_on_loss(monkeypatch, qsa_attention, "qsa_indexer_distillation_loss")
    model = tiny_qsa_model(attn_backend=backend)
    model.set_indexer_training("sparse")
    mask = torch.ones(2, SEQUENCE, dtype=torch.long)
    mask[1, 31:] = 0  # right padding
    out = model(token_ids(), attention_mask=mask)
    assert_wired(calls, layers=2)
    # padding queries route no key: their LSE is −inf; every other query attends its own token
    assert torch.equal(torch.isneginf(calls[0]["lse"]).any(-1), mask == 0)
    assert out.indexer_loss.item() > 0


def test_qsa_dense_warmup_loss_computes_its_own_lse(monkeypatch):
    """The warm-up attends by SDPA, which returns no log-sum-exp: the loss gets None."""
    calls = spy_on_loss(monkeypatch, qsa_attention, "qsa_indexer_distillation_loss")
    model = tiny_qsa_model()
    model.set_indexer_training("dense_warmup")
    assert model(token_ids()).indexer_loss.item() > 0
    assert [call["lse"] for call in calls] == [None, None]


def step5_run(model, stage: str):
    model.set_indexer_training(stage)
    positions, padding = testing.packed_positions(DOCUMENTS, SEQUENCE)
    device = next(model.parameters()).device
    return model(token_ids().to(device), positions.to(device), padding.to(device))


@pytest.mark.parametrize("backend", ["reference", "gather"])
def test_step5_sparse_stage_loss_gets_the_attention_lse_and_equals_its_own_lse_pass(
    monkeypatch, backend
):
    calls = spy_on_loss(monkeypatch, step5_attention, "csa_indexer_distillation_loss")
    model = tiny_step5_model(layer_types=("swa", "csa", "swa", "csa"), attn_backend=backend)
    out = step5_run(model, "sparse")
    assert_wired(calls, layers=2)
    padding = testing.packed_positions(DOCUMENTS, SEQUENCE)[1]
    # padding queries select no region: their LSE is −inf; every token sees its own region
    assert torch.equal(torch.isneginf(calls[0]["lse"]).any(-1), padding)
    assert out.indexer_loss.item() > 0


def test_step5_dense_warmup_on_cpu_loss_computes_its_own_lse(monkeypatch):
    """On CPU the warm-up attends by masked SDPA (no log-sum-exp): the loss gets None."""
    calls = spy_on_loss(monkeypatch, step5_attention, "csa_indexer_distillation_loss")
    step5_run(tiny_step5_model(layer_types=("swa", "csa", "swa", "csa")), "dense_warmup")
    assert [call["lse"] for call in calls] == [None, None]


@pytest.mark.gpu
def test_cuda_step5_dense_warmup_loss_gets_the_flex_lse_and_equals_its_own_lse_pass(monkeypatch):
    """On CUDA the warm-up attends by Flex over the batch's dense mask, which returns the LSE."""
    calls = spy_on_loss(monkeypatch, step5_attention, "csa_indexer_distillation_loss")
    model = tiny_step5_model(layer_types=("swa", "csa", "swa", "csa"), attn_backend="gather")
    step5_run(model.cuda(), "dense_warmup")
    assert_wired(calls, layers=2, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_cuda_sparse_stage_losses_get_the_attention_lse(monkeypatch, backend):
    qsa_calls = spy_on_loss(monkeypatch, qsa_attention, "qsa_indexer_distillation_loss")
    model = tiny_qsa_model(attn_backend=backend).cuda()
    model.set_indexer_training("sparse")
    model(token_ids().cuda())
    assert_wired(qsa_calls, layers=2, atol=1e-4)
    csa_calls = spy_on_loss(monkeypatch, step5_attention, "csa_indexer_distillation_loss")
    model = tiny_step5_model(layer_types=("swa", "csa", "swa", "csa"), attn_backend=backend)
    step5_run(model.cuda(), "sparse")
    assert_wired(csa_calls, layers=2, atol=1e-4)
