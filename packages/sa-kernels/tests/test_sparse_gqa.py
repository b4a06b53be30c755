"""sparse_gqa_attention: the oracle against dense masked attention, the gather kernels (Triton
interpreter on CPU, real sizes on CUDA) and FlexAttention against the oracle, route block masks."""

import math
import shutil

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from sa_kernels.sparse_gqa import (
    RouteBlockMask,
    auto_backend,
    build_route_block_mask,
    flex_kernel_options,
    sparse_gqa_attention,
)
from sa_kernels.sparse_gqa.block_mask import (
    FLEX_MIN_OCCUPANCY,
    TILE,
    _causal_tile_area,
    tile_pair_counts,
)
from sa_kernels.sparse_gqa.fa4 import fa4_route_issue, fa4_tiles, fa4_unavailable_reason
from sa_kernels.sparse_gqa.reference import (
    dense_route_mask,
    route_membership,
    sparse_gqa_attention_reference,
)
from sa_kernels.sparse_gqa.routes import canonical_routes
from sa_kernels.sparse_gqa.triton_kernels import (
    SWEEP_BACKWARD_CONFIGS,
    SWEEP_FORWARD_CONFIGS,
    gather_attention_backward,
    gather_attention_forward,
    key_split_bounds,
)
from sa_kernels.synthetic import clustered_routes, scattered_routes
from sa_kernels.testing import spread_copy


def _inputs(
    batch, queries, query_heads, kv_heads, head_dim, kv_length, dtype, device="cpu", seed=0
):
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    q = make(batch, queries, query_heads, head_dim).to(dtype).requires_grad_()
    k = make(batch, kv_length, kv_heads, head_dim).to(dtype).requires_grad_()
    v = make(batch, kv_length, kv_heads, head_dim).to(dtype).requires_grad_()
    return q, k, v, gen


def _random_ids(shape, kv_length, gen, device="cpu", empty_rows=(), repeats=True):
    """Random ids in [−1, kv_length) with forced repeats and some fully padded rows."""
    ids = torch.randint(-1, kv_length, shape, generator=gen, device=device, dtype=torch.int32)
    if repeats and shape[-1] > 3:
        ids[..., 1] = ids[..., 0]  # a repeat in every row
        ids[..., 3] = ids[..., 2]
    for row in empty_rows:
        ids[..., row, :] = -1
    return ids


