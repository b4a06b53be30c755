"""`return_lse=True` of sparse_gqa_attention and sparse_region_attention: every backend's log-sum-exp
equals a float64 dense masked logsumexp built here from the same routes (padding and out-of-range
ids, repeats, empty rows), and the output is the one `return_lse=False` gives."""

import pytest
import torch

from sa_kernels.sparse_gqa import build_route_block_mask, sparse_gqa_attention
from sa_kernels.sparse_gqa.reference import sparse_gqa_attention_reference
from sa_kernels.sparse_region_attention import build_region_block_mask, sparse_region_attention
from sa_kernels.sparse_region_attention.reference import sparse_region_attention_reference
from sa_kernels.synthetic import clustered_routes, region_layout

SCALE = 0.3


def _qkv(batch, queries, heads, kv_heads, head_dim, kv_length, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    q = make(batch, queries, heads, head_dim).requires_grad_()
    k = make(batch, kv_length, kv_heads, head_dim).requires_grad_()
    v = make(batch, kv_length, kv_heads, head_dim).requires_grad_()
    return q, k, v, gen


def _dense_lse(q, k, visible, scale):
    """float64 logsumexp of scale·q·k over `visible` (bool [B, kv_heads, Q, S]) → [B, Q, heads];
    −inf on a row that sees no key."""
    heads, kv_heads = q.shape[2], k.shape[2]
    kk = k.detach().double().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.detach().double(), kk) * scale
    mask = visible.repeat_interleave(heads // visible.shape[1], dim=1)
    return torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1).transpose(1, 2)


def _route_visibility(ids, kv_length):
    """bool [B, route_heads, Q, S]: key s is in the row's route (ids outside [0, S) dropped)."""
    ids = ids.long() if ids.dim() == 4 else ids.long().unsqueeze(1)
    visible = torch.zeros(*ids.shape[:3], kv_length + 1, dtype=torch.bool)
    in_range = (ids >= 0) & (ids < kv_length)
    visible.scatter_(-1, torch.where(in_range, ids, kv_length), True)
    return visible[..., :kv_length]


def _region_visibility(ids, sources, kv_length, query_start):
    """bool [B, G, Q, S]: key s belongs to one of the row's regions and s <= query_start + q."""
    batch, groups, queries, _ = ids.shape
    regions = sources.shape[1]
    owner = torch.full((batch, kv_length), regions, dtype=torch.long)
    for b in range(batch):
        for r in range(regions):
            for row in sources[b, r].tolist():
                if 0 <= row < kv_length:
                    owner[b, row] = r
    chosen = torch.zeros(batch, groups, queries, regions + 1, dtype=torch.bool)
    in_range = (ids >= 0) & (ids < regions)
    chosen.scatter_(-1, torch.where(in_range, ids.long(), regions), True)
    chosen[..., regions] = False
    visible = chosen.gather(-1, owner[:, None, None, :].expand(batch, groups, queries, kv_length))
    rows = torch.arange(query_start, query_start + queries)
    return visible & (torch.arange(kv_length)[None, :] <= rows[:, None])


def _token_ids(shape, kv_length, gen, empty_rows=(3,)):
    """Ids in [−1, kv_length + 2): padding (−1) and out-of-range ids, a repeat in every row,
    `empty_rows` with no valid id."""
    ids = torch.randint(-1, kv_length + 2, shape, generator=gen, dtype=torch.int32)
    ids[..., 1] = ids[..., 0]
    ids[..., 4] = ids[..., 2]
    for row in empty_rows:
        ids[..., row, :] = torch.tensor([-1, kv_length, kv_length + 5])[torch.arange(shape[-1]) % 3]
    return ids


def _region_case(groups, queries, query_start, gen, empty_rows=(2,)):
    """Two documents (23 + 14 tokens, 3 padding) in regions of 4; per (group, query) random
    region ids in [−2, regions + 2) with a repeat and the query's own region; `empty_rows` select
    nothing."""
    kv_length = 40
    sources, owners, _ = region_layout([[23, 14]], kv_length, 4)
    regions = sources.shape[1]
    ids = torch.randint(-2, regions + 2, (1, groups, queries, 6), generator=gen, dtype=torch.int32)
    ids[..., 1] = ids[..., 0]
    own = owners[:, query_start : query_start + queries].view(1, 1, queries)
    ids[..., 2] = torch.where(own >= 0, own, regions).to(torch.int32)
    for row in empty_rows:
        ids[..., row, :] = -1
    return ids, sources, kv_length


def _assert_lse(lse, want, rows_empty):
    assert lse.dtype == torch.float32 and not lse.requires_grad
    assert torch.isneginf(lse[:, rows_empty]).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(lse.double()[finite], want[finite], rtol=0, atol=2e-5)


