"""What the QSA and the Step-5 model tests check alike (test support, not part of the package): the
float64 pieces of their attention references, a training step under activation checkpointing,
compiled against eager, context-parallel shards against one rank, and a short training run with a
state-dict round trip."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable

import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# -- the float64 references -----------------------------------------------------------------------


def rms_norm64(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A zero-centred RMS norm in float64: t / rms(t) · (1 + weight), over the last dimension."""
    return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps) * (1 + weight.double())


def masked_attention64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over the visible keys, scale head_dim^-0.5; a query that sees no key
    gets zeros.

    Args:
        q, k, v: float64 [batch, sequence, heads, head_dim] (K/V already expanded to the heads).
        visible: bool, broadcastable to [batch, heads, queries, keys].
    Returns:
        float64 [batch, sequence, heads, head_dim].
    """
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


# -- whole models in float64 --------------------------------------------------------------------------


def language_model64(model: nn.Module, ids: torch.Tensor, attention: Callable) -> torch.Tensor:
    """A decoder-only model written out in float64 from `model`'s weights: embedding, per layer
    `h + attention(layer.self_attn, norm(h))` and `h + mlp(norm(h))` (clamped SwiGLU), final norm,
    LM head. `attention` is the test's float64 reference of one attention layer."""
    eps = model.config.rms_norm_eps
    h = model.embed_tokens.weight.double()[ids]
    for layer in model.layers:
        h = h + attention(layer.self_attn, rms_norm64(h, layer.input_layernorm.weight, eps))
        x = rms_norm64(h, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        act = torch.nn.functional.silu(x @ mlp.gate_proj.weight.double().T)
        up = x @ mlp.up_proj.weight.double().T
        if mlp.limit > 0:
            act, up = act.clamp(max=mlp.limit), up.clamp(-mlp.limit, mlp.limit)
        h = h + (act * up) @ mlp.down_proj.weight.double().T
    return rms_norm64(h, model.norm.weight, eps) @ model.lm_head.weight.double().T


def assert_model_equals_float64(
    model: nn.Module, logits_of: Callable[[], torch.Tensor], reference_of: Callable, valid
) -> None:
    """`logits_of()` (the model's logits) and then `reference_of()` (the float64 model over what
    the first call routed) agree on the `valid` tokens ([B, L, 1] bool), and so does every
    non-indexer parameter's gradient of a random weighting of those logits (each non-zero)."""
    logits = logits_of()
    weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits * weight * valid).sum().backward()
    params = {n: p for n, p in model.named_parameters() if ".indexer." not in n}
    grads = {n: p.grad.clone() for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    expected = reference_of()
    (expected * weight.double() * valid).sum().backward()
    torch.testing.assert_close((logits * valid).double(), expected * valid, rtol=1e-4, atol=1e-5)
    for name, p in params.items():
        scale = p.grad.abs().max()
        assert scale > 0, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


# -- indexer training ----------------------------------------------------------------------------------


def indexer_names(model: nn.Module) -> set[str]:
    """The names of the model's indexer parameters."""
    return {name for name, _ in model.named_parameters() if ".indexer." in name}


def assert_lm_loss_leaves_indexers_alone(lm_only: nn.Module, both: nn.Module) -> None:
    """Two identical models after one sparse-stage backward, of the LM loss alone (`lm_only`) and
    of the LM plus indexer loss (`both`): every main parameter's gradient is the same, the indexers
    get gradients only from the indexer loss."""
    indexer = indexer_names(both)
    for (name, p), (_, q) in zip(lm_only.named_parameters(), both.named_parameters(), strict=True):
        if name in indexer:
            assert p.grad is None, f"{name}: the LM loss reached the indexer"
            assert q.grad is not None and q.grad.abs().sum() > 0, name
        else:
            assert p.grad is not None and torch.equal(p.grad, q.grad), name


def assert_only_indexers_have_gradients(model: nn.Module) -> None:
    """After a backward of the indexer loss alone: every indexer parameter, and nothing else, has
    a non-zero gradient."""
    indexer = indexer_names(model)
    for name, p in model.named_parameters():
        if name in indexer:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def assert_stages_set_trainable_parameters(model: nn.Module) -> None:
    """`set_indexer_training`: "off" trains all but the indexers, "dense_warmup" only them,
    "sparse" everything; leaves the model at "off"."""
    indexer = indexer_names(model)
    want = {
        "off": lambda name: name not in indexer,
        "dense_warmup": lambda name: name in indexer,
        "sparse": lambda name: True,
    }
    for stage, trains in want.items():
        model.set_indexer_training(stage)
        for name, p in model.named_parameters():
            assert p.requires_grad == trains(name), (stage, name)
    model.set_indexer_training("off")


# -- replay under activation checkpointing --------------------------------------------------------


def _recompute_everything_but_matmuls(ctx, op, *args, **kwargs):
    return (
        CheckpointPolicy.MUST_SAVE
        if op == torch.ops.aten.mm.default
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


def checkpointed_step(model: nn.Module, mode: str, loss_of: Callable[[nn.Module], torch.Tensor]):
    """One backward of `loss_of(model)` under activation checkpointing `mode`: "none", "full" or
    "selective" (every op recomputed but the matmuls). Returns (loss, the trainable parameters'
    gradients, how many times the model's indexers ran)."""
    calls = [0]
    for indexer in model.indexers():
        indexer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    if mode == "full":
        model.enable_activation_checkpointing()
    elif mode == "selective":
        model.enable_activation_checkpointing(
            functools.partial(
                create_selective_checkpoint_contexts, _recompute_everything_but_matmuls
            )
        )
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad], calls[0]


# -- torch.compile -----------------------------------------------------------------------------------


_DISABLED_CALLS = ("Batch.create", "routed_attention", "indexer_loss")


def assert_compiled_equals_eager(model: nn.Module, forward: Callable[[nn.Module], object]) -> None:
    """`forward(run)` (the model's output on the test's batch, the indexer's loss on) with `run` the
    model and then `torch.compile(model, backend="aot_eager")`: logits, loss plus indexer loss and
    every gradient equal eager's, and every gradient is non-zero. Dynamo breaks the graph only at
    the compiler-disabled calls: the batch layout (`*Batch.create`), `routed_attention` (route
    selection and sparse attention) and `indexer_loss`."""
    torch._dynamo.reset()
    results = []
    for run in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        counters["graph_break"].clear()
        out = forward(run)
        total = out.loss + out.indexer_loss
        total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), total.detach(), grads))
    breaks = list(counters["graph_break"])
    assert any("routed_attention" in reason for reason in breaks), breaks
    for reason in breaks:
        assert any(name in reason for name in _DISABLED_CALLS), reason[:500]
    (logits, loss, grads), (c_logits, c_loss, c_grads) = results
    torch.testing.assert_close(c_logits, logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
    assert c_grads.keys() == grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(c_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# -- context parallelism ---------------------------------------------------------------------------


def shard_result(model: nn.Module, out, routes: torch.Tensor):
    """What one rank returns: (logits, loss, the trainable parameters' gradients after the loss's
    backward, its first layer's routes)."""
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return out.logits.detach(), out.loss.detach(), grads, routes


def assert_shards_equal_single_rank(
    results: list, expected, ref_grads: list, routes: torch.Tensor, route_dim: int
) -> None:
    """Each rank's `shard_result` of a contiguous shard against the one-rank run: its logits and
    routes are the single rank's at its rows (`routes` sharded along `route_dim`), and the ranks'
    average loss and gradients are the single rank's."""
    world_size = len(results)
    local = expected.logits.shape[1] // world_size
    for rank, (logits, _, _, shard_routes) in enumerate(results):
        rows = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(logits, expected.logits[:, rows].detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(shard_routes, routes.narrow(route_dim, rank * local, local))
    # the CP loss's scaling makes the group average the global mean (loss and gradients)
    torch.testing.assert_close(sum(r[1] for r in results) / world_size, expected.loss.detach())
    for i, ref in enumerate(ref_grads):
        total = sum(r[2][i] for r in results) / world_size
        torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-6)


# -- training and checkpoints ----------------------------------------------------------------------


def assert_learns_and_round_trips(
    model: nn.Module, ids: torch.Tensor, fresh: Callable[[], nn.Module]
) -> None:
    """30 AdamW steps on the next token of the fixed rows `ids` halve the loss; the state dict,
    saved and loaded into `fresh()` (other weights), gives the same logits; the loaded indexers stay
    frozen."""
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    loaded = fresh()
    loaded.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert all(not p.requires_grad for ix in loaded.indexers() for p in ix.parameters())
