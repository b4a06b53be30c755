"""QSAIndexer: projection/compression/norm/RoPE against a plain rebuild, routes against the oracle, masks, packing, hooks."""

import itertools

import pytest
import torch
from qsa_cases import document_positions, small_indexer
from torch.nn import functional as F

from sa_cp import ContextParallelLayout
from sa_routing import (
    QSAContextParallel,
    QSAIndexer,
    QSAIndexerConfig,
    apply_qsa_rope,
    rotary_table,
)
from sa_routing.qsa import QSARMSNorm
from sa_routing.qsa.selection.reference import (
    select_qsa_token_ids_packed_reference,
    select_qsa_token_ids_reference,
)

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _rms(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _plain_tensors(indexer: QSAIndexer, hidden, freqs, cu_seqlens=None):
    """The indexer's queries and keys rebuilt from the fused projection in one pass (no chunking)."""
    cfg = indexer.config
    heads, dim, c = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    fused = F.linear(hidden, indexer.qk_proj.weight)
    queries = fused[..., : heads * dim].unflatten(-1, (heads, dim))
    queries = apply_qsa_rope(_rms(queries, indexer.q_norm.weight, cfg.rms_norm_eps), freqs)
    key_rows = fused[..., heads * dim :]
    spans = [(0, hidden.shape[1])] if cu_seqlens is None else list(itertools.pairwise(cu_seqlens))
    keys = []
    for start, stop in spans:
        blocks = (stop - start) // c
        groups = key_rows[:, start : start + blocks * c].unflatten(1, (blocks, c))
        mean = groups.float().mean(dim=2).to(hidden.dtype)
        normed = _rms(mean, indexer.k_norm.weight, cfg.rms_norm_eps)[:, :, None]
        keys.append(apply_qsa_rope(normed, freqs[:, start : start + blocks * c : c]))
    return queries, torch.cat(keys, dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_queries_and_keys_match_a_plain_rebuild(dtype):
    indexer = small_indexer(dtype)
    hidden = torch.randn(2, 53, 40).to(dtype)
    freqs = rotary_table(torch.arange(53).expand(2, 53), 8)
    queries, keys = _plain_tensors(indexer, hidden, freqs)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(indexer.index_queries(hidden, freqs), queries, atol=tol, rtol=tol)
    torch.testing.assert_close(indexer.compressed_keys(hidden, freqs), keys, atol=tol, rtol=tol)
    assert indexer.compressed_keys(hidden, freqs).shape == (
        2,
        17,
        1,
        16,
    )  # partial trailing group dropped


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [None, 5], ids=["auto-chunk", "chunk5"])
def test_forward_routes_equal_the_oracle_on_its_own_queries_and_keys(dtype, chunk):
    indexer = small_indexer(dtype, query_chunk_size=chunk)
    hidden = torch.randn(2, 151, 40).to(dtype)
    freqs = rotary_table(torch.arange(151).expand(2, 151), 8)
    mask = torch.ones(2, 151, dtype=torch.bool)
    mask[1, 100:] = False
    routes = indexer(hidden, freqs, attention_mask=mask)
    expected = select_qsa_token_ids_reference(
        indexer.index_queries(hidden, freqs),
        indexer.compressed_keys(hidden, freqs),
        torch.tensor([151, 100]),
        token_budget=12,
        compress_ratio=3,
    )
    assert routes.dtype == torch.int32 and routes.shape == (2, 151, 14)
    assert torch.equal(routes, expected)
    assert (routes[1, 100:] == -1).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_forward_routes_each_document_on_its_own(dtype):
    indexer = small_indexer(dtype)
    cu = (0, 40, 47, 130, 147)
    rows = 150
    hidden = torch.randn(1, rows, 40).to(dtype)
    freqs = rotary_table(document_positions(cu, rows)[None], 8)
    routes = indexer(hidden, freqs, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    queries, keys = _plain_tensors(indexer, hidden, freqs, cu)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(
        indexer.compressed_keys(hidden, freqs, cu_seqlens=cu), keys, atol=tol, rtol=tol
    )
    expected = select_qsa_token_ids_packed_reference(
        indexer.index_queries(hidden, freqs),
        indexer.compressed_keys(hidden, freqs, cu_seqlens=cu),
        cu,
        token_budget=12,
        compress_ratio=3,
    )
    assert torch.equal(routes, expected)
    # each document alone gives the same routes, shifted by its start
    for start, stop in itertools.pairwise(cu):
        alone = indexer(hidden[:, start:stop], freqs[:, start:stop])
        assert torch.equal(routes[:, start:stop], torch.where(alone >= 0, alone + start, -1))


def test_indexer_is_frozen_stateless_and_hookable():
    indexer = small_indexer(torch.float32)
    assert all(not p.requires_grad for p in indexer.parameters())
    assert {name for name, _ in indexer.named_parameters()} == {
        "qk_proj.weight",
        "q_norm.weight",
        "k_norm.weight",
    }
    seen = []
    indexer.register_forward_hook(lambda module, args, output: seen.append(output.clone()))
    hidden = torch.randn(1, 40, 40, requires_grad=True)
    freqs = rotary_table(torch.arange(40)[None], 8)
    first = indexer(hidden, freqs)
    second = indexer(hidden, freqs)
    assert torch.equal(first, second) and torch.equal(seen[0], first) and len(seen) == 2
    assert not first.requires_grad
    assert list(indexer.buffers()) == []


def test_init_weights_uses_the_given_std():
    indexer = QSAIndexer(QSAIndexerConfig(hidden_size=256, indexer_n_heads=2, indexer_head_dim=64))
    torch.manual_seed(0)
    indexer.init_weights(init_std=0.05)
    assert abs(indexer.qk_proj.weight.std().item() - 0.05) < 0.005
    assert torch.equal(indexer.q_norm.weight, torch.ones(64))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attention_mask": torch.ones(2, 1, 30, 30)}, r"\[batch, sequence\]"),
        ({"attention_mask": torch.tensor([[0] * 5 + [1] * 25] * 2)}, "left-padded"),
        ({"attention_mask": torch.tensor([[1] * 10 + [2] * 20] * 2)}, "document-id"),
        ({"cu_seqlens": torch.tensor([0, 10, 30])}, "needs batch 1"),
        ({"hidden": torch.randn(2, 30, 41)}, "hidden_size=40"),
        ({"freqs": torch.randn(2, 29, 8)}, "freqs_cis must be"),
    ],
    ids=[
        "4d-mask",
        "left-padding",
        "document-id-mask",
        "packed-batch-2",
        "wrong-hidden",
        "wrong-freqs",
    ],
)
def test_forward_rejects_bad_inputs_with_the_reason(kwargs, message):
    indexer = small_indexer(torch.float32)
    hidden = kwargs.pop("hidden", torch.randn(2, 30, 40))
    freqs = kwargs.pop("freqs", rotary_table(torch.arange(30)[None], 8))
    with pytest.raises(ValueError, match=message):
        indexer(hidden, freqs, **kwargs)