# ---------------------------------------------------------------- sparse_gqa_attention


@pytest.mark.parametrize("backend", ["reference", "gather"])
@pytest.mark.parametrize("per_group", [False, True], ids=["shared-route", "route-per-group"])
def test_gqa_lse_equals_dense_masked_logsumexp_and_out_is_unchanged(backend, per_group):
    q, k, v, gen = _qkv(2, 9, 4, 2, 16, 23, torch.float32)
    shape = (2, 2, 9, 7) if per_group else (2, 9, 7)
    ids = _token_ids(shape, 23, gen)
    out, lse = sparse_gqa_attention(q, k, v, ids, SCALE, backend=backend, return_lse=True)
    plain = sparse_gqa_attention(q, k, v, ids, SCALE, backend=backend)
    assert torch.equal(out, plain)
    assert lse.shape == (2, 9, 4) and lse.is_contiguous()
    _assert_lse(lse, _dense_lse(q, k, _route_visibility(ids, 23), SCALE), rows_empty=3)
    # the LSE carries no gradient; the output's gradients are those of the call without it
    grad = torch.randn_like(out)
    with_lse = torch.autograd.grad(out, (q, k, v), grad)
    without = torch.autograd.grad(plain, (q, k, v), grad)
    for got, want in zip(with_lse, without, strict=True):
        assert torch.equal(got, want)


def test_gqa_reference_lse_of_float64_inputs_is_float32_and_chunking_does_not_change_it():
    q, k, v, gen = _qkv(1, 11, 4, 1, 8, 19, torch.float64, seed=1)
    ids = _token_ids((1, 11, 5), 19, gen, empty_rows=(0,))
    out, lse = sparse_gqa_attention_reference(q, k, v, ids, SCALE, 4, return_lse=True)
    whole, lse_whole = sparse_gqa_attention_reference(q, k, v, ids, SCALE, return_lse=True)
    assert out.dtype == torch.float64 and torch.equal(lse, lse_whole)
    _assert_lse(lse, _dense_lse(q, k, _route_visibility(ids, 19), SCALE), rows_empty=0)


def test_gqa_lse_of_empty_batches_is_empty_float32():
    q, k, v, _ = _qkv(2, 0, 4, 2, 16, 5, torch.float32)
    out, lse = sparse_gqa_attention(
        q, k, v, torch.zeros(2, 0, 3, dtype=torch.int32), return_lse=True
    )
    assert out.shape == q.shape and lse.shape == (2, 0, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", ["gather", "reference"])
def test_return_lse_must_be_a_bool(backend):
    q, k, v, gen = _qkv(1, 4, 2, 1, 8, 6, torch.float32)
    ids = _token_ids((1, 4, 5), 6, gen, empty_rows=())
    with pytest.raises(TypeError, match=r"sparse_gqa_attention: return_lse must be a bool"):
        sparse_gqa_attention(q, k, v, ids, backend=backend, return_lse=1)
    ids, sources, kv_length = _region_case(1, 4, 30, gen)
    q, k, v, _ = _qkv(1, 4, 2, 1, 8, kv_length, torch.float32)
    with pytest.raises(TypeError, match=r"sparse_region_attention: return_lse must be a bool"):
        sparse_region_attention(q, k, v, ids, sources, query_start=30, return_lse="yes")


# ---------------------------------------------------------------- sparse_region_attention


@pytest.mark.parametrize("backend", ["reference", "gather"])
@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "two-groups"])
def test_region_lse_equals_dense_masked_logsumexp_and_out_is_unchanged(backend, groups):
    gen = torch.Generator().manual_seed(5)
    ids, sources, kv_length = _region_case(groups, 13, 24, gen)
    q, k, v, _ = _qkv(1, 13, 4, groups, 16, kv_length, torch.float32, seed=6)
    kwargs = dict(query_start=24, softmax_scale=SCALE, backend=backend)
    out, lse = sparse_region_attention(q, k, v, ids, sources, return_lse=True, **kwargs)
    plain = sparse_region_attention(q, k, v, ids, sources, **kwargs)
    assert torch.equal(out, plain)
    assert lse.shape == (1, 13, 4) and lse.is_contiguous()
    visible = _region_visibility(ids, sources, kv_length, 24)
    _assert_lse(lse, _dense_lse(q, k, visible, SCALE), rows_empty=2)
    grad = torch.randn_like(out)
    with_lse = torch.autograd.grad(out, (q, k, v), grad)
    without = torch.autograd.grad(plain, (q, k, v), grad)
    for got, want in zip(with_lse, without, strict=True):
        assert torch.equal(got, want)