def _dense_attention(q, k, v, ids, scale=None):
    """Independent formula: dense float64 scores under the route membership mask."""
    batch, queries, query_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    mask = dense_route_mask(ids, k.shape[1], query_heads)  # [B, Hq, Q, S]
    scale = head_dim**-0.5 if scale is None else scale
    kk = k.double().repeat_interleave(query_heads // kv_heads, dim=2)
    vv = v.double().repeat_interleave(query_heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.double(), kk) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqs,bshd->bqhd", probs, vv)


# ---------------------------------------------------------------- the oracle


@pytest.mark.parametrize("per_group", [False, True], ids=["shared-route", "route-per-group"])
@pytest.mark.parametrize(
    ("batch", "queries", "query_heads", "kv_heads", "head_dim", "kv_length", "width"),
    [(2, 19, 6, 2, 24, 37, 11), (1, 33, 4, 4, 16, 50, 64), (2, 7, 3, 1, 40, 9, 5)],
    ids=["B2-Q19-H6/2-D24-S37-W11", "B1-Q33-H4/4-D16-S50-W64", "B2-Q7-H3/1-D40-S9-W5"],
)
def test_reference_matches_dense_masked_softmax(
    batch, queries, query_heads, kv_heads, head_dim, kv_length, width, per_group
):
    q, k, v, gen = _inputs(
        batch, queries, query_heads, kv_heads, head_dim, kv_length, torch.float64
    )
    shape = (batch, kv_heads, queries, width) if per_group else (batch, queries, width)
    ids = _random_ids(shape, kv_length, gen, empty_rows=(2,))
    out = sparse_gqa_attention_reference(q, k, v, ids, query_chunk=4)
    torch.testing.assert_close(out, _dense_attention(q, k, v, ids), rtol=1e-12, atol=1e-12)
    assert out[:, 2].abs().max() == 0


def test_reference_chunking_and_id_order_never_change_results():
    q, k, v, gen = _inputs(2, 21, 4, 2, 16, 30, torch.float32)
    ids = _random_ids((2, 2, 21, 13), 30, gen)
    permuted = ids[..., torch.randperm(13, generator=gen)]
    whole = sparse_gqa_attention_reference(q, k, v, ids, query_chunk=64)
    torch.testing.assert_close(
        sparse_gqa_attention_reference(q, k, v, permuted, query_chunk=5), whole
    )


def test_reference_repeated_ids_count_once():
    q, k, v, gen = _inputs(1, 5, 2, 1, 8, 12, torch.float64)
    ids = torch.tensor(
        [[[0, 3, 7, -1], [5, 5, 5, 2], [1, 1, -1, -1], [4, 9, 4, 9], [11, 0, 11, 0]]]
    )
    collapsed = torch.tensor(
        [[[0, 3, 7, -1], [5, 2, -1, -1], [1, -1, -1, -1], [4, 9, -1, -1], [11, 0, -1, -1]]]
    )
    torch.testing.assert_close(
        sparse_gqa_attention_reference(q, k, v, ids),
        sparse_gqa_attention_reference(q, k, v, collapsed),
    )
    assert route_membership(ids, 12).sum(-1).tolist() == [[3, 2, 1, 2, 2]]


def test_reference_gradcheck_float64_with_empty_row_and_repeats():
    q, k, v, gen = _inputs(1, 6, 4, 2, 5, 9, torch.float64)
    ids = _random_ids((1, 2, 6, 7), 9, gen, empty_rows=(4,))
    fn = lambda q, k, v: sparse_gqa_attention_reference(
        q, k, v, ids, softmax_scale=0.7, query_chunk=4
    )
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_reference_empty_row_gives_zero_output_and_zero_gradients():
    q, k, v, gen = _inputs(1, 4, 2, 1, 8, 10, torch.float32)
    ids = _random_ids((1, 4, 6), 10, gen, empty_rows=(1,))
    ids[0, 1, :3] = torch.tensor([10, 11, -5])  # out of range counts as padding
    out = sparse_gqa_attention_reference(q, k, v, ids)
    grad_q, grad_k = torch.autograd.grad(out[:, 1].sum() + 0 * out.sum(), (q, k))
    assert out[:, 1].abs().max() == 0 and torch.isfinite(out).all()
    assert grad_q.abs().max() == 0 and grad_k.abs().max() == 0


# ---------------------------------------------------------------- canonical routes and block masks


def test_canonical_routes_sort_and_move_repeats_behind_the_distinct_ids():
    ids = torch.tensor([[[[5, -1, 2, 5, 9, 2], [-1, -1, -1, -1, -1, -1], [7, 0, 3, 11, 1, 0]]]])
    routes, counts = canonical_routes(ids, 10)
    assert routes.tolist() == [[[[2, 5, 9, 10, 10, 10], [10] * 6, [0, 1, 3, 7, 10, 10]]]]
    assert counts.tolist() == [[[3, 0, 4]]]
    assert counts.is_contiguous()  # the kernels read a row's counts at unit stride


def test_canonical_routes_keep_rows_that_are_already_ascending():
    ids = torch.tensor([[[[4, 6, 9, -1], [0, 1, -1, -1]], [[2, 3, 5, 8], [-1, -1, -1, -1]]]])
    routes, counts = canonical_routes(ids, 9)  # 9 is out of range: padding, like −1
    assert routes.tolist() == [[[[4, 6, 9, 9], [0, 1, 9, 9]], [[2, 3, 5, 8], [9, 9, 9, 9]]]]
    assert counts.tolist() == [[[2, 2], [4, 0]]]


def test_canonical_int32_routes_are_returned_without_a_copy():
    """The Step-5 selection's form (int32, contiguous, ascending, sentinel padding) is shared, not
    copied; any other padding, order or dtype gets a new tensor and leaves the input as it was."""
    ids = torch.tensor([[[[4, 6, 9, 9], [0, 1, 9, 9]], [[2, 3, 5, 8], [9, 9, 9, 9]]]]).int()
    assert canonical_routes(ids, 9)[0] is ids
    for other in (
        ids.long(),
        ids.masked_fill(ids == 9, -1),
        ids.flip(-1),
        ids.repeat(1, 1, 1, 2)[..., :4],
    ):
        before = other.clone()
        routes, _ = canonical_routes(other, 9)
        assert routes.data_ptr() != other.data_ptr() and torch.equal(other, before)
        assert routes.dtype == torch.int32 and routes.is_contiguous()


def _flex_membership(mask: RouteBlockMask, batch: int) -> torch.Tensor:
    """Dense membership the Flex BlockMask encodes: full tiles, plus partial tiles where mask_mod says so."""
    flex = mask.flex
    q_len, kv_len = flex.seq_lengths
    heads = flex.kv_num_blocks.shape[1]

    def tiles(num, idx):
        q_tiles, kv_tiles = idx.shape[-2], idx.shape[-1]
        dense = torch.zeros(batch, heads, q_tiles, kv_tiles + 1, dtype=torch.bool)
        slot = torch.arange(kv_tiles)
        live = slot < num.unsqueeze(-1)
        dense.scatter_(-1, torch.where(live, idx.long(), kv_tiles), True)
        dense = dense[..., :kv_tiles].repeat_interleave(128, -2).repeat_interleave(128, -1)
        return dense[..., :q_len, :kv_len]

    full = tiles(flex.full_kv_num_blocks, flex.full_kv_indices)
    partial = tiles(flex.kv_num_blocks, flex.kv_indices)
    mod = create_mask(flex.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    assert not (full & partial).any()
    return full | (partial & mod), mod


@pytest.mark.parametrize("per_group", [False, True], ids=["shared-route", "route-per-group"])
@pytest.mark.parametrize(
    ("queries", "kv_length", "kind"),
    [
        (300, 300, "clustered"),
        (257, 385, "clustered"),
        (200, 333, "scattered"),
        (129, 129, "random"),
    ],
    ids=["clustered-Q300-S300", "clustered-Q257-S385-tail", "scattered-Q200-S333", "random-Q129"],
)
def test_route_block_mask_membership_matches_oracle_mask(queries, kv_length, kind, per_group):
    batch, kv_heads, query_heads = 2, 2, 4
    route_heads = kv_heads if per_group else 1
    gen = torch.Generator().manual_seed(3)
    if kind == "clustered":
        ids = clustered_routes(
            batch, route_heads, queries, kv_length, tiles_per_query=2, generator=gen
        )
    elif kind == "scattered":
        ids = scattered_routes(
            batch, route_heads, queries, kv_length, block=4, blocks_per_query=9, generator=gen
        )
    else:
        ids = _random_ids((batch, route_heads, queries, 40), kv_length, gen)
    ids = ids if per_group else ids[:, 0]
    mask = build_route_block_mask(ids, kv_length, query_heads)
    membership, mod = _flex_membership(mask, batch)
    oracle = dense_route_mask(ids, kv_length, query_heads if per_group else 1)
    assert torch.equal(membership, oracle)
    causal_offset = mask.statistics.causal_offset
    if kind == "clustered":  # whole tiles plus the causal cut of the own tile: arithmetic mask_mod
        assert causal_offset == kv_length - queries
    else:
        assert causal_offset is None
        assert torch.equal(mod, oracle)  # the bitmap mask_mod alone is exact, also in full tiles
    if kind == "clustered" and queries % 128 == 0:
        assert mask.flex.full_kv_num_blocks.sum() > 0  # block-aligned runs become full tiles


@pytest.mark.parametrize(
    ("queries", "kv_length", "offset"),
    [(300, 300, 0), (200, 461, 261), (130, 700, 256), (1, 5, 4), (129, 129, -40), (64, 64, 7)],
)
def test_causal_tile_area_counts_pairs_on_or_below_the_causal_line(queries, kv_length, offset):
    q = torch.arange(queries).view(-1, 1)
    kv = torch.arange(kv_length).view(1, -1)
    dense = (kv <= q + offset).long()
    q_tiles, kv_tiles = -(-queries // TILE), -(-kv_length // TILE)
    dense = torch.nn.functional.pad(
        dense, (0, kv_tiles * TILE - kv_length, 0, q_tiles * TILE - queries)
    )
    expected = dense.view(q_tiles, TILE, kv_tiles, TILE).sum(dim=(1, 3))
    assert torch.equal(_causal_tile_area(queries, kv_length, torch.tensor(offset)), expected)


@pytest.mark.parametrize("per_group", [False, True], ids=["shared-route", "route-per-group"])
@pytest.mark.parametrize(
    ("queries", "kv_length", "shard_start"), [(300, 300, 0), (200, 600, 256), (150, 600, 301)]
)
def test_causal_routes_get_the_arithmetic_mask_mod_and_one_missing_pair_the_bitmap(
    queries, kv_length, shard_start, per_group
):
    """Dense causal rows (also a context-parallel shard in the middle of the keys: query i at key
    shard_start + i) are full tiles plus exact causal cuts; removing one pair of a cut tile, or one
    whole row, must fall back to the bitmap (both stay exact)."""
    route_heads = 2 if per_group else 1
    pos = shard_start + torch.arange(queries).view(-1, 1)
    ids = torch.arange(kv_length).view(1, -1).expand(queries, -1)
    ids = torch.where(ids <= pos, ids, -1).to(torch.int32)
    ids = ids.expand(1, route_heads, queries, kv_length).clone()
    ids = ids if per_group else ids[:, 0]
    for case in ("causal", "missing-pair", "empty-row"):
        if case == "missing-pair":
            ids[..., queries - 1, pos[queries - 1, 0]] = -1  # the last row's own key
        if case == "empty-row":
            ids[..., 0, :] = -1
        mask = build_route_block_mask(ids, kv_length, 4)
        membership, _ = _flex_membership(mask, 1)
        assert torch.equal(membership, dense_route_mask(ids, kv_length, 4 if per_group else 1))
        expected = shard_start if case == "causal" else None
        assert mask.statistics.causal_offset == expected, case


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("per_group", [False, True], ids=["shared-route", "route-per-group"])
def test_eager_flex_over_route_block_mask_matches_oracle(per_group):
    """The Flex call path (layout, GQA, BlockMask) with torch's eager flex_attention on CPU
    (forward only: Flex has no CPU backward; the gpu tests check gradients)."""
    from torch.nn.attention.flex_attention import flex_attention

    from sa_kernels.sparse_gqa.flex import flex_attend

    q, k, v, gen = _inputs(1, 200, 4, 2, 16, 261, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    route_heads = 2 if per_group else 1
    ids = scattered_routes(1, route_heads, 200, 261, block=4, blocks_per_query=40, generator=gen)
    ids[..., :128, :128] = torch.arange(
        128, 256, dtype=torch.int32
    )  # one full tile (routes need not be causal)
    ids = ids if per_group else ids[:, 0]
    mask = build_route_block_mask(ids, 261, 4)
    out = flex_attend(flex_attention, q, k, v, mask.flex, 0.3)
    ref = sparse_gqa_attention_reference(q, k, v, ids, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert mask.flex.full_kv_num_blocks.sum() > 0 and mask.flex.kv_num_blocks.sum() > 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_flex_on_cpu_matches_oracle_and_new_routes_reuse_the_compiled_kernel():
    """The mask_mod compiles through inductor; routes of one geometry never recompile it."""
    from torch.nn.attention.flex_attention import flex_attention

    from sa_kernels.sparse_gqa.flex import flex_attend

    compiled = torch.compile(flex_attention, dynamic=False)
    for seed in range(2):
        q, k, v, gen = _inputs(1, 300, 8, 2, 32, 300, torch.float32, seed=seed)
        q, k, v = q.detach(), k.detach(), v.detach()
        ids = scattered_routes(1, 2, 300, 300, block=4, blocks_per_query=40, generator=gen)
        ids[..., :128, :128] = torch.arange(128, 256, dtype=torch.int32)  # a full tile
        mask = build_route_block_mask(ids, 300, 8)
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            out = flex_attend(compiled, q, k, v, mask.flex, 0.2)
        ref = sparse_gqa_attention_reference(q, k, v, ids, 0.2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_route_block_mask_occupancy_and_tile_counts():
    ids = torch.full((1, 1, 256, 130), -1, dtype=torch.int32)
    ids[0, 0, :128, :128] = torch.arange(128)  # query tile 0 x key tile 0: full
    ids[0, 0, 128:, 0] = 200  # query tile 1 x key tile 1: 128 of 128·128 pairs
    mask = build_route_block_mask(ids, 256, 2, build_flex=False)
    pairs = tile_pair_counts(mask.routes, 256)
    assert pairs[0, 0].tolist() == [[128 * 128, 0], [0, 128]]
    assert mask.touched_tiles == 2
    assert mask.occupancy == pytest.approx((128 * 128 + 128) / (2 * 128 * 128))
    assert mask.flex is None
    assert mask.statistics is None  # a gather-only build skips the tile binning and its sync
    flex_mask = build_route_block_mask(ids, 256, 2, build_flex=None)
    assert flex_mask.flex is not None  # 0.5 >= threshold
    assert flex_mask.statistics == mask.tile_statistics()
    scattered = torch.arange(256, dtype=torch.int32).view(1, 256, 1) * 0 + torch.arange(
        0, 256, 16, dtype=torch.int32
    )
    assert build_route_block_mask(scattered, 256, 2, build_flex=None).flex is None  # occupancy 1/16


def test_synthetic_routes_are_causal_and_sized():
    gen = torch.Generator().manual_seed(0)
    s = scattered_routes(1, 2, 50, 70, block=4, blocks_per_query=5, generator=gen)
    pos = torch.arange(20, 70).view(1, 1, -1, 1)
    assert s.shape == (1, 2, 50, 23) and ((s <= pos) | (s == -1)).all()
    assert torch.equal(canonical_routes(s, 70)[0], torch.where(s >= 0, s, 70))  # already canonical
    # Dense rows (at most 5 complete blocks visible) select exactly tokens 0 … p.
    counts = canonical_routes(s, 70)[1]
    visible = (pos.view(-1) + 1) // 4
    expected = torch.where(visible <= 5, pos.view(-1) + 1, 20 + (pos.view(-1) + 1) % 4)
    assert torch.equal(counts[0, 0].long(), expected)
    c = clustered_routes(1, 1, 256, 384, tiles_per_query=2, generator=gen)
    pos = torch.arange(128, 384).view(1, 1, -1, 1)
    assert ((c <= pos) | (c == -1)).all()
    assert (canonical_routes(c, 384)[1] == 128 + (pos.view(-1) % 128) + 1).all()


# ---------------------------------------------------------------- the gather kernels (Triton interpreter)


GATHER_CASES = [
    pytest.param(2, 13, 6, 2, 24, 37, 11, True, id="B2-Q13-H6/2-D24-S37-W11-per-group"),
    pytest.param(1, 9, 4, 1, 40, 70, 70, False, id="B1-Q9-H4/1-D40-S70-W70-shared"),
    pytest.param(1, 6, 24, 2, 16, 21, 5, False, id="B1-Q6-H24/2-D16-S21-W5-G12"),
    pytest.param(2, 5, 2, 2, 72, 19, 9, True, id="B2-Q5-H2/2-D72-S19-W9-G1"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("batch", "queries", "query_heads", "kv_heads", "head_dim", "kv_length", "width", "per_group"),
    GATHER_CASES,
)
def test_gather_kernels_match_oracle_forward_and_backward(
    batch, queries, query_heads, kv_heads, head_dim, kv_length, width, per_group, dtype
):
    q, k, v, gen = _inputs(
        batch, queries, query_heads, kv_heads, head_dim, kv_length, dtype, seed=width
    )
    shape = (batch, kv_heads, queries, width) if per_group else (batch, queries, width)
    ids = _random_ids(shape, kv_length, gen, empty_rows=(1,))
    scale = 0.3 if per_group else None
    out = sparse_gqa_attention(q, k, v, ids, scale, backend="gather")
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = sparse_gqa_attention_reference(q.double(), k.double(), v.double(), ids, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad.double())
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    torch.testing.assert_close(out.double(), ref, **tol)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(
            got.double(), want.double(), **tol, msg=lambda m, n=name: f"d{n}: {m}"
        )
    assert out[:, 1].abs().max() == 0 and grads[0][:, 1].abs().max() == 0


def test_gather_forward_writes_every_output_element():
    q, k, v, gen = _inputs(1, 11, 4, 2, 20, 17, torch.float32)
    ids = _random_ids((1, 2, 11, 7), 17, gen, empty_rows=(3,))
    mask = build_route_block_mask(ids, 17, 4, build_flex=False)
    poisoned = torch.full_like(q, float("nan"))
    out, lse = gather_attention_forward(
        q.detach(), k.detach(), v.detach(), mask.routes, mask.counts, 0.5, out=poisoned
    )
    assert out.data_ptr() == poisoned.data_ptr() and not out.isnan().any()
    torch.testing.assert_close(out, sparse_gqa_attention_reference(q, k, v, ids, 0.5).detach())
    assert torch.isinf(lse[:, :, 3]).all() and torch.isfinite(lse[:, :, :3]).all()


@pytest.mark.parametrize("block_w", sorted({c["BLOCK_W"] for c in SWEEP_FORWARD_CONFIGS}))
def test_gather_forward_sweep_configs_match_the_oracle(block_w):
    # rows longer than every step, so that several steps and a ragged last one run
    q, k, v, gen = _inputs(1, 9, 4, 2, 16, 300, torch.float32)
    ids = _random_ids((1, 2, 9, 150), 300, gen, empty_rows=(4,))
    mask = build_route_block_mask(ids, 300, 4, build_flex=False)
    config = {"BLOCK_W": block_w, "num_warps": 4, "num_stages": 2}
    out, _ = gather_attention_forward(
        q.detach(), k.detach(), v.detach(), mask.routes, mask.counts, 0.25, _config=config
    )
    want = sparse_gqa_attention_reference(q, k, v, ids, 0.25).detach()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_w", sorted({c["BLOCK_W"] for c in SWEEP_BACKWARD_CONFIGS}))
@pytest.mark.parametrize("key_split", [0, 64, 50, 1000])
@pytest.mark.parametrize("per_group", [True, False])
def test_gather_backward_configs_and_key_passes_match_the_oracle(block_w, key_split, per_group):
    # passes of 64 and 50 keys over 200: rows span several passes, some passes of a row are empty,
    # row 4 of each batch row and row 6 of the second are empty, repeats take canonical_routes'
    # sorting path; 1000 keys: a single pass
    q, k, v, gen = _inputs(2, 9, 4, 2, 16, 200, torch.float32)
    ids = _random_ids((2, 2 if per_group else 1, 9, 90), 200, gen, empty_rows=(4,))
    ids[1, :, 6] = -1
    ids[..., 7, :] = torch.where(ids[..., 7, :] >= 0, ids[..., 7, :] % 40, -1)  # one pass only
    ids = ids if per_group else ids[:, 0]
    grad = torch.randn(q.shape, generator=gen)
    mask = build_route_block_mask(ids, 200, 4, build_flex=False)
    args = [t.detach() for t in (q, k, v)]
    out, lse = gather_attention_forward(*args, mask.routes, mask.counts, 0.25)
    config = {"BLOCK_W": block_w, "num_warps": 4, "num_stages": 1, "KEY_SPLIT": key_split}
    got = gather_attention_backward(
        *args, out, grad, lse, mask.routes, mask.counts, 0.25, _config=config
    )
    want = torch.autograd.grad(sparse_gqa_attention_reference(q, k, v, ids, 0.25), (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (got[0][:, 4] == 0).all() and (got[0][1, 6] == 0).all()


def test_key_split_bounds_find_each_pass_slots():
    routes, counts = canonical_routes(torch.tensor([[[[3, 70, 9, 64, 65, -1], [-1] * 6]]]), 130)
    bounds = key_split_bounds(routes, 130, 64)  # passes [0, 64), [64, 128), [128, 130)
    assert routes.tolist() == [[[[3, 9, 64, 65, 70, 130], [130] * 6]]]
    assert bounds.tolist() == [[[[0, 2, 5, 5], [0, 0, 0, 0]]]]
    assert torch.equal(bounds[..., -1], counts)


def test_gather_reuses_a_prebuilt_block_mask_and_ignores_duplicates():
    q, k, v, gen = _inputs(1, 8, 4, 2, 16, 25, torch.float32)
    ids = _random_ids((1, 8, 12), 25, gen)
    mask = build_route_block_mask(ids, 25, 4, build_flex=False)
    once = sparse_gqa_attention(q, k, v, ids, backend="gather", block_mask=mask)
    doubled = torch.cat([ids, ids.flip(-1)], dim=-1)
    twice = sparse_gqa_attention(q, k, v, doubled, backend="gather")
    torch.testing.assert_close(once, twice)
    torch.testing.assert_close(
        once, sparse_gqa_attention_reference(q, k, v, ids), rtol=1e-5, atol=1e-5
    )


def test_gather_accepts_strided_query_views():
    base, k, v, gen = _inputs(1, 7, 8, 2, 16, 20, torch.float32)
    q = base[:, :, ::2]  # heads stride 2·D: a view, like grouped QKV layouts
    ids = _random_ids((1, 7, 6), 20, gen)
    torch.testing.assert_close(
        sparse_gqa_attention(q, k, v, ids, backend="gather"),
        sparse_gqa_attention_reference(q, k, v, ids),
        rtol=1e-5,
        atol=1e-5,
    )


# ---------------------------------------------------------------- dispatch and errors


def _clustered_and_scattered_ids(route_heads):
    gen = torch.Generator().manual_seed(3)
    clustered = clustered_routes(1, route_heads, 384, 384, tiles_per_query=2, generator=gen)
    scattered = scattered_routes(
        1, route_heads, 384, 384, block=4, blocks_per_query=8, generator=gen
    )
    return clustered, scattered


@pytest.mark.parametrize("route_heads", [1, 2], ids=["route-heads1", "route-heads2"])
def test_auto_picks_flex_for_clustered_and_gather_for_scattered_routes_on_cuda(route_heads):
    """The dispatch decision only (host numbers of CPU-built masks, no kernel runs)."""
    clustered, scattered = _clustered_and_scattered_ids(route_heads)
    cuda = torch.device("cuda")
    clustered_mask = build_route_block_mask(clustered, 384, 4, build_flex=None)
    scattered_mask = build_route_block_mask(scattered, 384, 4, build_flex=None)
    assert clustered_mask.occupancy >= FLEX_MIN_OCCUPANCY > scattered_mask.occupancy
    h200 = {"dtype": torch.bfloat16, "head_dim": 128, "capability": (9, 0)}
    assert auto_backend(clustered_mask, cuda, **h200) == "flex"
    assert auto_backend(scattered_mask, cuda, **h200) == "gather"
    # A scattered mask built with its Flex BlockMask anyway still runs gather under auto.
    scattered_with_flex = build_route_block_mask(scattered, 384, 4, build_flex=True)
    assert auto_backend(scattered_with_flex, cuda, **h200) == "gather"
    # A gather-only build has no tile statistics: auto runs gather and never syncs for them.
    gather_only = build_route_block_mask(clustered, 384, 4, build_flex=False)
    assert auto_backend(gather_only, cuda, **h200) == "gather" and gather_only.statistics is None
    assert auto_backend(clustered_mask, "cpu", dtype=torch.bfloat16, head_dim=128) == "reference"


@pytest.mark.parametrize(
    ("dtype", "head_dim", "route_heads", "capability", "expected"),
    [
        (torch.bfloat16, 128, 2, (9, 0), "flex"),
        (torch.float16, 64, 1, (9, 0), "flex"),
        (torch.bfloat16, 256, 1, (9, 0), "flex"),
        (torch.bfloat16, 256, 2, (9, 0), "gather"),
        (torch.float32, 128, 1, (9, 0), "gather"),
        (torch.bfloat16, 192, 1, (9, 0), "gather"),
        (torch.bfloat16, 128, 1, (8, 0), "gather"),
        (torch.bfloat16, 128, 1, (10, 0), "gather"),
    ],
    ids=[
        "bf16-D128-per-group-sm90",
        "fp16-D64-shared-sm90",
        "bf16-D256-shared-sm90",
        "D256-per-group",
        "fp32",
        "D192",
        "sm80",
        "sm100",
    ],
)
def test_auto_runs_flex_only_inside_the_tested_envelope(
    dtype, head_dim, route_heads, capability, expected
):
    """Clustered routes outside the dtypes, head dims, route layouts and GPUs where Flex was
    measured run gather."""
    clustered, _ = _clustered_and_scattered_ids(route_heads)
    mask = build_route_block_mask(clustered, 384, 4, build_flex=None)
    got = auto_backend(mask, "cuda", dtype=dtype, head_dim=head_dim, capability=capability)
    assert got == expected


def test_flex_kernel_options_tile_the_route_blocks_as_flex_requires():
    """Flex needs its BlockMask block (128) to be a multiple of the kernel tiles, and the backward
    needs BLOCK_N1 % BLOCK_M1 == BLOCK_M2 % BLOCK_N2 == 0; wide heads, FP32 and CPU keep defaults."""
    for head_dim in (64, 96, 128, 160, 192):
        options = flex_kernel_options(head_dim, torch.bfloat16, "cuda")
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"):
            assert TILE % options[name] == 0, name
        assert options["BLOCK_N1"] % options["BLOCK_M1"] == 0
        assert options["BLOCK_M2"] % options["BLOCK_N2"] == 0
        # The forward's 16-bit Q tile and staged K/V tiles fit sm_90's shared memory (Flex pads
        # the head dim to a power of two).
        tiles = options["BLOCK_M"] + 2 * options["num_stages"] * options["BLOCK_N"]
        padded = 1 << (head_dim - 1).bit_length()
        assert 2 * tiles * padded <= 232_448
    assert flex_kernel_options(192, torch.bfloat16, "cuda")["BLOCK_N1"] == 64  # 128 overflows
    assert flex_kernel_options(256, torch.bfloat16, "cuda") is None
    assert flex_kernel_options(128, torch.bfloat16, "cuda", bitmap_mask=False) is None
    mid = flex_kernel_options(192, torch.bfloat16, "cuda")
    assert flex_kernel_options(192, torch.bfloat16, "cuda", bitmap_mask=False) == mid
    assert flex_kernel_options(128, torch.float32, "cuda") is None
    assert flex_kernel_options(128, torch.bfloat16, "cpu") is None
    assert flex_kernel_options(128, torch.bfloat16, "cuda", capability=(8, 0)) is None


def test_auto_on_cpu_runs_the_reference():
    q, k, v, gen = _inputs(1, 5, 2, 1, 8, 9, torch.float64)
    ids = _random_ids((1, 5, 4), 9, gen)
    torch.testing.assert_close(
        sparse_gqa_attention(q, k, v, ids), sparse_gqa_attention_reference(q, k, v, ids)
    )


def test_cpu_backends_that_need_cuda_raise():
    q, k, v, gen = _inputs(1, 4, 2, 1, 8, 9, torch.float32)
    ids = _random_ids((1, 4, 3), 9, gen)
    with pytest.raises(RuntimeError, match="backend='flex' needs CUDA"):
        sparse_gqa_attention(q, k, v, ids, backend="flex")
    with pytest.raises(TypeError, match="backend='fa4' takes bfloat16 or float16"):
        sparse_gqa_attention(q, k, v, ids, backend="fa4")
    with pytest.raises(RuntimeError, match="backend='fa4' cannot run"):
        sparse_gqa_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), ids, backend="fa4")


@pytest.mark.parametrize("per_group", [False, True], ids=["shared-route", "route-per-group"])
@pytest.mark.parametrize(("queries", "kv_length"), [(300, 300), (257, 385), (128, 640)])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fa4_tiles_with_a_causal_mask_encode_exact_membership(
    queries, kv_length, head_dim, per_group
):
    """FA4 applies its causal mask (query i at key i + kv_length − queries) on every listed tile: full
    tiles plus causally masked partial tiles must equal the routes; backward lists are the transpose."""
    route_heads = 2 if per_group else 1
    gen = torch.Generator().manual_seed(5)
    ids = clustered_routes(1, route_heads, queries, kv_length, tiles_per_query=3, generator=gen)
    ids = ids if per_group else ids[:, 0]
    mask = build_route_block_mask(ids, kv_length, 4)
    assert fa4_route_issue(mask, head_dim) is None
    tiles = fa4_tiles(mask, head_dim)
    q_tile, key_tile = tiles.block_size
    assert (q_tile, key_tile) == (128, 128 if head_dim == 128 else 64)
    assert fa4_tiles(mask, head_dim) is tiles  # cached on the mask

    def dense(num, idx, rows, cols):
        live = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
        out = torch.zeros(*idx.shape[:-1], cols + 1, dtype=torch.bool)
        out.scatter_(-1, torch.where(live, idx.long(), cols), True)
        return out[..., :cols].repeat_interleave(rows, -2).repeat_interleave(key_tile, -1)

    full = dense(*tiles.forward[2:], q_tile, -(-kv_length // key_tile))[..., :queries, :kv_length]
    partial = dense(*tiles.forward[:2], q_tile, -(-kv_length // key_tile))[
        ..., :queries, :kv_length
    ]
    assert not (full & partial).any()
    causal = torch.arange(kv_length) <= (torch.arange(queries) + kv_length - queries)[:, None]
    membership = full | (partial & causal)
    assert torch.equal(membership, dense_route_mask(ids, kv_length, 4 if per_group else 1))
    for forward, backward in (
        (tiles.forward[:2], tiles.backward[:2]),
        (tiles.forward[2:], tiles.backward[2:]),
    ):
        k_tiles = -(-kv_length // key_tile)
        q_tiles = -(-queries // q_tile)
        fwd = dense(*forward, 1, k_tiles)[..., ::key_tile]
        bwd = dense(*backward, 1, q_tiles)[..., ::key_tile]
        assert torch.equal(fwd[..., :k_tiles], bwd.transpose(-1, -2)[..., :k_tiles])


def test_auto_prefers_fa4_where_it_runs_and_flex_for_forward_only_calls_at_head_dim_256(
    monkeypatch,
):
    """The decision alone (no GPU): FA4 made to look usable."""
    import sa_kernels.sparse_gqa as sparse_gqa

    monkeypatch.setattr(sparse_gqa, "fa4_unavailable_reason", lambda device, capability: None)
    gen = torch.Generator().manual_seed(8)
    clustered = clustered_routes(1, 1, 384, 384, tiles_per_query=2, generator=gen)[:, 0]
    causal = build_route_block_mask(clustered, 384, 4)
    bitmap_ids = clustered.clone()
    bitmap_ids[0, -1, -1] = -1  # the last query's own key: no longer an exact causal cut
    bitmap = build_route_block_mask(bitmap_ids, 384, 4)
    assert bitmap.statistics.causal_offset is None and bitmap.occupancy >= FLEX_MIN_OCCUPANCY
    h200 = {"dtype": torch.bfloat16, "capability": (9, 0)}
    choose = lambda mask, **kw: auto_backend(mask, "cuda", **h200, **kw)
    assert choose(causal, head_dim=128) == "fa4"
    assert choose(causal, head_dim=128, requires_grad=False) == "fa4"
    assert choose(causal, head_dim=256) == "fa4"
    assert choose(causal, head_dim=256, requires_grad=False) == "flex"
    assert choose(bitmap, head_dim=128) == "flex"
    assert (
        auto_backend(causal, "cuda", dtype=torch.float32, capability=(9, 0), head_dim=128)
        == "gather"
    )


def _counting(monkeypatch, module, name, calls):
    """Wrap `module.name` so that each call appends `name` to `calls`."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_fa4_attention_asks_no_route_or_install_question_again(monkeypatch):
    """The caller checks once (auto_backend, or the explicit backend's checks); the FA4 call then
    runs: a stand-in flash-attn-4 records the tiles it is handed, and the checks are made to fail."""
    import sys
    import types

    from sa_kernels.sparse_gqa import fa4

    handed = []
    interface = types.ModuleType("flash_attn.cute.interface")
    interface.flash_attn_func = lambda q, k, v, **kw: (handed.append(kw) or q.clone(), None)
    sparsity = types.ModuleType("flash_attn.cute.block_sparsity")
    sparsity.BlockSparseTensorsTorch = lambda *lists, block_size: (lists, block_size)
    for name, module in (
        ("flash_attn", types.ModuleType("flash_attn")),
        ("flash_attn.cute", types.ModuleType("flash_attn.cute")),
        ("flash_attn.cute.interface", interface),
        ("flash_attn.cute.block_sparsity", sparsity),
    ):
        monkeypatch.setitem(sys.modules, name, module)

    def asked_again(*args, **kwargs):
        raise AssertionError("asked again")

    for name in ("fa4_route_issue", "fa4_unavailable_reason", "device_capability"):
        monkeypatch.setattr(fa4, name, asked_again)
    gen = torch.Generator().manual_seed(8)
    ids = clustered_routes(1, 1, 256, 256, tiles_per_query=2, generator=gen)[:, 0]
    mask = build_route_block_mask(ids, 256, 4)
    q, k, v, _ = _inputs(1, 256, 4, 2, 64, 256, torch.bfloat16)
    out = fa4.fa4_attention(q, k, v, mask, 0.125)
    assert torch.equal(out, q) and len(handed) == 1
    assert handed[0]["block_sparse_tensors"][1] == (TILE, TILE) and handed[0]["causal"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "fa4"])
def test_cuda_fa4_path_makes_each_decision_once(monkeypatch, backend):
    """On the auto → fa4 path and on backend='fa4', the routes, the install and the GPU generation
    are each checked once per call."""
    import sa_kernels.sparse_gqa as sparse_gqa
    from sa_kernels.sparse_gqa import fa4

    q, k, v, gen = _inputs(1, 256, 4, 2, 64, 256, torch.bfloat16, "cuda")
    if (reason := fa4_unavailable_reason(q.device)) is not None:
        pytest.skip(reason)
    ids = clustered_routes(1, 1, 256, 256, tiles_per_query=2, generator=gen, device="cuda")[:, 0]
    mask = build_route_block_mask(ids, 256, 4)
    calls = []
    for module in (sparse_gqa, fa4):
        for name in ("fa4_route_issue", "fa4_unavailable_reason", "device_capability"):
            _counting(monkeypatch, module, name, calls)
    assert (
        sparse_gqa.auto_backend(mask, q.device, dtype=q.dtype, head_dim=64, capability=(9, 0))
        == "fa4"
    )
    calls.clear()
    out = sparse_gqa_attention(q, k, v, ids, backend=backend, block_mask=mask)
    assert sorted(calls) == ["device_capability", "fa4_route_issue", "fa4_unavailable_reason"]
    ref = sparse_gqa_attention_reference(q.float(), k.float(), v.float(), ids)
    assert _relative_error(out, ref) < 1e-2


def test_repeated_ids_keep_the_causal_mask_mod():
    """A row that repeats one of its ids (in a padding slot) selects the same keys: the same causal
    offset and FA4 alignment as without the repeat."""
    gen = torch.Generator().manual_seed(9)
    ids = clustered_routes(1, 1, 256, 256, tiles_per_query=2, generator=gen)[:, 0]
    ids[0, 5, -1] = ids[0, 5, 0]  # row 5 repeats one of its ids in a padding slot: same key set
    mask = build_route_block_mask(ids, 256, 2)
    assert mask.statistics.causal_offset == 0
    assert fa4_route_issue(mask, 128) is None


def test_fa4_route_issue_accepts_only_fa4s_causal_alignment():
    """Partial tiles cut at query i + 256 while FA4 cuts at i + 512: refused; a CP shard of whole tiles
    only (no partial tile) lying below FA4's line: accepted."""
    pos = 256 + torch.arange(512).view(-1, 1)
    keys = torch.arange(1024).view(1, -1)
    shard = torch.where(keys <= pos, keys, -1).to(torch.int32).unsqueeze(0)
    mask = build_route_block_mask(shard, 1024, 4)
    assert mask.statistics.causal_offset == 256 and mask.statistics.partial_tiles > 0
    assert "aligned like FA4" in fa4_route_issue(mask, 128)
    whole_tiles = torch.where(keys < (pos // 128) * 128, keys, -1).to(torch.int32).unsqueeze(0)
    mask = build_route_block_mask(whole_tiles, 1024, 4)
    assert mask.statistics.partial_tiles == 0 and mask.statistics.causal_offset < 512
    assert fa4_route_issue(mask, 128) is None
    assert "head_dim" in fa4_route_issue(mask, 36)  # FA4 needs 16-byte rows


def test_fa4_route_issue_names_what_does_not_fit():
    gen = torch.Generator().manual_seed(6)
    clustered = clustered_routes(1, 1, 256, 256, tiles_per_query=2, generator=gen)[:, 0]
    scattered = scattered_routes(1, 1, 256, 256, block=4, blocks_per_query=8, generator=gen)[:, 0]
    mask = build_route_block_mask(clustered, 256, 2)
    assert "head_dim" in fa4_route_issue(mask, 192)
    assert "no Flex tiles" in fa4_route_issue(
        build_route_block_mask(clustered, 256, 2, build_flex=False), 128
    )
    assert "exact causal cuts" in fa4_route_issue(build_route_block_mask(scattered, 256, 2), 128)
    with pytest.raises(ValueError, match=r"fa4_tiles: .*exact causal cuts"):
        fa4_tiles(build_route_block_mask(scattered, 256, 2), 128)


def test_gather_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, gen = _inputs(1, 4, 2, 1, 8, 9, torch.float32)
    with pytest.raises(RuntimeError, match=r"backend='gather'.*TRITON_INTERPRET=1"):
        sparse_gqa_attention(q, k, v, _random_ids((1, 4, 3), 9, gen), backend="gather")


def _error_cases():
    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 9, 2, 8)
    ids = torch.zeros(1, 4, 3, dtype=torch.int32)
    return [
        pytest.param(
            (q, k, k, ids.float()), {}, TypeError, "token_ids must be int32", id="float-ids"
        ),
        pytest.param(
            (q.bfloat16(), k, k, ids), {}, TypeError, "share one dtype", id="mixed-dtypes"
        ),
        pytest.param((q[0], k, k, ids), {}, ValueError, "query must be 4-D", id="query-3d"),
        pytest.param((q, k[..., :4], k[..., :4], ids), {}, ValueError, "head_dim=8", id="head-dim"),
        pytest.param(
            (torch.randn(1, 4, 3, 8), k, k, ids), {}, ValueError, "multiple of kv heads", id="heads"
        ),
        pytest.param((q, k, k, ids[:, :3]), {}, ValueError, r"\[1, 4, W\]", id="ids-queries"),
        pytest.param(
            (q, k, k, ids.view(1, 1, 4, 3)), {}, ValueError, "kv_heads, queries", id="ids-groups"
        ),
        pytest.param(
            (q, k, k, ids), {"backend": "cudnn"}, ValueError, "backend must be", id="backend"
        ),
        pytest.param(
            (q.double(), k.double(), k.double(), ids),
            {"backend": "gather"},
            TypeError,
            "float64",
            id="gather-f64",
        ),
        pytest.param(
            (q, k, k, ids), {"block_mask": ids}, TypeError, "RouteBlockMask", id="mask-type"
        ),
        pytest.param(
            (q, k, k, ids),
            {
                "block_mask": build_route_block_mask(ids, 10, 4, build_flex=False),
                "backend": "gather",
            },
            ValueError,
            "block_mask was built for",
            id="mask-for-other-kv-length",
        ),
    ]


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), _error_cases())
def test_invalid_inputs_raise_naming_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        sparse_gqa_attention(*args, **kwargs)


def test_build_route_block_mask_errors():
    ids = torch.zeros(1, 4, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="build_route_block_mask: token_ids must be an int32"):
        build_route_block_mask(ids.float(), 8, 2)
    with pytest.raises(ValueError, match="token_ids must be"):
        build_route_block_mask(ids[0], 8, 2)
    with pytest.raises(ValueError, match="multiple of the route heads"):
        build_route_block_mask(ids.view(1, 2, 2, 3), 8, 3)
    with pytest.raises(ValueError, match=r"kv_length must be in \[1, 2\*\*31 - 1\)"):
        build_route_block_mask(ids, 0, 2)
    with pytest.raises(ValueError, match="kv_length must be in"):
        build_route_block_mask(ids, 2**31, 2)
    with pytest.raises(TypeError, match=r"kv_length must be an int; got 8\.0"):
        build_route_block_mask(ids, 8.0, 2)
    with pytest.raises(TypeError, match="query_heads must be an int; got None"):
        build_route_block_mask(ids, 8, None)
    with pytest.raises(TypeError, match="build_flex must be None, True or False"):
        build_route_block_mask(ids, 8, 2, build_flex="no")
    with pytest.raises(ValueError, match="must not be empty"):
        build_route_block_mask(ids[..., :0], 8, 2)


@pytest.mark.parametrize(
    ("scale", "error"),
    [(float("nan"), ValueError), (float("inf"), ValueError), ("0.1", TypeError), (True, TypeError)],
)
def test_softmax_scale_must_be_a_finite_float(scale, error):
    q, k, v, gen = _inputs(1, 4, 2, 1, 8, 6, torch.float32)
    ids = _random_ids((1, 4, 3), 6, gen)
    with pytest.raises(error, match="softmax_scale must be"):
        sparse_gqa_attention(q, k, v, ids, scale)
    want = sparse_gqa_attention(q, k, v, ids, 0.25)
    for same in (np.float32(0.25), torch.tensor(0.25)):  # other spellings of a float still work
        torch.testing.assert_close(sparse_gqa_attention(q, k, v, ids, same), want)


# ---------------------------------------------------------------- CUDA, real sizes


def _relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


GPU_ROUTES = [
    pytest.param("scattered", 64, 4, 128, True, id="scattered-H64/4-D128-per-group"),
    pytest.param("clustered", 64, 4, 128, True, id="clustered-H64/4-D128-per-group"),
    pytest.param("scattered", 24, 2, 256, False, id="scattered-H24/2-D256-shared"),
    pytest.param("clustered", 24, 2, 256, False, id="clustered-H24/2-D256-shared"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "query_heads", "kv_heads", "head_dim", "per_group"), GPU_ROUTES)
def test_cuda_backends_match_oracle_at_8k(kind, query_heads, kv_heads, head_dim, per_group):
    """gather on every route kind, flex (one compile per geometry, with `flex_kernel_options`) on
    clustered routes, shared or per KV group; auto runs flex on clustered, gather on scattered."""
    kv_length = queries = 8192
    q, k, v, gen = _inputs(
        1, queries, query_heads, kv_heads, head_dim, kv_length, torch.bfloat16, "cuda"
    )
    route_heads = kv_heads if per_group else 1
    if kind == "scattered":
        block = 8 if head_dim == 128 else 4
        ids = scattered_routes(
            1,
            route_heads,
            queries,
            kv_length,
            block=block,
            blocks_per_query=2048 // block,
            generator=gen,
            device="cuda",
        )
    else:
        ids = clustered_routes(
            1, route_heads, queries, kv_length, tiles_per_query=16, generator=gen, device="cuda"
        )
    ids = ids if per_group else ids[:, 0]
    mask = build_route_block_mask(ids, kv_length, query_heads)
    grad = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = sparse_gqa_attention_reference(qf, kf, vf, ids, query_chunk=512)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    backends = ["gather", "flex"] if kind == "clustered" else ["gather"]
    fa4_runs = fa4_unavailable_reason(q.device) is None
    if kind == "clustered" and fa4_runs:
        backends.append("fa4")
    results = {}
    for backend in backends:
        out = sparse_gqa_attention(q, k, v, ids, backend=backend, block_mask=mask)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        assert torch.isfinite(out).all(), backend
        assert _relative_error(out, ref) < 1e-2, backend
        for name, got, want in zip("qkv", grads, ref_grads, strict=True):
            assert _relative_error(got, want) < 2e-2, f"{backend} d{name}"
        results[backend] = out
    auto = sparse_gqa_attention(q, k, v, ids, block_mask=mask)
    assert (mask.occupancy > 0.9) if kind == "clustered" else (mask.occupancy < 0.5)
    chosen = ("fa4" if fa4_runs else "flex") if kind == "clustered" else "gather"
    torch.testing.assert_close(auto, results[chosen], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("key_split", [2048, 3000])
def test_cuda_gather_backward_key_passes_match_the_oracle(key_split):
    """The backward's key-range passes (what the default runs beyond 16384 keys at D128) at 8k."""
    q, k, v, gen = _inputs(1, 8192, 16, 2, 128, 8192, torch.bfloat16, "cuda")
    ids = scattered_routes(
        1, 2, 8192, 8192, block=8, blocks_per_query=128, generator=gen, device="cuda"
    )
    mask = build_route_block_mask(ids, 8192, 16, build_flex=False)
    grad = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = sparse_gqa_attention_reference(qf, kf, vf, ids, query_chunk=512)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    args = [t.detach() for t in (q, k, v)]
    scale = 128**-0.5
    out, lse = gather_attention_forward(*args, mask.routes, mask.counts, scale)
    config = {"BLOCK_W": 32, "num_warps": 4, "num_stages": 3, "KEY_SPLIT": key_split}
    grads = gather_attention_backward(
        *args, out, grad, lse, mask.routes, mask.counts, scale, _config=config
    )
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert _relative_error(got, want) < 2e-2, f"d{name}"


@pytest.mark.gpu
def test_cuda_fa4_refuses_routes_its_causal_mask_cannot_serve():
    q, k, v, gen = _inputs(1, 512, 8, 2, 128, 1024, torch.bfloat16, "cuda")
    if (reason := fa4_unavailable_reason(q.device)) is not None:
        pytest.skip(reason)
    scattered = scattered_routes(
        1, 1, 512, 1024, block=4, blocks_per_query=20, generator=gen, device="cuda"
    )
    with pytest.raises(ValueError, match=r"fa4.*exact causal cuts"):
        sparse_gqa_attention(q, k, v, scattered[:, 0], backend="fa4")
    # A shard whose queries sit at keys 256 + i, not FA4's 512 + i: flex serves it, fa4 refuses.
    pos = 256 + torch.arange(512, device="cuda").view(-1, 1)
    causal = torch.arange(1024, device="cuda").view(1, -1).expand(512, -1)
    ids = torch.where(causal <= pos, causal, -1).to(torch.int32).unsqueeze(0)
    with pytest.raises(ValueError, match=r"fa4.*aligned like FA4"):
        sparse_gqa_attention(q, k, v, ids, backend="fa4")
    auto = sparse_gqa_attention(q, k, v, ids, backend="auto")
    ref = sparse_gqa_attention_reference(q.float(), k.float(), v.float(), ids)
    assert _relative_error(auto, ref) < 1e-2  # the backend auto chose serves the shard correctly


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gather", "flex"])
@pytest.mark.parametrize("per_group", [False, True], ids=["shared-route", "route-per-group"])
def test_cuda_empty_rows_give_zero_output_and_gradients(backend, per_group):
    q, k, v, gen = _inputs(1, 300, 8, 2, 64, 500, torch.bfloat16, "cuda")
    ids = _random_ids((1, 2, 300, 33), 500, gen, device="cuda", empty_rows=(0, 7, 299))
    ids = ids if per_group else ids[:, 0]
    out = sparse_gqa_attention(q, k, v, ids, backend=backend)
    dq, dk = torch.autograd.grad(out.float().square().sum(), (q, k))
    assert out[:, [0, 7, 299]].abs().max() == 0 and dq[:, [0, 7, 299]].abs().max() == 0
    assert torch.isfinite(out).all() and torch.isfinite(dk).all()
    ref = sparse_gqa_attention_reference(q.float(), k.float(), v.float(), ids)
    assert _relative_error(out, ref) < 1e-2


@pytest.mark.gpu
def test_cuda_gather_reads_head_offsets_past_int32():
    """Q, K, V and dO as head-major views whose head offsets pass 2**31 elements (a [B, H, S, D]
    tensor at 1M tokens and 64 heads): the same results as contiguous copies."""
    q, k, v, gen = _inputs(1, 512, 4, 4, 64, 1024, torch.bfloat16, "cuda")
    ids = _random_ids((1, 512, 40), 1024, gen, device="cuda")
    grad = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    results = []
    for tensors in ((q, k, v, grad), [spread_copy(t, 2, 2**30 + 64) for t in (q, k, v, grad)]):
        out = sparse_gqa_attention(*tensors[:3], ids, backend="gather")
        results.append((out, *torch.autograd.grad(out, tensors[:3], tensors[3])))
        del tensors, out
    for name, got, want in zip(("out", "dq", "dk", "dv"), results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.gpu
def test_cuda_fp32_gather_is_exact_to_fp32_rounding():
    q, k, v, gen = _inputs(2, 257, 12, 3, 96, 700, torch.float32, "cuda")
    ids = _random_ids((2, 257, 100), 700, gen, device="cuda")
    out = sparse_gqa_attention(q, k, v, ids, backend="gather", softmax_scale=1 / math.sqrt(50))
    ref = sparse_gqa_attention_reference(q.double(), k.double(), v.double(), ids, 1 / math.sqrt(50))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_int64_ids_beyond_int32_are_padding_not_wrapped():
    q, k, v, gen = _inputs(1, 6, 4, 2, 16, 24, torch.float32)
    ids = _random_ids((1, 6, 5), 24, gen).long()
    ids[0, :, 4] = 2**32 + 3  # would wrap to the valid id 3 as int32
    expected = sparse_gqa_attention_reference(q, k, v, ids.clamp(max=24).masked_fill(ids >= 24, -1))
    for backend in ("reference", "gather"):
        torch.testing.assert_close(sparse_gqa_attention(q, k, v, ids, backend=backend), expected)


@pytest.mark.parametrize("backend", ["reference", "gather", "auto"])
@pytest.mark.parametrize(("batch", "queries"), [(1, 0), (0, 4)], ids=["no-queries", "no-batch"])
def test_no_queries_give_an_empty_result_that_backpropagates(backend, batch, queries):
    q, k, v, _ = _inputs(batch, queries, 4, 2, 8, 6, torch.float32)
    ids = torch.zeros(batch, queries, 3, dtype=torch.int64)
    out = sparse_gqa_attention(q, k, v, ids, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("backend", ["reference", "gather", "auto"])
def test_no_keys_channels_or_heads_are_refused_at_the_boundary(backend):
    q, k, v, _ = _inputs(1, 3, 4, 2, 8, 5, torch.float32)
    ids = torch.full((1, 3, 2), -1)
    fn = "sparse_gqa_attention: "
    with pytest.raises(
        ValueError, match=fn + r"key and value must hold at least one key .*\(1, 0, 2, 8\)"
    ):
        sparse_gqa_attention(q, k[:, :0], v[:, :0], ids, backend=backend)
    with pytest.raises(ValueError, match=fn + r"head_dim must be >= 1; got query \(1, 3, 4, 0\)"):
        sparse_gqa_attention(q[..., :0], k[..., :0], v[..., :0], ids, backend=backend)
    with pytest.raises(ValueError, match=fn + r"query heads \(0\) must be a positive multiple"):
        sparse_gqa_attention(q[:, :, :0], k, v, ids, backend=backend)


@pytest.mark.parametrize(
    "scale", [0.0, -0.25, torch.tensor(-1.0)], ids=["zero", "negative", "tensor"]
)
def test_non_positive_softmax_scale_is_refused_like_sparse_mla(scale):
    q, k, v, gen = _inputs(1, 4, 2, 1, 8, 6, torch.float32)
    ids = _random_ids((1, 4, 3), 6, gen)
    for backend in ("reference", "gather"):
        with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
            sparse_gqa_attention(q, k, v, ids, scale, backend=backend)
