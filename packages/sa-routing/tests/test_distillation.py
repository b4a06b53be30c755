"""The indexer distillation losses: blockwise against the float64 oracle (loss and gradients), the
training projections against the routing path, gradient isolation, memory, CP recombination."""

import itertools

import pytest
import torch
import torch.distributed as dist
from distillation_cases import assert_matches_oracle, seeded
from qsa_cases import document_positions as qsa_document_positions
from qsa_cases import small_indexer
from step5_cases import document_positions
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sa_cp import ContextParallelLayout, gather_sequence, shard_sequence
from sa_cp.testing import run_on_ranks
from sa_routing import (
    QSAContextParallel,
    Step5SparseConfig,
    Step5SparseIndexer,
    csa_indexer_distillation_loss,
    qsa_indexer_distillation_loss,
    region_metadata,
    rotary_table,
    select_qsa_token_ids,
)
from sa_routing.distillation.reference import (
    csa_indexer_distillation_loss_reference,
    qsa_indexer_distillation_loss_reference,
)
from sa_routing.qsa.lengths import packed_block_starts
from sa_routing.step5.projection.reference import reference_project_keys, reference_project_queries
from sa_routing.step5.selection.reference import reference_select_regions
from sa_routing.step5.summaries.reference import reference_summaries

MODES = ["dense_warmup", "sparse"]


# -- QSA ----------------------------------------------------------------------------------------------


def _qsa_tensors(seed, batch, queries, total, blocks, heads=4, kv_heads=2, index_heads=3):
    g = seeded(seed)
    query = torch.randn(batch, queries, heads, 8, generator=g)
    key = torch.randn(batch, total, kv_heads, 8, generator=g)
    index_queries = torch.randn(batch, queries, index_heads, 6, generator=g).requires_grad_()
    keys = torch.randn(batch, blocks, 1, 6, generator=g).requires_grad_()
    return query, key, index_queries, keys