def test_region_fa4_still_refuses_with_return_lse():
    gen = torch.Generator().manual_seed(2)
    ids, sources, kv_length = _region_case(1, 4, 30, gen)
    q, k, v, _ = _qkv(1, 4, 2, 1, 8, kv_length, torch.float32)
    with pytest.raises(RuntimeError, match=r"backend='fa4' is not wired for region routes"):
        sparse_region_attention(
            q, k, v, ids, sources, query_start=30, backend="fa4", return_lse=True
        )


# ---------------------------------------------------------------- Flex (eager on CPU, CUDA below)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("op", ["gqa", "region"])
def test_eager_flex_lse_is_natural_log_in_our_layout(op):
    """flex_attend's LSE path (return_aux, transpose to [B, Q, H]) with torch's eager
    flex_attention on CPU equals the dense logsumexp: Flex returns natural log."""
    from torch.nn.attention.flex_attention import flex_attention

    from sa_kernels.sparse_gqa.flex import flex_attend

    gen = torch.Generator().manual_seed(9)
    if op == "gqa":
        q, k, v, _ = _qkv(1, 12, 4, 2, 16, 23, torch.float32, seed=9)
        ids = _token_ids((1, 2, 12, 7), 23, gen)
        mask = build_route_block_mask(ids, 23, 4, build_flex=True)
        visible = _route_visibility(ids, 23)
    else:
        ids, sources, kv_length = _region_case(2, 12, 25, gen)
        q, k, v, _ = _qkv(1, 12, 4, 2, 16, kv_length, torch.float32, seed=9)
        mask = build_region_block_mask(ids, sources, kv_length, 4, query_start=25, build_flex=True)
        visible = _region_visibility(ids, sources, kv_length, 25)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = flex_attend(flex_attention, q, k, v, mask.flex, SCALE, return_lse=True)
    assert torch.equal(out, flex_attend(flex_attention, q, k, v, mask.flex, SCALE))
    assert lse.shape == (1, 12, 4) and lse.is_contiguous()
    _assert_lse(lse, _dense_lse(q, k, visible, SCALE), rows_empty=3 if op == "gqa" else 2)


# ---------------------------------------------------------------- CUDA backends (run on a GPU)


def _cuda_lse_close(lse, want):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(lse[finite], want[finite], rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gather", "flex", "fa4", "auto"])
def test_cuda_gqa_backends_lse_matches_the_reference(backend):
    """Every backend's LSE on clustered causal routes (whole tiles plus causal cuts, as FA4 takes)
    equals the reference's; out is the one without return_lse."""
    q, k, v, _ = _qkv(1, 1024, 8, 2, 128, 1024, torch.bfloat16, "cuda", seed=3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    ids = clustered_routes(1, 2, 1024, 1024, tiles_per_query=3, generator=gen, device="cuda")
    if backend == "fa4":
        from sa_kernels.sparse_gqa.fa4 import fa4_unavailable_reason

        if (reason := fa4_unavailable_reason(q.device)) is not None:
            pytest.skip(reason)
    else:  # an empty row (FA4 takes only whole tiles plus exact causal cuts)
        ids[:, :, 5] = -1
    mask = build_route_block_mask(ids, 1024, 8, build_flex=True)
    out, lse = sparse_gqa_attention(q, k, v, ids, backend=backend, block_mask=mask, return_lse=True)
    plain = sparse_gqa_attention(q, k, v, ids, backend=backend, block_mask=mask)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    _, want = sparse_gqa_attention_reference(q, k, v, ids, return_lse=True)
    assert lse.shape == (1, 1024, 8) and lse.dtype == torch.float32 and not lse.requires_grad
    _cuda_lse_close(lse, want)
    assert backend == "fa4" or torch.isneginf(lse[:, 5]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_cuda_region_backends_lse_matches_the_reference(backend):
    from sa_kernels.synthetic import csa_selection

    sources, owners, firsts = region_layout([[700, 324]], 1024, 16, device="cuda")
    q, k, v, _ = _qkv(1, 1024, 8, 2, 128, 1024, torch.bfloat16, "cuda", seed=4)
    gen = torch.Generator().manual_seed(4)
    ids = csa_selection(
        owners.cpu(), firsts.cpu(), sources.shape[1], groups=2, topk=6, generator=gen
    ).cuda()
    ids[:, :, 9] = sources.shape[1]  # a row with no region
    out, lse = sparse_region_attention(q, k, v, ids, sources, backend=backend, return_lse=True)
    plain = sparse_region_attention(q, k, v, ids, sources, backend=backend)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    _, want = sparse_region_attention_reference(q, k, v, ids, sources, return_lse=True)
    assert lse.shape == (1, 1024, 8) and lse.dtype == torch.float32 and not lse.requires_grad
    _cuda_lse_close(lse, want)
    assert torch.isneginf(lse[:, 9]).all()