def test_packed_forward_rejects_mask_and_non_increasing_bounds():
    indexer = small_indexer(torch.float32)
    hidden, freqs = torch.randn(1, 30, 40), rotary_table(torch.arange(30)[None], 8)
    with pytest.raises(ValueError, match="exclude each other"):
        indexer(hidden, freqs, attention_mask=torch.ones(1, 30), cu_seqlens=(0, 30))
    with pytest.raises(ValueError, match="strictly increasing"):
        indexer(hidden, freqs, cu_seqlens=(0, 20, 20, 30))


def test_indexer_inputs_it_would_get_wrong_or_fail_on_obscurely_are_rejected():
    indexer = small_indexer(torch.float32)
    hidden, freqs = torch.randn(2, 12, 40), rotary_table(torch.arange(12)[None], 8)
    with pytest.raises(TypeError, match=r"indexer's dtype \(torch.float32\)"):
        indexer(hidden.bfloat16(), freqs)
    with torch.autocast("cpu", torch.bfloat16):  # autocast casts the projection's inputs itself
        assert indexer(hidden.bfloat16(), freqs).shape == (2, 12, indexer.config.route_width)
    with pytest.raises(ValueError, match="at least one token per row"):
        indexer(hidden[:, :0], freqs[:, :0])
    with pytest.raises(ValueError, match="needs batch 1"):
        indexer.compressed_keys(hidden, freqs, cu_seqlens=(0, 6, 12))
    norm = QSARMSNorm(4, 1e-6)
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        norm(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 4\]"):
        norm(torch.ones(2, 5))
    with pytest.raises(ValueError, match="eps must be a finite, non-negative float"):
        QSARMSNorm(4, -1.0)
    with pytest.raises(ValueError, match="rms_norm_eps must be a finite float"):
        QSAIndexerConfig(hidden_size=40, rms_norm_eps=float("inf"))


