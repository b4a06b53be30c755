"""QSA routes (sa-routing) feeding sparse GQA attention (sa-kernels), with replay and CP (sa-cp)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from sa_cp import RecomputeReplay, checkpoint_context_fn, gather_sequence
from sa_cp.testing import run_on_ranks
from sa_kernels import sparse_gqa_attention
from sa_routing import QSAContextParallel, QSAIndexer, QSAIndexerConfig, rotary_table

QSA_ROUTES: RecomputeReplay[torch.Tensor] = RecomputeReplay("qsa-routes")
SEQUENCE = 48  # compress ratio 3, budget 12: rows from position 14 on are sparse


def small_indexer(seed: int) -> QSAIndexer:
    """A randomly initialised FP32 indexer: hidden 40, 3 heads of 16 dims, budget 12 in blocks of 3."""
    config = QSAIndexerConfig(
        hidden_size=40,
        indexer_n_heads=3,
        indexer_head_dim=16,
        indexer_budget=12,
        indexer_compress_ratio=3,
    )
    torch.manual_seed(seed)
    indexer = QSAIndexer(config)
    indexer.init_weights(init_std=0.2)
    with torch.no_grad():
        indexer.q_norm.weight.uniform_(0.5, 1.5)
        indexer.k_norm.weight.uniform_(0.5, 1.5)
    return indexer


class RoutedQSAAttention(nn.Module):
    """A minimal QSA attention layer: frozen indexer routes, trainable q/k/v projections."""

    def __init__(
        self,
        seed: int = 0,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 8,
        backend: str = "reference",
    ) -> None:
        super().__init__()
        self.backend = backend  # "gather" runs the Triton kernels (interpreted on CPU)
        self.indexer = small_indexer(seed)
        hidden = self.indexer.config.hidden_size
        torch.manual_seed(seed + 1)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, 2 * kv_heads * head_dim, bias=False)
        self.shape = (heads, kv_heads, head_dim)
        self.indexer_calls = 0
        self.indexer.register_forward_hook(
            lambda *_: setattr(self, "indexer_calls", self.indexer_calls + 1)
        )

    def routes(self, hidden, freqs, cp):
        return QSA_ROUTES.select_or_replay(lambda: self.indexer(hidden, freqs, cp_context=cp))

    def forward(self, hidden, freqs, cp=None):
        heads, kv_heads, head_dim = self.shape
        batch, rows, _ = hidden.shape
        ids = self.routes(hidden, freqs, cp)
        query = self.q_proj(hidden).view(batch, rows, heads, head_dim)
        kv = self.kv_proj(hidden)
        if cp is not None:
            kv = gather_sequence(kv, group=cp.group)
        key, value = kv.view(batch, kv.shape[1], 2, kv_heads, head_dim).unbind(2)
        return sparse_gqa_attention(query, key, value, ids, backend=self.backend)


def inputs(batch: int = 2, seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, SEQUENCE, 40, generator=generator)
    freqs = rotary_table(torch.arange(SEQUENCE), 16)[None].expand(batch, -1, -1)
    weight = torch.randn(batch, SEQUENCE, 4, 8, generator=generator)
    return hidden, freqs, weight


def dense_masked_attention(layer: RoutedQSAAttention, hidden, ids):
    """Float64 softmax over a dense [queries, keys] mask built from the route sets."""
    heads, kv_heads, head_dim = layer.shape
    batch, rows, _ = hidden.shape
    q = layer.q_proj(hidden).double().view(batch, rows, heads, head_dim)
    k, v = layer.kv_proj(hidden).double().view(batch, rows, 2, kv_heads, head_dim).unbind(2)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
    mask = torch.zeros(batch, rows, rows, dtype=torch.bool)
    for b in range(batch):
        for row in range(rows):
            valid = ids[b, row][ids[b, row] >= 0].long()
            mask[b, row, valid] = True
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * head_dim**-0.5
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


BACKENDS = pytest.mark.parametrize("backend", ["reference", "gather"])


@BACKENDS
def test_routes_are_causal_and_attention_matches_a_dense_mask_of_the_routes(backend):
    layer = RoutedQSAAttention(backend=backend)
    hidden, freqs, _ = inputs()
    ids = layer.routes(hidden, freqs, None)
    positions = torch.arange(SEQUENCE)[None, :, None]
    valid = ids >= 0
    assert (ids[valid] <= positions.expand_as(ids)[valid]).all()  # causal
    assert valid.sum(-1).min() >= 1  # every row keeps at least itself
    assert (
        valid[:, 14:].sum(-1) < positions[:, 14:, 0] + 1
    ).all()  # sparse rows really drop tokens
    torch.testing.assert_close(
        layer(hidden, freqs).double(),
        dense_masked_attention(layer, hidden, ids),
        rtol=1e-5,
        atol=1e-6,
    )


def loss_and_grads(mode: str, flip_indexer_before_backward: bool = False):
    layer = RoutedQSAAttention()
    hidden, freqs, weight = inputs()
    hidden = hidden.clone().requires_grad_(True)
    if mode == "no-checkpoint":
        out = layer(hidden, freqs)
    else:
        context_fn = checkpoint_context_fn(None, QSA_ROUTES) if mode == "replay" else None
        kwargs = {"context_fn": context_fn} if context_fn else {}
        out = checkpoint(layer, hidden, freqs, use_reentrant=False, **kwargs)
    loss = (out * weight).sum()
    if flip_indexer_before_backward:
        with torch.no_grad():
            layer.indexer.qk_proj.weight[
                -layer.indexer.config.indexer_head_dim :
            ].neg_()  # the key rows
    loss.backward()
    grads = [hidden.grad, layer.q_proj.weight.grad, layer.kv_proj.weight.grad]
    return loss.detach(), grads, layer.indexer_calls


@pytest.mark.parametrize(
    ("mode", "calls"), [("no-checkpoint", 1), ("checkpoint", 2), ("replay", 1)]
)
def test_indexer_runs_once_per_step_with_replay_and_gradients_are_bitwise_equal(mode, calls):
    ref_loss, ref_grads, _ = loss_and_grads("no-checkpoint")
    loss, grads, indexer_calls = loss_and_grads(mode)
    assert indexer_calls == calls
    assert torch.equal(loss, ref_loss)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert torch.equal(grad, ref)


def test_replay_keeps_the_forward_routes_when_the_indexer_changes_before_backward():
    _, ref_grads, _ = loss_and_grads("no-checkpoint")
    _, grads, _ = loss_and_grads("replay", flip_indexer_before_backward=True)
    _, changed, _ = loss_and_grads("checkpoint", flip_indexer_before_backward=True)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
    assert not all(torch.equal(g, r) for g, r in zip(changed, ref_grads, strict=True))


def _sharded_step(rank, world_size, layer, hidden, freqs, weight):
    local = SEQUENCE // world_size
    cp = QSAContextParallel.create(local, group=dist.group.WORLD)
    rows = slice(cp.local_start, cp.local_start + local)
    out = layer(hidden[:, rows], freqs[:, rows], cp)
    (out * weight[:, rows]).sum().backward()
    return out.detach(), layer.q_proj.weight.grad, layer.kv_proj.weight.grad


@BACKENDS
@pytest.mark.parametrize("world_size", [2, 4], ids=["2ranks", "4ranks"])
def test_context_parallel_shards_match_the_single_process_layer(world_size, backend):
    layer = RoutedQSAAttention(backend=backend)
    hidden, freqs, weight = inputs()
    expected = layer(hidden, freqs)
    (expected * weight).sum().backward()
    results = run_on_ranks(
        world_size, _sharded_step, RoutedQSAAttention(backend=backend), hidden, freqs, weight
    )
    local = SEQUENCE // world_size
    for rank, (out, _, _) in enumerate(results):
        torch.testing.assert_close(out, expected[:, rank * local : (rank + 1) * local].detach())
    # Each rank holds the gradient of its own queries' loss; their sum is the single-process gradient.
    torch.testing.assert_close(sum(r[1] for r in results), layer.q_proj.weight.grad)
    torch.testing.assert_close(sum(r[2] for r in results), layer.kv_proj.weight.grad)
