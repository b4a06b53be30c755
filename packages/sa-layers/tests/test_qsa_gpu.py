"""QSA layers on the CUDA backends against the reference backend (bf16; needs a GPU)."""

import pytest
import torch

from sa_layers import QSAConfig, QSAModel

pytestmark = pytest.mark.gpu


def gpu_model(backend: str, layers: int = 1, seed: int = 0, **overrides) -> QSAModel:
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        indexer_n_heads=4,
        indexer_head_dim=64,
        indexer_budget=512,
        indexer_compress_ratio=4,
        attn_backend=backend,
    )
    fields.update(overrides)
    return QSAModel(QSAConfig(**fields)).cuda().to(torch.bfloat16)


@pytest.mark.parametrize("backend", ["gather", "flex", "auto"])
@pytest.mark.parametrize("length", [8192, 16384], ids=["8k", "16k"])
def test_qsa_layer_on_a_cuda_backend_equals_the_reference_backend(backend, length):
    fast, ref = gpu_model(backend), gpu_model("reference")
    ref.load_state_dict(fast.state_dict())
    seen = {}
    for name, model in (("fast", fast), ("ref", ref)):
        model.indexers()[0].register_forward_hook(
            lambda _m, _i, out, name=name: seen.setdefault(name, out)
        )
    ids = torch.randint(
        0, 512, (1, length), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    grads = []
    for model in (fast, ref):
        out = model(ids, labels=ids)
        out.loss.backward()
        grads.append((out.logits.float(), model.layers[0].self_attn.q_proj.weight.grad.float()))
    assert torch.equal(seen["fast"], seen["ref"])
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=5e-2, atol=5e-3)


@pytest.mark.xfail(
    reason="torch.compile(QSAModel) does not trace yet on torch 2.11 (a Dynamo error while tracing "
    "the model's forward; open)",
    strict=False,
)
def test_compiled_qsa_model_equals_eager():
    model = gpu_model("auto", layers=2)
    ids = torch.randint(0, 512, (1, 4096), device="cuda")
    eager = model(ids).logits
    compiled = torch.compile(model)(ids).logits
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)
