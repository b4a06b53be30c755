"""Step-5 layers on the CUDA backends against the reference backend (bf16, head_dim 192; needs a GPU)."""

import pytest
import torch

from sa_layers import Step5Attention, Step5Batch, Step5Config, Step5Model
from sa_routing import Step5SparseConfig

pytestmark = pytest.mark.gpu

LENGTH = 8192
# Two documents: the first is long enough for sparse queries at every topk below, the second starts
# its regions and its window afresh mid-row.
DOCUMENTS = (6000, 2192)


def gpu_config(backend: str, kind: str = "csa", topk: int = 64, **overrides) -> Step5Config:
    """The reference attention geometry (64 heads, 4 groups, head_dim 192, window 512) at a smaller
    hidden size; indexer region 8 and `topk` regions."""
    fields = dict(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=4,
        layer_types=(kind,) * 4,
        partial_rotary_factor=0.5,
        sparse_config=Step5SparseConfig(hidden_size=1024, topk=topk),
        attn_backend=backend,
    )
    fields.update(overrides)
    return Step5Config(**fields)


def packed_positions(length: int = LENGTH) -> torch.Tensor:
    """DOCUMENTS, the second one longer by `length - LENGTH` tokens."""
    documents = (DOCUMENTS[0], DOCUMENTS[1] + length - LENGTH)
    return torch.cat([torch.arange(n) for n in documents])[None].cuda()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def layer_pair(backend: str, kind: str, topk: int = 64):
    torch.manual_seed(0)
    fast = Step5Attention(gpu_config(backend, kind, topk), 3, torch.bfloat16, "cuda")
    for name, p in fast.named_parameters():
        if "indexer" not in name and p.dim() == 2:
            torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
    ref = Step5Attention(gpu_config("reference", kind, topk), 3, torch.bfloat16, "cuda")
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def run_layer(
    layer: Step5Attention, hidden: torch.Tensor, positions: torch.Tensor | None, grad: bool
):
    """The layer's output, input gradient and region ids; positions None: one plain document."""
    config = layer.config
    ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device="cuda")
    batch = Step5Batch.create(config, ids, positions)
    seen = []
    if layer.indexer is not None:
        layer.indexer.register_forward_hook(lambda _m, _i, out: seen.append(out.region_ids))
    x = hidden.clone().requires_grad_(grad)
    out, _ = layer(x, batch)
    if grad:
        out.float().square().sum().backward()
    return out.detach(), (x.grad if grad else None), (seen[0] if seen else None)


def hidden_states(length: int = LENGTH) -> torch.Tensor:
    generator = torch.Generator("cuda").manual_seed(1)
    return torch.randn(1, length, 1024, device="cuda", generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("backend", "length"),
    [("gather", LENGTH), ("flex", LENGTH), ("auto", LENGTH), ("auto", 32768)],
    ids=lambda v: f"{v // 1024}k" if isinstance(v, int) else v,
)
def test_csa_layer_on_a_cuda_backend_equals_the_reference_backend_forward_and_backward(
    backend, length
):
    fast, ref = layer_pair(backend, "csa", topk=64)
    hidden, positions = hidden_states(length), packed_positions(length)
    out, grad, ids = run_layer(fast, hidden, positions, grad=True)
    ref_out, ref_grad, ref_ids = run_layer(ref, hidden, positions, grad=True)
    assert torch.equal(ids, ref_ids)
    assert relative_error(out, ref_out) < 1e-2
    assert relative_error(grad, ref_grad) < 2e-2
    qkv, ref_qkv = fast.qkv_proj.weight.grad, ref.qkv_proj.weight.grad
    assert relative_error(qkv, ref_qkv) < 2e-2


@pytest.mark.parametrize("backend", ["gather", "flex", "auto"])
def test_csa_layer_at_the_reference_topk_equals_the_reference_backend_forward(backend):
    fast, ref = layer_pair(backend, "csa", topk=512)
    hidden, positions = hidden_states(), packed_positions()
    with torch.no_grad():
        out, _, ids = run_layer(fast, hidden, positions, grad=False)
        ref_out, _, ref_ids = run_layer(ref, hidden, positions, grad=False)
    assert torch.equal(ids, ref_ids)
    assert relative_error(out, ref_out) < 1e-2


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("kind", ["swa", "dense"])
def test_flex_window_and_dense_layers_equal_the_masked_sdpa_reference(kind, packed):
    """Packed documents (document mask_mods) and a plain row (arithmetic ones)."""
    fast, ref = layer_pair("auto", kind)
    hidden, positions = hidden_states(), packed_positions() if packed else None
    out, grad, _ = run_layer(fast, hidden, positions, grad=True)
    ref_out, ref_grad, _ = run_layer(ref, hidden, positions, grad=True)
    assert relative_error(out, ref_out) < 1e-2
    assert relative_error(grad, ref_grad) < 2e-2


def test_fa4_backend_is_refused_on_csa_layers_with_the_reason():
    fast, _ = layer_pair("fa4", "csa")
    with pytest.raises(RuntimeError, match="fa4"):
        run_layer(fast, hidden_states(), packed_positions(), grad=False)


def test_step5_model_on_auto_equals_the_reference_model_and_trains_a_step():
    config = dict(layer_types=("swa", "swa", "swa", "csa"), moe_layers=(1,), num_experts=4)
    torch.manual_seed(0)
    fast = Step5Model(gpu_config("auto", **config), torch.bfloat16, "cuda")
    ref = Step5Model(gpu_config("reference", **config), torch.bfloat16, "cuda")
    ref.load_state_dict(fast.state_dict())
    generator = torch.Generator("cuda").manual_seed(2)
    ids = torch.randint(0, 512, (1, LENGTH), device="cuda", generator=generator)
    positions = packed_positions()
    outs = []
    for model in (fast, ref):
        out = model(ids, positions, labels=ids)
        out.loss.backward()
        outs.append((out.logits, out.loss, model.embed_tokens.weight.grad))
    assert (
        relative_error(outs[0][0], outs[1][0]) < 4e-2
    )  # bf16 logits through 4 layers (flex vs masked SDPA sum orders)
    assert abs(outs[0][1].item() - outs[1][1].item()) < 2e-2
    assert relative_error(outs[0][2], outs[1][2]) < 5e-2