QSA_CASES = {
    # name: (batch, queries, total, query_start, lengths, cu_seqlens)
    "padded-B2-S37": (2, 37, 37, 0, [37, 29], None),
    "packed-docs-20-3-27-11-tail3": (1, 64, 64, 0, None, (0, 20, 23, 50, 61)),
    "cp-shard-2-of-3-padded": (2, 20, 60, 20, [60, 33], None),
    "cp-shard-3-of-3-packed": (1, 21, 63, 42, None, (0, 30, 47, 63)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", QSA_CASES, ids=list(QSA_CASES))
@pytest.mark.parametrize("blocks", [(5, 7), (128, 1024)], ids=["q5-k7", "q128-k1024"])
def test_qsa_loss_and_gradients_equal_the_float64_oracle(mode, case, blocks) -> None:
    batch, queries, total, start, lengths, cu = QSA_CASES[case]
    c, budget = 3, 9
    units = packed_block_starts(cu, c)[-1] if cu else total // c
    query, key, iq, ck = _qsa_tensors(len(case), batch, queries, total, units)
    routes = None
    if mode == "sparse":
        routes = select_qsa_token_ids(
            iq.detach(),
            ck.detach(),
            lengths,
            token_budget=budget,
            compress_ratio=c,
            query_position_offset=start,
            global_sequence_length=total,
            cu_seqlens=cu,
        )
    common = dict(
        token_budget=budget,
        compress_ratio=c,
        mode=mode,
        routes=routes,
        sequence_lengths=lengths,
        cu_seqlens=cu,
        query_start=start,
        softmax_scale=0.4,
    )
    loss = qsa_indexer_distillation_loss(
        query, key, iq, ck, **common, query_block=blocks[0], key_block=blocks[1]
    )
    oracle, _ = qsa_indexer_distillation_loss_reference(query, key, iq, ck, **common)
    assert_matches_oracle(
        loss, torch.autograd.grad(loss, (iq, ck)), oracle, torch.autograd.grad(oracle, (iq, ck))
    )


@pytest.mark.parametrize("mode", MODES)
def test_qsa_loss_with_the_attention_lse_equals_the_loss_that_computes_it(mode) -> None:
    query, key, iq, ck = _qsa_tensors(3, 2, 40, 40, 13)
    common = dict(token_budget=9, compress_ratio=3, mode=mode, sequence_lengths=[40, 35])
    if mode == "sparse":
        common["routes"] = select_qsa_token_ids(
            iq.detach(), ck.detach(), [40, 35], token_budget=9, compress_ratio=3
        )
    _, lse = qsa_indexer_distillation_loss_reference(query, key, iq, ck, **common)
    computed = qsa_indexer_distillation_loss(query, key, iq, ck, **common, key_block=8)
    given = qsa_indexer_distillation_loss(query, key, iq, ck, **common, lse=lse.float())
    torch.testing.assert_close(given, computed, rtol=1e-5, atol=1e-7)


# -- CSA ----------------------------------------------------------------------------------------------


def _positions_with_gaps() -> tuple[torch.Tensor, torch.Tensor]:
    """Row of 64: a 25-token document, 2 padding tokens, a 30-token document with 3 padding tokens
    inside it (after its position 11), then padding."""
    pos = [*range(25), 0, 0, *range(12), 0, 0, 0, *range(12, 30)]
    pad = [False] * 25 + [True] * 2 + [False] * 12 + [True] * 3 + [False] * 18
    pos += [0] * (64 - len(pos))
    pad += [True] * (64 - len(pad))
    return torch.tensor(pos), torch.tensor(pad)


def _csa_layout() -> tuple[torch.Tensor, torch.Tensor]:
    rows = [document_positions([25, 4, 30], 64), _positions_with_gaps()]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _csa_tensors(seed, batch, queries, total, regions, groups=2, heads_per_group=3, kv_heads=2):
    g = seeded(seed)
    query = torch.randn(batch, queries, 4, 8, generator=g)
    key = torch.randn(batch, total, kv_heads, 8, generator=g)
    iq = torch.randn(batch, queries, groups, heads_per_group, 6, generator=g).requires_grad_()
    iw = torch.randn(batch, queries, groups, heads_per_group, generator=g).requires_grad_()
    summaries = torch.randn(batch, regions, 6, generator=g).requires_grad_()
    return query, key, iq, iw, summaries


CSA_CASES = {
    # name: (query_start, queries, metadata tile size)
    "unsharded-tile7": (0, 64, 7),
    "unsharded-tile128": (0, 64, 128),
    "cp-shard-rows-20-50": (20, 30, 16),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CSA_CASES, ids=list(CSA_CASES))
@pytest.mark.parametrize("blocks", [(5, 7), (128, 1024)], ids=["q5-k7", "q128-k1024"])
def test_csa_loss_and_gradients_equal_the_float64_oracle(mode, case, blocks) -> None:
    start, queries, tile = CSA_CASES[case]
    region, topk = 3, 2
    pos, pad = _csa_layout()
    m = region_metadata(pos, pad, start, queries, region, topk, tile_size=tile)
    query, key, iq, iw, summaries = _csa_tensors(len(case), 2, queries, 64, m.region_count)
    selection = None
    if mode == "sparse":
        selection = reference_select_regions(
            iq.detach(), iw.detach(), summaries.detach(), pos, pad, start, region, topk
        )
    loss = csa_indexer_distillation_loss(
        query,
        key,
        iq,
        iw,
        summaries,
        m,
        mode=mode,
        selection=selection,
        softmax_scale=0.4,
        query_block=blocks[0],
        key_block=blocks[1],
    )
    oracle, _ = csa_indexer_distillation_loss_reference(
        query,
        key,
        iq,
        iw,
        summaries,
        pos,
        pad,
        region_size=region,
        topk=topk,
        mode=mode,
        region_ids=selection,
        query_start=start,
        softmax_scale=0.4,
    )
    inputs = (iq, iw, summaries)
    assert_matches_oracle(
        loss, torch.autograd.grad(loss, inputs), oracle, torch.autograd.grad(oracle, inputs)
    )


@pytest.mark.parametrize("mode", MODES)
def test_csa_loss_with_the_attention_lse_equals_the_loss_that_computes_it(mode) -> None:
    pos, pad = _csa_layout()
    m = region_metadata(pos, pad, 0, 64, 3, 2)
    query, key, iq, iw, summaries = _csa_tensors(5, 2, 64, 64, m.region_count)
    selection = None
    if mode == "sparse":
        selection = reference_select_regions(iq, iw, summaries, pos, pad, 0, 3, 2)
    _, lse = csa_indexer_distillation_loss_reference(
        query,
        key,
        iq,
        iw,
        summaries,
        pos,
        pad,
        region_size=3,
        topk=2,
        mode=mode,
        region_ids=selection,
    )
    args = (query, key, iq, iw, summaries, m)
    computed = csa_indexer_distillation_loss(*args, mode=mode, selection=selection, key_block=8)
    given = csa_indexer_distillation_loss(*args, mode=mode, selection=selection, lse=lse.float())
    torch.testing.assert_close(given, computed, rtol=1e-5, atol=1e-7)


# -- context parallelism ------------------------------------------------------------------------------


def test_qsa_shard_sums_over_the_global_count_recombine_the_unsharded_mean() -> None:
    total, shards, c, budget = 48, 3, 3, 9
    lengths = [48, 40]
    query, key, iq, ck = _qsa_tensors(7, 2, total, total, total // c)
    common = dict(
        token_budget=budget, compress_ratio=c, mode="dense_warmup", sequence_lengths=lengths
    )
    full = qsa_indexer_distillation_loss(query, key, iq, ck, **common)
    full_grads = torch.autograd.grad(full, (iq, ck))
    dense_positions = (budget // c + 1) * c - 1
    count = sum(max(0, n - dense_positions) for n in lengths)
    local = total // shards
    parts = []
    for rank in range(shards):
        rows = slice(rank * local, (rank + 1) * local)
        parts.append(
            qsa_indexer_distillation_loss(
                query[:, rows],
                key,
                iq[:, rows],
                ck,
                **common,
                query_start=rank * local,
                reduction="sum",
            )
        )
    combined = torch.stack(parts).sum() / count
    torch.testing.assert_close(combined, full, rtol=1e-6, atol=0)
    for got, want in zip(torch.autograd.grad(combined, (iq, ck)), full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)


def test_csa_shard_sums_over_the_global_count_recombine_the_unsharded_mean() -> None:
    pos, pad = _csa_layout()
    full_meta = region_metadata(pos, pad, 0, 64, 3, 2)
    query, key, iq, iw, summaries = _csa_tensors(9, 2, 64, 64, full_meta.region_count)
    inputs = (iq, iw, summaries)
    full = csa_indexer_distillation_loss(query, key, *inputs, full_meta, mode="dense_warmup")
    full_grads = torch.autograd.grad(full, inputs)
    parts, count = [], 0
    for rank in range(4):
        rows = slice(rank * 16, (rank + 1) * 16)
        m = region_metadata(pos, pad, rank * 16, 16, 3, 2)
        count += int(m.sparse_queries.sum())
        parts.append(
            csa_indexer_distillation_loss(
                query[:, rows],
                key,
                iq[:, rows],
                iw[:, rows],
                summaries,
                m,
                mode="dense_warmup",
                reduction="sum",
            )
        )
    combined = torch.stack(parts).sum() / count
    torch.testing.assert_close(combined, full, rtol=1e-6, atol=0)
    for got, want in zip(torch.autograd.grad(combined, inputs), full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)


# -- the indexers' training projections ----------------------------------------------------------------

STEP5 = Step5SparseConfig(
    proxy_dim=16,
    index_heads=4,
    num_provider_groups=2,
    rope_dim=8,
    rope_theta=(10000.0, 500.0),
    region_size=3,
    topk=2,
    hidden_size=24,
)


def _step5_indexer(dtype: torch.dtype, seed: int = 0) -> Step5SparseIndexer:
    torch.manual_seed(seed)
    indexer = Step5SparseIndexer(STEP5, 1, dtype)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1))
    return indexer


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_qsa_training_projections_equal_the_routing_projections_in_fp32(packed) -> None:
    indexer = small_indexer(torch.float32)
    cu = (0, 20, 23, 53) if packed else None
    hidden = torch.randn(1 if packed else 2, 53, 40, generator=seeded(1))
    positions = qsa_document_positions(cu, 53) if packed else torch.arange(53)
    freqs = rotary_table(positions, 8)[None]
    torch.testing.assert_close(
        indexer.training_queries(hidden, freqs), indexer.index_queries(hidden, freqs)
    )
    keys = indexer.training_keys(hidden, freqs, cu_seqlens=cu)
    torch.testing.assert_close(keys, indexer.compressed_keys(hidden, freqs, cu))
    assert keys.dtype == torch.float32
    dots = indexer.index_queries(hidden, freqs) @ keys[:, None, :, 0].transpose(-1, -2)
    expected = torch.relu(dots).sum(dim=2) / 16**0.5
    torch.testing.assert_close(indexer.training_scores(hidden, freqs, cu_seqlens=cu), expected)


def test_step5_training_projections_equal_the_reference_before_its_roundings() -> None:
    """FP32 indexer: keys and logits equal the reference exactly; queries and summaries differ from
    the checkpoint path by its E4M3 rounding only (3 mantissa bits)."""
    indexer = _step5_indexer(torch.float32)
    pos, pad = _csa_layout()
    hidden = torch.randn(2, 64, 24, generator=seeded(2))
    keys, logits = indexer.training_keys(hidden, pos)
    want_keys, want_logits = reference_project_keys(indexer, hidden, pos)
    torch.testing.assert_close(keys, want_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_logits)
    query, weights = indexer.training_queries(hidden, pos)
    rounded, want_weights = reference_project_queries(indexer, hidden, pos)
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(query, rounded.float(), rtol=2**-3, atol=2**-9)
    m = region_metadata(pos, pad, 0, 64, 3, 2)
    summaries = indexer.training_summaries(keys, logits, m)
    want = reference_summaries(want_keys, want_logits, pos, pad, 3).float()
    torch.testing.assert_close(summaries, want, rtol=2**-3, atol=2**-9)
    assert not torch.equal(summaries, want)  # no rounding on the training path
    scores = indexer.training_scores(hidden, pos, keys, logits, m)
    dots = torch.einsum("bqghd,bnd->bgqhn", query, summaries)
    torch.testing.assert_close(scores, torch.einsum("bgqhn,bqgh->bgqn", dots.relu(), weights))


# -- what the loss trains -----------------------------------------------------------------------------


def _frozen_main(hidden: torch.Tensor, heads: int, kv_heads: int, dim: int, seed: int):
    """A main-attention projection of `hidden` that requires grad: query [B, S, H, D], key [B, S, Hkv, D]."""
    torch.manual_seed(seed)
    proj = nn.Linear(hidden.shape[-1], (heads + kv_heads) * dim, bias=False)
    out = proj(hidden).unflatten(-1, (heads + kv_heads, dim))
    return proj, out[:, :, :heads], out[:, :, heads:]


@pytest.mark.parametrize("mode", MODES)
def test_qsa_loss_trains_every_indexer_parameter_and_nothing_else(mode) -> None:
    indexer = small_indexer(torch.float32, seed=3).requires_grad_(True)
    hidden = torch.randn(2, 45, 40, generator=seeded(3)).requires_grad_()
    freqs = rotary_table(torch.arange(45), 8)[None]
    proj, query, key = _frozen_main(hidden, 4, 2, 8, seed=4)
    routes = indexer(hidden, freqs) if mode == "sparse" else None
    loss = qsa_indexer_distillation_loss(
        query,
        key,
        indexer.training_queries(hidden, freqs),
        indexer.training_keys(hidden, freqs),
        token_budget=12,
        compress_ratio=3,
        mode=mode,
        routes=routes,
    )
    loss.backward()
    assert loss.item() > 0
    for name, p in indexer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert proj.weight.grad is None and hidden.grad is None


@pytest.mark.parametrize("mode", MODES)
def test_csa_loss_trains_every_indexer_parameter_and_nothing_else(mode) -> None:
    indexer = _step5_indexer(torch.bfloat16, seed=5).requires_grad_(True)
    pos, pad = _csa_layout()
    hidden = torch.randn(2, 64, 24, generator=seeded(5)).to(torch.bfloat16).requires_grad_()
    proj, query, key = _frozen_main(hidden.float(), 4, 2, 8, seed=6)
    m = region_metadata(pos, pad, 0, 64, 3, 2)
    keys, logits = indexer.training_keys(hidden, pos)
    index_queries, weights = indexer.training_queries(hidden, pos)
    selection = None
    if mode == "sparse":
        selection = indexer(hidden, pos, *indexer.project_keys(hidden, pos), pos, pad, metadata=m)
    loss = csa_indexer_distillation_loss(
        query,
        key,
        index_queries,
        weights,
        indexer.training_summaries(keys, logits, m),
        m,
        mode=mode,
        selection=selection,
    )
    loss.backward()
    assert loss.item() > 0
    for name, p in indexer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert proj.weight.grad is None and hidden.grad is None


def test_frozen_indexer_tensors_give_a_loss_without_gradients() -> None:
    """The default frozen indexer: the loss is computed (for logging) and carries no graph."""
    indexer = small_indexer(torch.float32, seed=7)
    hidden = torch.randn(1, 40, 40, generator=seeded(7))
    freqs = rotary_table(torch.arange(40), 8)[None]
    query, key = torch.randn(1, 40, 2, 8), torch.randn(1, 40, 1, 8)
    iq, ck = indexer.training_queries(hidden, freqs), indexer.training_keys(hidden, freqs)
    assert not iq.requires_grad and not ck.requires_grad
    loss = qsa_indexer_distillation_loss(
        query, key, iq, ck, token_budget=12, compress_ratio=3, mode="dense_warmup"
    )
    assert loss.item() > 0 and loss.grad_fn is None


# -- exact targets ------------------------------------------------------------------------------------


def _qsa_exact_case(seed: int):
    """Main keys constant within each block, one main head: the target of block u is
    `∝ exp(scale · q · k_u)`. Index query `[a·q, β]`, block key `[k_u, 1]` give logits
    `(a·q·k_u + β) / sqrt(D + 1)` (all dots positive): the target's logits when a = scale·sqrt(D + 1)."""
    g = seeded(seed)
    total, c, dim, scale = 40, 4, 8, 0.3
    query = torch.randn(1, total, 1, dim, generator=g)
    block_keys = torch.randn(1, total // c, dim, generator=g)
    key = block_keys.repeat_interleave(c, dim=1)[:, :, None]
    a = scale * (dim + 1) ** 0.5
    iq = torch.cat([a * query[:, :, 0], torch.full((1, total, 1), 100.0)], dim=-1)[:, :, None]
    ck = torch.cat([block_keys, torch.ones(1, total // c, 1)], dim=-1)[:, :, None]
    return query, key, iq, ck, scale


@pytest.mark.parametrize("mode", MODES)
def test_qsa_loss_is_zero_when_the_indexer_reproduces_the_target_and_positive_otherwise(
    mode,
) -> None:
    query, key, iq, ck, scale = _qsa_exact_case(8)
    common = dict(token_budget=8, compress_ratio=4, mode=mode, softmax_scale=scale)
    if mode == "sparse":
        common["routes"] = select_qsa_token_ids(iq, ck, None, token_budget=8, compress_ratio=4)
    exact = qsa_indexer_distillation_loss(query, key, iq, ck, **common)
    assert abs(exact.item()) < 1e-6
    off = iq.clone()
    off[..., :-1] *= 1.5
    assert qsa_indexer_distillation_loss(query, key, off, ck, **common).item() > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_csa_loss_is_zero_when_the_indexer_reproduces_the_target_and_positive_otherwise(
    mode,
) -> None:
    """Main keys constant within each (region, KV group), one main head per group: group g's target
    of region r is `∝ exp(scale · q_g · k_rg)` (historical regions are full). Summary
    `[k_r0, k_r1, 1]`, group g's index query `[a·q_g in its slot, β]`, weight 1: the same logits."""
    g = seeded(9)
    pos, pad = document_positions([40, 26], 66)
    pos, pad = pos[None], pad[None]
    m = region_metadata(pos, pad, 0, 66, 3, 2)
    regions, dim, scale = m.region_count, 8, 0.3
    query = torch.randn(1, 66, 2, dim, generator=g)
    region_keys = torch.randn(1, regions, 2, dim, generator=g)
    key = region_keys[:, m.token_regions[0].clamp_min(0)]
    summaries = torch.cat([region_keys.flatten(2), torch.ones(1, regions, 1)], dim=-1)
    iq = torch.zeros(1, 66, 2, 1, 2 * dim + 1)
    for group in range(2):
        iq[:, :, group, 0, group * dim : (group + 1) * dim] = scale * query[:, :, group]
    iq[..., -1] = 100.0
    weights = torch.ones(1, 66, 2, 1)
    selection = None
    if mode == "sparse":
        selection = reference_select_regions(iq, weights, summaries, pos, pad, 0, 3, 2)
    args = (query, key, iq, weights, summaries, m)
    exact = csa_indexer_distillation_loss(
        *args, mode=mode, selection=selection, softmax_scale=scale
    )
    assert abs(exact.item()) < 1e-6
    off = (query, key, iq, weights * 1.5, summaries, m)
    assert (
        csa_indexer_distillation_loss(*off, mode=mode, selection=selection, softmax_scale=scale)
        > 1e-3
    )


def test_calls_without_a_sparse_query_give_zero_and_zero_gradients() -> None:
    query, key, iq, ck = _qsa_tensors(10, 1, 11, 11, 3)
    loss = qsa_indexer_distillation_loss(
        query, key, iq, ck, token_budget=9, compress_ratio=3, mode="dense_warmup"
    )
    grads = torch.autograd.grad(loss, (iq, ck))
    assert loss.item() == 0 and all(not g.any() for g in grads)
    pos, pad = document_positions([9], 9)
    m = region_metadata(pos[None], pad[None], 0, 9, 3, 2)
    query, key, iq, iw, summaries = _csa_tensors(10, 1, 9, 9, m.region_count)
    loss = csa_indexer_distillation_loss(query, key, iq, iw, summaries, m, mode="dense_warmup")
    assert loss.item() == 0 and all(
        not g.any() for g in torch.autograd.grad(loss, (iq, iw, summaries))
    )


# -- memory -------------------------------------------------------------------------------------------


class _LargestOutput(TorchDispatchMode):
    """Records the largest element count, and the largest size in bytes, of any tensor an op
    produces."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("mode", MODES)
def test_no_tensor_of_an_8k_token_loss_outgrows_an_input_or_a_tile(mode) -> None:
    """8192 tokens, tiles of 128 queries x 1024 keys: nothing larger than the inputs, [heads, 128,
    1024] scores or [groups, 128, blocks + 1] unit rows exists in the forward or the backward (an
    [S, blocks] tensor would hold 16.8M elements, 64 times the tile)."""
    total, c, heads, query_block, key_block = 8192, 4, 2, 128, 1024
    query, key, iq, ck = _qsa_tensors(
        11, 1, total, total, total // c, heads=heads, kv_heads=1, index_heads=2
    )
    routes = None
    if mode == "sparse":
        routes = select_qsa_token_ids(
            iq.detach(), ck.detach(), None, token_budget=64, compress_ratio=c
        )
    inputs = max(t.numel() for t in (query, key, iq, ck))
    bound = max(inputs, heads * query_block * key_block, query_block * (total // c + 1))
    assert bound * 60 < total * (total // c)
    with _LargestOutput() as record:
        loss = qsa_indexer_distillation_loss(
            query,
            key,
            iq,
            ck,
            token_budget=64,
            compress_ratio=c,
            mode=mode,
            routes=routes,
            query_block=query_block,
            key_block=key_block,
        )
        loss.backward()
    assert loss.item() > 0 and iq.grad.abs().sum() > 0
    assert record.numel <= bound, (record.numel, bound)


def test_no_tensor_of_an_8k_token_csa_warmup_loss_outgrows_an_input_or_a_tile() -> None:
    """8192 tokens in two documents, regions of 8 (1024 regions), tiles of 128 queries x 1024
    keys: nothing larger than the inputs, [heads, 128, 1024] scores or [groups, 128, regions + 1]
    unit rows exists in the dense warm-up's forward or backward (an [S, regions] tensor would hold
    8.4M elements, 16 times the largest tile)."""
    total, region, query_block, key_block = 8192, 8, 128, 1024
    pos, pad = document_positions([5000, 3192], total)
    m = region_metadata(pos[None], pad[None], 0, total, region, 4)
    query, key, iq, iw, summaries = _csa_tensors(17, 1, total, total, m.region_count)
    inputs = max(t.numel() for t in (query, key, iq, iw, summaries))
    heads, groups = query.shape[2], iq.shape[2]
    bound = max(
        inputs, heads * query_block * key_block, groups * query_block * (m.region_count + 1)
    )
    assert bound * 15 < total * m.region_count
    with _LargestOutput() as record:
        loss = csa_indexer_distillation_loss(
            query, key, iq, iw, summaries, m, mode="dense_warmup", query_block=query_block,
            key_block=key_block,
        )  # fmt: skip
        loss.backward()
    assert loss.item() > 0 and iq.grad.abs().sum() > 0 and summaries.grad.abs().sum() > 0
    assert record.numel <= bound, (record.numel, bound)


# -- validation ---------------------------------------------------------------------------------------


def test_bad_arguments_raise_errors_that_name_the_argument() -> None:
    query, key, iq, ck = _qsa_tensors(12, 1, 12, 12, 4)
    common = dict(token_budget=6, compress_ratio=3)
    fn = qsa_indexer_distillation_loss
    with pytest.raises(ValueError, match="mode must be one of"):
        fn(query, key, iq, ck, **common, mode="warmup")
    with pytest.raises(ValueError, match="mode 'sparse' needs routes"):
        fn(query, key, iq, ck, **common, mode="sparse")
    with pytest.raises(ValueError, match="routes are read in mode 'sparse' only"):
        fn(
            query,
            key,
            iq,
            ck,
            **common,
            mode="dense_warmup",
            routes=torch.zeros(1, 12, 8, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match=r"routes must be \[batch, local_queries"):
        fn(
            query,
            key,
            iq,
            ck,
            **common,
            mode="sparse",
            routes=torch.zeros(1, 12, 7, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="compressed_keys holds 3 blocks"):
        fn(query, key, iq, ck[:, :3], **common, mode="dense_warmup")
    with pytest.raises(ValueError, match="query_start must be"):
        fn(query, key, iq, ck, **common, mode="dense_warmup", query_start=1)
    with pytest.raises(ValueError, match=r"lse must be \[batch, local_queries, heads\]"):
        fn(query, key, iq, ck, **common, mode="dense_warmup", lse=torch.zeros(1, 12, 3))
    with pytest.raises(ValueError, match="reduction must be one of"):
        fn(query, key, iq, ck, **common, mode="dense_warmup", reduction="none")
    with pytest.raises(TypeError, match="index_queries must be a floating tensor"):
        fn(query, key, iq.detach().long(), ck, **common, mode="dense_warmup")
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of key's kv_heads \(3\)"):
        fn(query, torch.randn(1, 12, 3, 8), iq, ck, **common, mode="dense_warmup")
    pos, pad = document_positions([12], 12)
    m = region_metadata(pos[None], pad[None], 0, 12, 3, 2)
    query, key, iq, iw, summaries = _csa_tensors(12, 1, 12, 12, m.region_count)
    with pytest.raises(
        ValueError, match=r"region_summaries must be \[batch, region_count, proxy_dim\]"
    ):
        csa_indexer_distillation_loss(query, key, iq, iw, summaries[:, 1:], m, mode="dense_warmup")
    with pytest.raises(ValueError, match="must match metadata"):
        csa_indexer_distillation_loss(
            query[:, 1:], key, iq[:, 1:], iw[:, 1:], summaries, m, mode="dense_warmup"
        )
    with pytest.raises(ValueError, match="mode 'sparse' needs selection"):
        csa_indexer_distillation_loss(query, key, iq, iw, summaries, m, mode="sparse")


# -- context parallelism on real ranks -----------------------------------------------------------------

CP_LENGTH, CP_DOCUMENTS = 90, (0, 20, 22, 59, 85)  # documents straddle the shard boundary at 45


def _qsa_cp_inputs(packed: bool):
    g = seeded(13)
    batch = 1 if packed else 2
    hidden = torch.randn(batch, CP_LENGTH, 40, generator=g)
    positions = (
        qsa_document_positions(CP_DOCUMENTS, CP_LENGTH) if packed else torch.arange(CP_LENGTH)
    )
    freqs = rotary_table(positions, 8)[None]
    query = torch.randn(batch, CP_LENGTH, 4, 8, generator=g)
    key = torch.randn(batch, CP_LENGTH, 2, 8, generator=g)
    lengths = None if packed else [CP_LENGTH, 61]
    return hidden, freqs, query, key, lengths


def _qsa_indexer_grads(rank: int, world_size: int, packed: bool) -> dict[str, torch.Tensor]:
    """One rank of the documented recipe: local queries, keys gathered with gradient, the sum of the
    shard's losses over the global count of sparse queries."""
    indexer = small_indexer(torch.float32, seed=14).requires_grad_(True)
    hidden, freqs, query, key, lengths = _qsa_cp_inputs(packed)
    layout = ContextParallelLayout.create(CP_LENGTH, dist.group.WORLD, multiple_of=3)
    mask = None if packed else torch.tensor([[1] * CP_LENGTH, [1] * 61 + [0] * 29])
    ctx = QSAContextParallel.from_layout(
        layout, attention_mask=mask, cu_seqlens=CP_DOCUMENTS if packed else None
    )
    local_hidden, local_freqs = shard_sequence(hidden, layout), shard_sequence(freqs, layout)
    loss = qsa_indexer_distillation_loss(
        shard_sequence(query, layout),
        key,
        indexer.training_queries(local_hidden, local_freqs),
        indexer.training_keys(local_hidden, local_freqs, cp_context=ctx),
        token_budget=indexer.config.indexer_budget,
        compress_ratio=indexer.config.indexer_compress_ratio,
        mode="dense_warmup",
        sequence_lengths=ctx.sequence_lengths,
        cu_seqlens=ctx.cu_seqlens,
        query_start=ctx.local_start,
        reduction="sum",
    )
    sizes = [b - a for a, b in itertools.pairwise(CP_DOCUMENTS)] if packed else lengths
    count = sum(max(0, n - indexer.config.dense_positions) for n in sizes)
    (loss / count).backward()
    return {name: p.grad for name, p in indexer.named_parameters()}


@pytest.mark.parametrize("packed", [False, True], ids=["padded-B2", "packed-B1"])
def test_qsa_indexer_gradients_summed_over_2_ranks_equal_one_process(packed) -> None:
    ranks = run_on_ranks(2, _qsa_indexer_grads, packed)
    indexer = small_indexer(torch.float32, seed=14).requires_grad_(True)
    hidden, freqs, query, key, lengths = _qsa_cp_inputs(packed)
    cu = CP_DOCUMENTS if packed else None
    loss = qsa_indexer_distillation_loss(
        query,
        key,
        indexer.training_queries(hidden, freqs),
        indexer.training_keys(hidden, freqs, cu_seqlens=cu),
        token_budget=indexer.config.indexer_budget,
        compress_ratio=indexer.config.indexer_compress_ratio,
        mode="dense_warmup",
        sequence_lengths=lengths,
        cu_seqlens=cu,
    )
    loss.backward()
    assert loss.item() > 0
    for name, p in indexer.named_parameters():
        torch.testing.assert_close(ranks[0][name] + ranks[1][name], p.grad, rtol=1e-4, atol=1e-6)


def _csa_cp_inputs():
    pos, pad = _csa_layout()
    g = seeded(15)
    hidden = torch.randn(2, 64, 24, generator=g)
    return (
        pos,
        pad,
        hidden,
        torch.randn(2, 64, 4, 8, generator=g),
        torch.randn(2, 64, 2, 8, generator=g),
    )


def _csa_indexer_grads(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    indexer = _step5_indexer(torch.float32, seed=16).requires_grad_(True)
    pos, pad, hidden, query, key = _csa_cp_inputs()
    local = slice(rank * 32, (rank + 1) * 32)
    m = region_metadata(pos, pad, rank * 32, 32, 3, 2)
    keys, logits = indexer.training_keys(hidden[:, local], pos[:, local])
    keys, logits = (
        gather_sequence(keys, dist.group.WORLD),
        gather_sequence(logits, dist.group.WORLD),
    )
    index_queries, weights = indexer.training_queries(hidden[:, local], pos[:, local])
    loss = csa_indexer_distillation_loss(
        query[:, local],
        key,
        index_queries,
        weights,
        indexer.training_summaries(keys, logits, m),
        m,
        mode="dense_warmup",
        reduction="sum",
    )
    count = m.sparse_queries.sum()
    dist.all_reduce(count)
    (loss / count).backward()
    return {name: p.grad for name, p in indexer.named_parameters()}


def test_csa_indexer_gradients_summed_over_2_ranks_equal_one_process() -> None:
    ranks = run_on_ranks(2, _csa_indexer_grads)
    indexer = _step5_indexer(torch.float32, seed=16).requires_grad_(True)
    pos, pad, hidden, query, key = _csa_cp_inputs()
    m = region_metadata(pos, pad, 0, 64, 3, 2)
    keys, logits = indexer.training_keys(hidden, pos)
    index_queries, weights = indexer.training_queries(hidden, pos)
    summaries = indexer.training_summaries(keys, logits, m)
    loss = csa_indexer_distillation_loss(
        query, key, index_queries, weights, summaries, m, mode="dense_warmup"
    )
    loss.backward()
    assert loss.item() > 0
    for name, p in indexer.named_parameters():
        torch.testing.assert_close(ranks[0][name] + ranks[1][name], p.grad, rtol=1e-4, atol=1e-6)


# -- CUDA ---------------------------------------------------------------------------------------------


def _to(device: str, *tensors):
    return tuple(
        t.detach().to(device).requires_grad_(t.requires_grad)
        if t.is_floating_point()
        else t.to(device)
        for t in tensors
    )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_cuda_losses_and_gradients_equal_the_cpu_ones(mode) -> None:
    total, c, budget = 2048, 4, 128
    cu = (0, 700, 703, 1900, 2048)
    cpu = _qsa_tensors(17, 1, total, total, packed_block_starts(cu, c)[-1], heads=8, index_heads=4)
    common = dict(token_budget=budget, compress_ratio=c, mode=mode, cu_seqlens=cu)
    results = []
    for device in ("cpu", "cuda"):
        query, key, iq, ck = _to(device, *cpu)
        routes = None
        if mode == "sparse":
            routes = select_qsa_token_ids(
                cpu[2].detach(),
                cpu[3].detach(),
                None,
                token_budget=budget,
                compress_ratio=c,
                cu_seqlens=cu,
            ).to(device)
        loss = qsa_indexer_distillation_loss(
            query.bfloat16(), key.bfloat16(), iq, ck, **common, routes=routes
        )
        results.append((loss, *torch.autograd.grad(loss, (iq, ck))))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

    pos, pad = document_positions([900, 5, 1100], total)
    pos, pad = pos[None], pad[None]
    m = region_metadata(pos, pad, 0, total, 8, 16)
    cpu = _csa_tensors(18, 1, total, total, m.region_count)
    selection = None
    if mode == "sparse":
        selection = reference_select_regions(*(t.detach() for t in cpu[2:]), pos, pad, 0, 8, 16)
    results = []
    for device in ("cpu", "cuda"):
        query, key, iq, iw, summaries = _to(device, *cpu)
        md = region_metadata(pos.to(device), pad.to(device), 0, total, 8, 16)
        loss = csa_indexer_distillation_loss(
            query.bfloat16(),
            key.bfloat16(),
            iq,
            iw,
            summaries,
            md,
            mode=mode,
            selection=None if selection is None else selection.to(device),
        )
        results.append((loss, *torch.autograd.grad(loss, (iq, iw, summaries))))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
def test_cuda_peak_memory_of_a_64k_token_qsa_loss_stays_within_its_tiles() -> None:
    """The reference geometry (24 heads of 256, 2 KV heads, 4 index heads of 128, c 4) at 65 536
    tokens: the extra memory of loss and backward is the FP32 gradients of the index tensors plus a
    few tiles; one FP32 [S, blocks] tensor would take 4 GiB."""
    total, c, heads, query_block, key_block = 65536, 4, 24, 256, 2048
    g = torch.Generator(device="cuda").manual_seed(19)
    query = torch.randn(1, total, heads, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    key = torch.randn(1, total, 2, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    iq = torch.randn(1, total, 4, 128, device="cuda", generator=g).requires_grad_()
    ck = torch.randn(1, total // c, 1, 128, device="cuda", generator=g).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = qsa_indexer_distillation_loss(
        query,
        key,
        iq,
        ck,
        token_budget=2048,
        compress_ratio=c,
        mode="dense_warmup",
        query_block=query_block,
        key_block=key_block,
    )
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    gradients = 4 * (iq.numel() + ck.numel())
    tile = 4 * max(heads * query_block * key_block, query_block * (total // c + 1))
    assert torch.isfinite(loss) and loss.item() > 0
    assert peak <= 3 * gradients + 8 * tile, (peak, gradients, tile)


def test_merged_dense_tiles_stay_within_the_budget_of_their_widest_temporary() -> None:
    """Causal tiles of 4 queries merge while `width · rows · units` fits: wider temporaries (more
    index heads per group) give smaller merged tiles, and every query row stays in one tile."""
    from sa_routing.distillation.blockwise import DistillationTile, merge_tiles

    tiles = tuple(DistillationTile(0, q, q + 4, 0, q // 4 + 1, 0, q + 4) for q in range(0, 64, 4))
    tiles += (DistillationTile(1, 0, 4, 0, 1, 0, 4),)  # another batch row never merges
    for width in (2, 10):
        merged = merge_tiles(tiles, width, budget=640)
        assert all(width * (t.query_stop - t.query_start) * (t.unit_stop - t.unit_start) <= 640
                   for t in merged)  # fmt: skip
        rows = [(t.batch, q) for t in merged for q in range(t.query_start, t.query_stop)]
        assert rows == [(t.batch, q) for t in tiles for q in range(t.query_start, t.query_stop)]
        assert merged[-1] == tiles[-1]
    assert len(merge_tiles(tiles, 2, 640)) < len(merge_tiles(tiles, 10, 640)) < len(tiles)