def test_context_parallel_context_validates_the_shard():
    with pytest.raises(ValueError, match="must cover global_length"):
        QSAContextParallel(ContextParallelLayout(rank=0, size=2, global_length=25, local_length=12))
    with pytest.raises(TypeError, match="ContextParallelLayout"):
        QSAContextParallel((0, 2, 24, 12))
    with pytest.raises(ValueError, match="sequence_lengths must lie"):
        QSAContextParallel(ContextParallelLayout(0, 2, 24, 12), sequence_lengths=(25,))
    with pytest.raises(TypeError, match="sequence_lengths must be a tuple of ints"):
        QSAContextParallel(ContextParallelLayout(0, 2, 24, 12), sequence_lengths=(True, True))
    with pytest.raises(TypeError, match="cu_seqlens must be"):
        QSAContextParallel(ContextParallelLayout(0, 2, 24, 12), cu_seqlens=(0, 10.9, 24))
    packed = QSAContextParallel(ContextParallelLayout(0, 2, 24, 12), cu_seqlens=[0, 10, 24])
    assert packed.cu_seqlens == (0, 10, 24)  # the validated host tuple
    empty = QSAContextParallel(ContextParallelLayout(0, 1, 12, 12), sequence_lengths=())
    with pytest.raises(ValueError, match="sequence_lengths has 0 rows"):
        small_indexer(torch.float32)(
            torch.randn(1, 12, 40), rotary_table(torch.arange(12)[None], 8), cp_context=empty
        )
    ctx = QSAContextParallel.create(
        12, global_length=10, attention_mask=torch.tensor([[1] * 7 + [0] * 3])
    )
    assert (ctx.rank, ctx.size, ctx.padded_length, ctx.sequence_lengths) == (0, 1, 12, (7,))
    indexer = small_indexer(torch.float32, indexer_compress_ratio=5, indexer_budget=10)
    two_ranks = QSAContextParallel(ContextParallelLayout(0, 2, 24, 12))  # planned, no group
    with pytest.raises(ValueError, match="multiple of the compress ratio"):
        indexer(
            torch.randn(1, 12, 40), rotary_table(torch.arange(12)[None], 8), cp_context=two_ranks
        )
    # one rank holds every block: a length that is not a multiple of the ratio routes as usual
    assert (
        indexer(torch.randn(1, 12, 40), rotary_table(torch.arange(12)[None], 8), cp_context=ctx)[
            0, 7:
        ]
        .eq(-1)
        .all()
    )
    with pytest.raises(ValueError, match=r"QSAContextParallel\.create"):
        small_indexer(torch.float32)(
            torch.randn(1, 12, 40),
            rotary_table(torch.arange(12)[None], 8),
            attention_mask=torch.ones(1, 12),
            cp_context=ctx,
        )


def test_single_rank_context_matches_plain_forward_with_padding():
    indexer = small_indexer(torch.float32)
    hidden, freqs = torch.randn(1, 60, 40), rotary_table(torch.arange(60)[None], 8)
    mask = torch.tensor([[1] * 50 + [0] * 10])
    ctx = QSAContextParallel.create(60, attention_mask=mask)
    assert torch.equal(
        indexer(hidden, freqs, cp_context=ctx), indexer(hidden, freqs, attention_mask=mask)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cuda_forward_matches_the_oracle_at_default_geometry(packed):
    """Forward projects queries chunk by chunk; the oracle gets them from one GEMM. cuBLAS may round a
    chunk's BF16 projection differently from the full one, so rows may differ only where that happens:
    at least 99.9% of rows must be identical and every row must keep the invariants."""
    torch.manual_seed(0)
    config = QSAIndexerConfig(hidden_size=512)
    indexer = QSAIndexer(config)
    indexer.init_weights(0.05)
    indexer = indexer.to("cuda", torch.bfloat16)
    rows = 6000
    hidden = torch.randn(1, rows, 512, device="cuda", dtype=torch.bfloat16)
    cu = (0, 2500, 2507, 5990) if packed else None
    positions = document_positions(cu, rows)[None] if packed else torch.arange(rows)[None]
    freqs = rotary_table(positions, 64).cuda()
    routes = indexer(hidden, freqs, cu_seqlens=cu)
    queries, keys = (
        indexer.index_queries(hidden, freqs),
        indexer.compressed_keys(hidden, freqs, cu_seqlens=cu),
    )
    if packed:
        expected = select_qsa_token_ids_packed_reference(
            queries, keys, cu, token_budget=2048, compress_ratio=4
        )
    else:
        expected = select_qsa_token_ids_reference(
            queries, keys, None, token_budget=2048, compress_ratio=4
        )
    same_rows = (routes == expected).all(dim=-1).float().mean().item()
    assert same_rows >= 0.999, f"only {same_rows:.4%} of rows equal the oracle"
    valid = routes >= 0
    assert torch.equal(valid.sum(-1), expected.ge(0).sum(-1)), (
        "every row keeps its exact valid count"
    )
    assert (valid[..., 1:] <= valid[..., :-1]).all(), "valid ids form a prefix"
    assert ((routes[..., 1:] > routes[..., :-1]) | ~valid[..., 1:]).all(), "ids ascending"
