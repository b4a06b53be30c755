"""sparse_region_attention: the oracle against dense masked attention, the gather kernels (Triton
interpreter on CPU, real sizes on CUDA) and FlexAttention against the oracle, region block masks."""

import itertools

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from sa_kernels.head_split import head_split
from sa_kernels.sparse_region_attention import (
    auto_backend,
    build_region_block_mask,
    sparse_region_attention,
)
from sa_kernels.sparse_region_attention.block_mask import TILE, token_regions
from sa_kernels.sparse_region_attention.reference import sparse_region_attention_reference
from sa_kernels.sparse_region_attention.triton_kernels import (
    default_config,
    region_attention_backward,
    region_attention_forward,
)
from sa_kernels.synthetic import clustered_csa_selection, csa_selection, region_layout
from sa_kernels.testing import spread_copy


def _inputs(batch, queries, heads, groups, head_dim, kv_length, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    q = make(batch, queries, heads, head_dim).to(dtype).requires_grad_()
    k = make(batch, kv_length, groups, head_dim).to(dtype).requires_grad_()
    v = make(batch, kv_length, groups, head_dim).to(dtype).requires_grad_()
    return q, k, v, gen


def _documents(batch, kv_length, gen):
    """Per batch row two or three documents of random lengths, then 0–4 padding tokens."""
    rows = []
    for _ in range(batch):
        used = kv_length - int(torch.randint(0, 5, (), generator=gen))
        cuts = torch.randperm(used - 1, generator=gen)[
            : int(torch.randint(1, 3, (), generator=gen))
        ]
        edges = [0, *sorted((cuts + 1).tolist()), used]
        rows.append([b - a for a, b in itertools.pairwise(edges)])
    return rows


def _random_ids(owners, regions, groups, queries, query_start, width, gen, empty_rows=()):
    """Random region ids in [-2, regions + 3) (regions of any document, unused slots of both
    signs), unsorted, with a repeat in every row and the query's own region (partly in its future)
    in one slot; `empty_rows` select nothing."""
    batch = owners.shape[0]
    shape = (batch, groups, queries, width)
    ids = torch.randint(-2, regions + 3, shape, generator=gen, dtype=torch.int32)
    ids[..., 1] = ids[..., 0]
    own = owners[:, query_start : query_start + queries].view(batch, 1, queries)
    ids[..., 2] = torch.where(own >= 0, own, regions).to(torch.int32)
    ids = ids[..., torch.randperm(width, generator=gen)]
    for row in empty_rows:
        ids[..., row, :] = torch.tensor([-1, regions, regions + 7] * width)[:width]
    return ids


def _case(batch, queries, kv_length, region_size, groups, width, query_start, seed, empty=()):
    gen = torch.Generator().manual_seed(seed)
    sources, owners, _ = region_layout(_documents(batch, kv_length, gen), kv_length, region_size)
    ids = _random_ids(owners, sources.shape[1], groups, queries, query_start, width, gen, empty)
    return ids, sources


def _dense_attention(q, k, v, ids, sources, query_start, scale=None):
    """Independent formula: float64 dense scores under a [B, H, Q, S] membership mask built with
    Python loops over the regions' key rows."""
    batch, queries, heads, head_dim = q.shape
    kv_length, groups = k.shape[1], k.shape[2]
    regions = sources.shape[1]
    owner = torch.full((batch, kv_length), -1, dtype=torch.long)
    for b in range(batch):
        for r in range(regions):
            for row in sources[b, r].tolist():
                if 0 <= row < kv_length:
                    owner[b, row] = r
    mask = torch.zeros(batch, groups, queries, kv_length, dtype=torch.bool)
    for b, g, i in torch.cartesian_prod(
        torch.arange(batch), torch.arange(groups), torch.arange(queries)
    ).tolist():
        chosen = {r for r in ids[b, g, i].tolist() if 0 <= r < regions}
        for row in range(min(kv_length, query_start + i + 1)):
            mask[b, g, i, row] = owner[b, row].item() in chosen
    mask = mask.repeat_interleave(heads // groups, dim=1)
    scale = head_dim**-0.5 if scale is None else scale
    kk = k.double().repeat_interleave(heads // groups, dim=2)
    vv = v.double().repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.double(), kk) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqs,bshd->bqhd", probs, vv)


# ---------------------------------------------------------------- the oracle


@pytest.mark.parametrize(
    (
        "batch",
        "queries",
        "heads",
        "groups",
        "head_dim",
        "kv_length",
        "region_size",
        "width",
        "start",
    ),
    [
        (2, 19, 6, 2, 24, 37, 4, 7, 18),
        (1, 30, 4, 4, 16, 30, 8, 5, 0),
        (2, 7, 3, 1, 40, 50, 3, 9, 43),
    ],
    ids=[
        "B2-Q19-H6/2-D24-S37-R4-start18",
        "B1-Q30-H4/4-D16-S30-R8",
        "B2-Q7-H3/1-D40-S50-R3-start43",
    ],
)
def test_reference_matches_dense_masked_softmax(
    batch, queries, heads, groups, head_dim, kv_length, region_size, width, start
):
    q, k, v, _ = _inputs(batch, queries, heads, groups, head_dim, kv_length, torch.float64)
    ids, sources = _case(batch, queries, kv_length, region_size, groups, width, start, 1, (2,))
    out = sparse_region_attention_reference(q, k, v, ids, sources, start, query_chunk=4)
    want = _dense_attention(q, k, v, ids, sources, start)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert out[:, 2].abs().max() == 0 and out.abs().amax(dim=(0, 2, 3)).count_nonzero() > 1


def test_reference_slot_order_and_repeats_never_change_results():
    q, k, v, gen = _inputs(2, 12, 4, 2, 16, 30, torch.float32)
    ids, sources = _case(2, 12, 30, 4, 2, 9, 18, 2)
    regions = sources.shape[1]
    shuffled = ids[..., torch.randperm(9, generator=gen)]
    distinct = ids.sort(dim=-1).values
    distinct[..., 1:][distinct[..., 1:] == distinct[..., :-1]] = regions  # repeats -> unused
    want = sparse_region_attention_reference(q, k, v, distinct, sources, 18)
    for other, chunk in ((ids, 256), (shuffled, 5)):
        got = sparse_region_attention_reference(q, k, v, other, sources, 18, query_chunk=chunk)
        torch.testing.assert_close(got, want)


def test_reference_gradcheck_float64_with_empty_row_and_causal_cut():
    q, k, v, _ = _inputs(1, 5, 4, 2, 3, 10, torch.float64)
    ids, sources = _case(1, 5, 10, 3, 2, 4, 5, 3, (3,))
    fn = lambda q, k, v: sparse_region_attention_reference(
        q, k, v, ids, sources, 5, softmax_scale=0.7, query_chunk=3
    )
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_reference_rows_without_visible_keys_give_zero_output_and_zero_gradients():
    q, k, v, _ = _inputs(1, 4, 2, 1, 8, 16, torch.float32)
    sources, _, _ = region_layout([[16]], 16, 4)  # regions 0..3 cover rows 0..15
    ids = torch.tensor([[[[3, 2, 4, -1], [0, 0, 9, -5], [4, 4, 4, 4], [2, 3, 2, 3]]]])
    out = sparse_region_attention_reference(q, k, v, ids, sources, query_start=5)
    # row 0 (global row 5) selects only future regions 2 and 3; row 2 selects nothing valid
    grad_q, grad_k = torch.autograd.grad(out[:, [0, 2]].sum() + 0 * out.sum(), (q, k))
    assert out[:, [0, 2]].abs().max() == 0 and out[:, [1, 3]].abs().min() > 0
    assert grad_q.abs().max() == 0 and grad_k.abs().max() == 0


# ---------------------------------------------------------------- gather kernels (interpreter)


@pytest.mark.parametrize(
    ("head_dim", "split"),
    [(1, (16, 16, False)), (16, (16, 16, False)), (24, (16, 16, True)), (96, (64, 32, True)),
     (192, (128, 64, True)), (200, (128, 128, True)), (256, (256, 16, False))],
)  # fmt: skip
def test_head_split_is_a_power_of_two_and_its_rounded_remainder(head_dim, split):
    assert head_split(head_dim) == split


def test_default_launches_take_32_keys_for_fp32_and_128_for_bf16_at_d192():
    for backward in (False, True):
        assert default_config(256, backward, element_size=4)["BLOCK_W"] == 32
        assert default_config(192, backward, element_size=2)["BLOCK_W"] == 128


GATHER_CASES = [
    pytest.param(2, 6, 4, 2, 24, 40, 4, 6, 34, id="B2-Q6-H4/2-D24-S40-R4-W6-start34"),
    pytest.param(1, 8, 3, 1, 16, 30, 8, 5, 0, id="B1-Q8-H3/1-D16-S30-R8-W5-hpg3"),
    pytest.param(1, 6, 2, 2, 40, 48, 3, 9, 42, id="B1-Q6-H2/2-D40-S48-R3-W9-hpg1"),
    # 192 = 128 + 64: a lo tile wider than 16, and the 128-key dQ launch of the default
    pytest.param(1, 3, 2, 1, 192, 24, 4, 4, 21, id="B1-Q3-H2/1-D192-S24-R4-W4-start21"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    (
        "batch",
        "queries",
        "heads",
        "groups",
        "head_dim",
        "kv_length",
        "region_size",
        "width",
        "start",
    ),
    GATHER_CASES,
)
def test_gather_matches_reference_forward_and_backward(
    batch, queries, heads, groups, head_dim, kv_length, region_size, width, start, dtype
):
    q, k, v, gen = _inputs(batch, queries, heads, groups, head_dim, kv_length, dtype, seed=width)
    ids, sources = _case(batch, queries, kv_length, region_size, groups, width, start, width, (1,))
    scale = 0.3 if groups > 1 else None
    out = sparse_region_attention(
        q, k, v, ids, sources, query_start=start, softmax_scale=scale, backend="gather"
    )
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = sparse_region_attention_reference(
        q.double(), k.double(), v.double(), ids, sources, start, scale
    )
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad.double())
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    torch.testing.assert_close(out.double(), ref, **tol)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(
            got.double(), want.double(), **tol, msg=lambda m, n=name: f"d{n}: {m}"
        )
    assert out[:, 1].abs().max() == 0 and grads[0][:, 1].abs().max() == 0
    assert ref.abs().amax(dim=(0, 2, 3)).count_nonzero() > queries // 2  # most rows see keys


@pytest.mark.parametrize(
    ("region_size", "block_w", "key_split", "head_dim"),
    [(20, 16, 0, 16), (4, 16, 8, 24), (20, 16, 40, 48)],
    ids=["R20-two-chunks-one-pass", "R4-passes-of-2-regions-D24", "R20-two-chunks-passes-D48"],
)
def test_gather_long_regions_and_region_passes_match_reference(
    region_size, block_w, key_split, head_dim
):
    """Regions longer than a step (read in BLOCK_RS-row chunks) and the backward's region-range
    passes (dQ summed over passes with atomics), at head dims held whole (16), split with a
    masked remainder (24 = 16 + 16) and split exactly (48 = 32 + 16)."""
    q, k, v, gen = _inputs(1, 6, 4, 2, head_dim, 64, torch.float32, seed=region_size)
    ids, sources = _case(1, 6, 64, region_size, 2, 5, 58, region_size, (3,))
    mask = build_region_block_mask(ids, sources, 64, 4, query_start=58, build_flex=False)
    args = [t.detach() for t in (q, k, v)]
    forward = {"BLOCK_W": block_w, "num_warps": 4, "num_stages": 1}
    backward = {**forward, "KEY_SPLIT": key_split}
    out, lse = region_attention_forward(
        *args, mask.routes, mask.counts, sources, 58, 0.25, _config=forward
    )
    grad = torch.randn(out.shape, generator=gen)
    grads = region_attention_backward(
        *args, out, grad, lse, mask.routes, mask.counts, sources, 58, 0.25, _config=backward
    )
    ref = sparse_region_attention_reference(q, k, v, ids, sources, 58, 0.25)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(
            got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}"
        )
    assert torch.isinf(lse[:, :, 3]).all() and torch.isfinite(lse[:, :, :2]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("batch", "heads", "groups", "region_size", "chunk", "head_dim"),
    [(1, 4, 2, 4, 2, 16), (2, 3, 1, 8, 3, 48), (1, 6, 2, 16, None, 40), (2, 2, 2, 3, 1, 16)],
    ids=[
        "hpg2-R4-chunk2",
        "B2-hpg3-R8-chunk3-D48",
        "hpg3-R16-one-chunk-D40",
        "B2-hpg1-R3-chunk1",
    ],
)
def test_key_major_dkdv_matches_reference(
    batch, heads, groups, region_size, chunk, head_dim, dtype
):
    """The key-major dK/dV (inverse routes, per-region programs over query chunks) and the dQ-only
    query-major launch beside it, on documents, an empty row, the causal cut and a CP offset; head
    dims whole (16) and split (48 = 32 + 16, 40 = 32 + 16 with 8 masked columns)."""
    queries, kv_length, start = 7, 64, 57
    q, k, v, gen = _inputs(
        batch, queries, heads, groups, head_dim, kv_length, dtype, seed=region_size
    )
    ids, sources = _case(
        batch, queries, kv_length, region_size, groups, 6, start, region_size, (2,)
    )
    mask = build_region_block_mask(
        ids, sources, kv_length, heads, query_start=start, build_flex=False
    )
    args = [t.detach() for t in (q, k, v)]
    out, lse = region_attention_forward(*args, mask.routes, mask.counts, sources, start, 0.25)
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    config = {
        "BLOCK_W": 16,
        "num_warps": 4,
        "num_stages": 1,
        "DKV": "key_major",
        "QUERY_CHUNK": chunk,
    }
    grads = region_attention_backward(
        *args, out, grad, lse, mask.routes, mask.counts, sources, start, 0.25, _config=config
    )
    ref = sparse_region_attention_reference(
        q.double(), k.double(), v.double(), ids, sources, start, 0.25
    )
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad.double())
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(
            got.double(), want.double(), **tol, msg=lambda m, n=name: f"d{n}: {m}"
        )
    assert grads[1].abs().amax(dim=(0, 2, 3)).count_nonzero() > kv_length // 4  # many keys hit
    assert grads[0][:, 2].abs().max() == 0  # the empty row


def test_inverse_routes_lists_every_selection_once():
    from sa_kernels.sparse_region_attention.key_major import inverse_routes

    gen = torch.Generator().manual_seed(3)
    batch, groups, queries, regions, chunk = 2, 3, 9, 11, 4
    keep = torch.rand(batch, groups, queries, regions, generator=gen) < 0.4
    counts = keep.sum(-1).to(torch.int32)
    order = torch.where(keep, torch.arange(regions), regions).sort(-1).values
    routes = order[..., :6].to(torch.int32).contiguous()  # canonical, sentinel `regions`
    counts = counts.clamp(max=6)
    routes[1, 2, 3, 0] = regions + 5  # out of range inside the count: skipped
    counts[1, 2, 3] = counts[1, 2, 3].clamp(min=1)
    ends, selections = inverse_routes(routes, counts, regions, chunk)
    chunks = -(-queries // chunk)
    assert ends.shape == (batch * groups * chunks * regions,)
    assert int(ends[-1]) == int(counts.sum()) - 1
    for b, g, c, r in itertools.product(range(batch), range(groups), range(chunks), range(regions)):
        seg = ((b * groups + g) * chunks + c) * regions + r
        start = int(ends[seg - 1]) if seg else 0
        got = sorted(selections[start : ends[seg]].tolist())
        want = [
            qi
            for qi in range(c * chunk, min(queries, (c + 1) * chunk))
            if r in routes[b, g, qi, : counts[b, g, qi]].tolist()
        ]
        assert got == want, (b, g, c, r)


def test_gather_reuses_a_prebuilt_block_mask_and_accepts_strided_views():
    q, k, v, gen = _inputs(1, 5, 4, 2, 16, 24, torch.float32)
    ids, sources = _case(1, 5, 24, 4, 2, 4, 19, 5)
    mask = build_region_block_mask(ids, sources, 24, 4, query_start=19, build_flex=False)
    padded = torch.zeros(1, 5, 4, 20)
    padded[..., :16] = q.detach()
    strided_q = padded[..., :16]  # rows of stride 20: a view, not contiguous
    got = sparse_region_attention(
        strided_q, k, v, ids, sources, query_start=19, backend="gather", block_mask=mask
    )
    want = sparse_region_attention_reference(q, k, v, ids, sources, 19)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    assert mask.flex is None and mask.statistics is None


# ---------------------------------------------------------------- block masks and Flex (CPU)


def _dense_visible(ids, sources, kv_length, query_start, heads):
    groups, queries = ids.shape[1], ids.shape[2]
    owner = token_regions(sources, kv_length).long()  # [B, S]
    regions = sources.shape[1]
    selected = torch.zeros(*ids.shape[:3], regions + 1, dtype=torch.bool)
    selected.scatter_(-1, torch.where((ids >= 0) & (ids < regions), ids, regions).long(), True)
    index = torch.where(owner >= 0, owner, regions).view(-1, 1, 1, kv_length)
    mask = selected.gather(-1, index.expand(-1, groups, queries, -1))
    rows = query_start + torch.arange(queries).view(-1, 1)
    mask &= torch.arange(kv_length).view(1, -1) <= rows
    return mask.repeat_interleave(heads // groups, dim=1)


def _flex_membership(flex, batch, heads):
    """Dense membership a Flex BlockMask encodes: full tiles, plus partial tiles where mask_mod says so."""
    q_len, kv_len = flex.seq_lengths
    mask_heads = flex.kv_num_blocks.shape[1]

    def tiles(num, idx):
        kv_tiles = idx.shape[-1]
        dense = torch.zeros(batch, mask_heads, idx.shape[-2], kv_tiles + 1, dtype=torch.bool)
        live = torch.arange(kv_tiles) < num.unsqueeze(-1)
        dense.scatter_(-1, torch.where(live, idx.long(), kv_tiles), True)
        dense = dense[..., :kv_tiles].repeat_interleave(TILE, -2).repeat_interleave(TILE, -1)
        return dense[..., :q_len, :kv_len].expand(batch, heads, -1, -1)

    full = tiles(flex.full_kv_num_blocks, flex.full_kv_indices)
    partial = tiles(flex.kv_num_blocks, flex.kv_indices)
    mod = create_mask(flex.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    assert not (full & partial).any()
    return full | (partial & mod), full, mod


@pytest.mark.parametrize(
    ("documents", "topk", "start", "queries"),
    [([[300]], 64, 0, 300), ([[150, 150]], 6, 100, 200), ([[40, 200, 61]], 12, 45, 256)],
    ids=["dense-causal-S300", "csa-two-docs-start100", "csa-three-docs-start45"],
)
def test_region_block_mask_encodes_exactly_the_visible_pairs(documents, topk, start, queries):
    sources, owners, firsts = region_layout(documents, 301, 8)
    gen = torch.Generator().manual_seed(4)
    ids = csa_selection(
        owners, firsts, sources.shape[1], groups=2, topk=topk, query_start=start,
        queries=queries, generator=gen,
    )  # fmt: skip
    mask = build_region_block_mask(ids, sources, 301, 4, query_start=start)
    want = _dense_visible(ids, sources, 301, start, 4)
    got, full, mod = _flex_membership(mask.flex, 1, 4)
    assert torch.equal(got, want)
    assert torch.equal(mod & want, want)  # the mask_mod alone is exact on every pair
    stats = mask.statistics
    assert stats.full_tiles == int(mask.flex.full_kv_num_blocks.sum()) // 2  # per group
    assert stats.selected_pairs >= int(want[:, ::2].sum())
    assert full.any() == (documents == [[300]])  # dense causal rows fill the tiles below


def test_region_block_mask_statistics_of_dense_causal_rows():
    """All rows dense-equivalent: tiles on or below the diagonal are touched, those below full."""
    sources, owners, firsts = region_layout([[300]], 300, 4)
    ids = csa_selection(owners, firsts, sources.shape[1], groups=1, topk=100)
    stats = build_region_block_mask(ids, sources, 300, 2, build_flex=False).statistics
    assert stats is None  # a gather-only build skips the tile products and their host sync
    stats = build_region_block_mask(ids, sources, 300, 2, build_flex=None).statistics
    area = 3 * TILE * TILE + 2 * TILE * 44 + 44 * 44
    assert (stats.touched_tiles, stats.full_tiles, stats.touched_area) == (6, 3, area)
    assert stats.selected_pairs == 75 * 4 * (4 + 300) // 2  # whole regions, current included
    assert stats.occupancy == pytest.approx(stats.selected_pairs / area)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "two-groups"])
def test_eager_flex_over_region_block_mask_matches_oracle(groups):
    """The Flex call path (layout, GQA, BlockMask) with torch's eager flex_attention on CPU
    (forward only: Flex has no CPU backward; the gpu tests check gradients)."""
    from torch.nn.attention.flex_attention import flex_attention

    from sa_kernels.sparse_gqa.flex import flex_attend

    q, k, v, gen = _inputs(1, 200, 4, groups, 16, 290, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    sources, owners, firsts = region_layout([[100, 186]], 290, 8)
    ids = csa_selection(
        owners, firsts, sources.shape[1], groups=groups, topk=5, query_start=90, queries=200,
        generator=gen,
    )  # fmt: skip
    ids[..., 7, :] = sources.shape[1]  # a row with no region
    mask = build_region_block_mask(ids, sources, 290, 4, query_start=90)
    out = flex_attend(flex_attention, q, k, v, mask.flex, 0.3)
    ref = sparse_region_attention_reference(q, k, v, ids, sources, 90, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out[:, 7].abs().max() == 0


def test_auto_picks_flex_for_clustered_rows_and_gather_for_scattered_ones():
    sources, owners, firsts = region_layout([[300]], 300, 4)
    dense = csa_selection(owners, firsts, sources.shape[1], groups=2, topk=100)
    scattered = csa_selection(
        owners,
        firsts,
        sources.shape[1],
        groups=2,
        topk=3,
        generator=torch.Generator().manual_seed(0),
    )
    clustered = build_region_block_mask(dense, sources, 300, 4, build_flex=None)
    sparse = build_region_block_mask(scattered, sources, 300, 4, build_flex=None)
    assert clustered.occupancy >= 0.5 > sparse.occupancy and sparse.flex is None
    choose = lambda mask, **kw: auto_backend(
        mask, "cuda", **{"dtype": torch.bfloat16, "head_dim": 192, "capability": (9, 0), **kw}
    )
    assert choose(clustered) == "flex" and choose(sparse) == "gather"
    assert choose(clustered, dtype=torch.float32) == "gather"
    assert choose(clustered, capability=(8, 0)) == "gather"
    assert auto_backend(clustered, "cpu", dtype=torch.bfloat16, head_dim=192) == "reference"


def test_clustered_selection_shares_whole_runs_per_query_tile():
    """Clustered rows: causal, in the query's document, at most topk earlier regions plus the own
    one; sparse rows hold whole runs that every query of the tile with the same own run shares."""
    documents = [[1000, 700], [1500]]
    sources, owners, firsts = region_layout(documents, 1700, 8)
    regions = sources.shape[1]
    gen = torch.Generator().manual_seed(3)
    ids = clustered_csa_selection(
        owners, firsts, regions, groups=2, topk=32, query_start=100, queries=1600, generator=gen
    )
    assert ids.shape == (2, 2, 1600, 33) and ids.dtype == torch.int32
    assert (ids[..., 1:] >= ids[..., :-1]).all()
    own = owners[:, 100:].view(2, 1, -1, 1)
    first = firsts[:, 100:].view(2, 1, -1, 1)
    valid = ids < regions
    assert ((ids >= first) & (ids <= own) | ~valid).all()  # causal, same document
    assert ((ids == own) & valid).any(-1)[own.squeeze(-1).expand(-1, 2, -1) >= 0].all()
    assert (valid.sum(-1) <= 33).all() and (~valid[1, :, 1500 - 100 :]).all()  # padding: none
    earlier = (own - first).squeeze(-1)
    dense = (earlier <= 32) & (own.squeeze(-1) >= 0)
    want_dense = torch.where(dense, earlier + 1, 0).expand(-1, 2, -1)
    assert torch.equal(torch.where(dense, valid.sum(-1), 0), want_dense)
    run = (ids - first).div(16, rounding_mode="floor")
    own_run = (earlier // 16).unsqueeze(-1)
    history = valid & (run < own_run) & ~dense.unsqueeze(-1)
    sparse = ~dense & (own.squeeze(-1) >= 0)
    assert torch.equal(history.sum(-1), torch.where(sparse, 32 - 16, 0).expand(-1, 2, -1))
    # rows of one tile with the same document and own run select the same runs
    rows = torch.arange(100, 1700)
    for b, g, tile in ((0, 0, 12), (0, 1, 13), (1, 0, 10)):
        mask = (rows // 128 == tile) & ~dense[b, 0]
        keys = (first[b, 0, :, 0], own_run[b, 0, :, 0])
        for doc, r in {(int(keys[0][i]), int(keys[1][i])) for i in mask.nonzero().view(-1)}:
            same = mask & (keys[0] == doc) & (keys[1] == r)
            picked = torch.where(history[b, g, same], ids[b, g, same], regions)
            assert same.sum() > 1 and (picked == picked[:1]).all()
    # one document starting on a tile edge: the runs are whole 128-key tiles, so Flex's tiles fill
    sources, owners, firsts = region_layout([[4096]], 4096, 8)
    occupancy = {}
    for name, select in (("clustered", clustered_csa_selection), ("scattered", csa_selection)):
        ids = select(owners, firsts, sources.shape[1], groups=1, topk=64, generator=gen)
        stats = build_region_block_mask(ids, sources, 4096, 2, build_flex=None).statistics
        occupancy[name] = stats.occupancy
    assert occupancy["clustered"] >= 0.8 and occupancy["scattered"] < 0.5


def test_clustered_selection_refuses_runs_larger_than_half_the_budget():
    sources, owners, firsts = region_layout([[64]], 64, 8)
    with pytest.raises(ValueError, match="clustered_csa_selection: needs run >= 1 and topk >= 2"):
        clustered_csa_selection(owners, firsts, 8, groups=1, topk=16, run=16)


def test_auto_on_cpu_runs_the_reference():
    q, k, v, _ = _inputs(1, 6, 4, 2, 8, 20, torch.float32)
    ids, sources = _case(1, 6, 20, 4, 2, 3, 14, 6)
    want = sparse_region_attention_reference(q, k, v, ids, sources, 14)
    torch.testing.assert_close(sparse_region_attention(q, k, v, ids, sources, query_start=14), want)


# ---------------------------------------------------------------- errors


def _error_cases():
    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 9, 2, 8)
    ids = torch.zeros(1, 2, 4, 3, dtype=torch.int32)
    src = torch.zeros(1, 3, 4, dtype=torch.int32)
    mask = build_region_block_mask(ids, src, 9, 4, query_start=1, build_flex=False)
    return [
        pytest.param((q, k, k, ids.float(), src), {}, TypeError, "region_ids must be int32", id="float-ids"),
        pytest.param((q, k, k, ids, src.long()), {}, TypeError, "region_sources must be int32", id="int64-sources"),
        pytest.param((q.bfloat16(), k, k, ids, src), {}, TypeError, "share one dtype", id="mixed-dtypes"),
        pytest.param((q[0], k, k, ids, src), {}, ValueError, "query must be 4-D", id="query-3d"),
        pytest.param((q, k[..., :4], k[..., :4], ids, src), {}, ValueError, "head_dim=8", id="head-dim"),
        pytest.param((torch.randn(1, 4, 3, 8), k, k, ids, src), {}, ValueError, "multiple of kv_groups", id="heads"),
        pytest.param((q, k, k, ids[:, :, :3], src), {}, ValueError, r"region_ids must be \[batch, kv_groups, queries, slots\] = \[1, 2, 4", id="ids-queries"),
        pytest.param((q, k, k, ids[..., :0], src), {}, ValueError, "at least one slot", id="ids-no-slots"),
        pytest.param((q, k, k, ids, src[0]), {}, ValueError, "region_sources must be", id="sources-2d"),
        pytest.param((q, k, k, ids, src), {"backend": "cudnn"}, ValueError, "backend must be one of", id="backend"),
        pytest.param((q, k, k, ids, src), {"query_start": 6}, ValueError, r"query_start must be in \[0, kv_length - queries\] = \[0, 5\]", id="start-past-keys"),
        pytest.param((q, k, k, ids, src), {"query_start": -1}, ValueError, "query_start must be in", id="start-negative"),
        pytest.param((q, k, k, ids, src), {"query_start": 1.0}, TypeError, "query_start must be an int", id="start-float"),
        pytest.param((q, k, k, ids, src), {"softmax_scale": 0.0}, ValueError, "finite and > 0", id="scale-zero"),
        pytest.param((q, k, k, ids, src), {"softmax_scale": -0.5}, ValueError, "finite and > 0", id="scale-negative"),
        pytest.param((q, k, k, ids, src), {"softmax_scale": float("nan")}, ValueError, "finite and > 0", id="scale-nan"),
        pytest.param((q, k, k, ids, src), {"softmax_scale": float("inf")}, ValueError, "finite and > 0", id="scale-inf"),
        pytest.param((q, k, k, ids, src), {"softmax_scale": "0.1"}, TypeError, "softmax_scale must be None or a float", id="scale-str"),
        pytest.param((q.double(), k.double(), k.double(), ids, src), {"backend": "gather"}, TypeError, "float64", id="gather-f64"),
        pytest.param((q, k, k, ids, src), {"block_mask": ids}, TypeError, "RegionBlockMask", id="mask-type"),
        pytest.param((q, k, k, ids, src), {"block_mask": mask, "backend": "gather"}, ValueError, "block_mask was built for", id="mask-for-other-start"),
        pytest.param((q, k, k, ids, src), {"backend": "fa4"}, RuntimeError, "not wired for region routes", id="fa4"),
        pytest.param((q, k, k, ids, src), {"backend": "flex"}, RuntimeError, "backend='flex' needs CUDA", id="flex-on-cpu"),
        pytest.param((torch.randn(1, 4, 2, 264), torch.randn(1, 9, 1, 264), torch.randn(1, 9, 1, 264), ids[:, :1], src), {"backend": "gather"}, ValueError, "head_dim <= 256", id="gather-head-dim-264"),
    ]  # fmt: skip


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), _error_cases())
def test_invalid_inputs_raise_naming_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=f"sparse_region_attention: .*{match}"):
        sparse_region_attention(*args, **kwargs)


def test_build_region_block_mask_errors():
    ids = torch.zeros(1, 2, 4, 3, dtype=torch.int32)
    src = torch.zeros(1, 3, 4, dtype=torch.int32)
    build = build_region_block_mask
    with pytest.raises(TypeError, match="build_region_block_mask: region_ids must be an int32"):
        build(ids.float(), src, 8, 2)
    with pytest.raises(
        TypeError, match=r"region_sources must be an int32 tensor; got torch\.int64"
    ):
        build(ids, src.long(), 8, 2)
    with pytest.raises(ValueError, match=r"region_ids must be \[batch, groups, queries, slots\]"):
        build(ids[0], src, 8, 2)
    with pytest.raises(ValueError, match="region_sources must be"):
        build(ids, src[:, :0], 8, 2)
    with pytest.raises(ValueError, match=r"multiple of the groups \(2\); got 3"):
        build(ids, src, 8, 3)
    with pytest.raises(ValueError, match=r"kv_length must be in \[1, 2\*\*31 - 1\)"):
        build(ids, src, 0, 2)
    with pytest.raises(ValueError, match=r"query_start must be in \[0, kv_length - queries\]"):
        build(ids, src, 8, 2, query_start=5)
    with pytest.raises(TypeError, match=r"kv_length must be an int; got 8\.0"):
        build(ids, src, 8.0, 2)
    with pytest.raises(TypeError, match="build_flex must be None, True or False"):
        build(ids, src, 8, 2, build_flex="no")


def test_gather_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _ = _inputs(1, 4, 2, 1, 8, 9, torch.float32)
    ids, sources = _case(1, 4, 9, 4, 1, 3, 5, 0)
    with pytest.raises(RuntimeError, match=r"backend='gather'.*TRITON_INTERPRET=1"):
        sparse_region_attention(q, k, v, ids, sources, query_start=5, backend="gather")


def test_softmax_scale_accepts_other_spellings_of_a_float():
    q, k, v, _ = _inputs(1, 4, 2, 1, 8, 9, torch.float32)
    ids, sources = _case(1, 4, 9, 4, 1, 3, 5, 0)
    want = sparse_region_attention(q, k, v, ids, sources, query_start=5, softmax_scale=0.25)
    for same in (np.float32(0.25), torch.tensor(0.25)):
        got = sparse_region_attention(q, k, v, ids, sources, query_start=5, softmax_scale=same)
        torch.testing.assert_close(got, want)
    assert not torch.allclose(sparse_region_attention(q, k, v, ids, sources, query_start=5), want)


# ---------------------------------------------------------------- CUDA, real sizes


def _relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _cuda_case(kind, kv_length, groups, query_start, seed):
    """Region routes on CUDA: 'csa' (documents longer than topk regions: sparse rows of random
    earlier regions plus the own one) or 'dense-docs' (short documents: dense causal rows)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "csa":
        documents, topk = [[kv_length - 1000, 994]], 64
    else:
        documents, topk = [[512] * (kv_length // 512 - 1) + [506]], 64
    sources, owners, firsts = region_layout(documents, kv_length, 8, device="cuda")
    ids = csa_selection(
        owners, firsts, sources.shape[1], groups=groups, topk=topk, query_start=query_start,
        generator=gen,
    )  # fmt: skip
    return ids, sources, gen


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 192], ids=["D128", "D192"])
@pytest.mark.parametrize(
    ("kind", "query_start"),
    [("csa", 0), ("csa", 1536), ("dense-docs", 0)],
    ids=["csa", "csa-cp-shard-start1536", "dense-docs"],
)
def test_cuda_gather_and_flex_match_the_oracle(kind, query_start, head_dim):
    """gather and flex (bf16, fwd+bwd) against the FP32 oracle at 4096 keys, H16/4; auto runs flex
    on dense documents and gather on CSA rows; rows of padding queries give 0."""
    kv_length, heads, groups = 4096, 16, 4
    ids, sources, gen = _cuda_case(kind, kv_length, groups, query_start, 0)
    queries = kv_length - query_start
    q, k, v, gen = _inputs(1, queries, heads, groups, head_dim, kv_length, torch.bfloat16, "cuda")
    grad = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = sparse_region_attention_reference(qf, kf, vf, ids, sources, query_start)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    mask = build_region_block_mask(ids, sources, kv_length, heads, query_start=query_start)
    results = {}
    for backend in ("gather", "flex"):
        out = sparse_region_attention(
            q, k, v, ids, sources, query_start=query_start, backend=backend, block_mask=mask
        )
        grads = torch.autograd.grad(out, (q, k, v), grad)
        assert torch.isfinite(out).all(), backend
        assert _relative_error(out, ref) < 1e-2, backend
        for name, got, want in zip("qkv", grads, ref_grads, strict=True):
            assert _relative_error(got, want) < 2e-2, f"{backend} d{name}"
        padding = slice(kv_length - 6 - query_start, None)  # the layout's padding tail
        assert out[:, padding].abs().max() == 0 and grads[0][:, padding].abs().max() == 0
        results[backend] = out
    auto = sparse_region_attention(q, k, v, ids, sources, query_start=query_start)
    chosen = "flex" if kind == "dense-docs" else "gather"
    assert (mask.occupancy >= 0.5) == (kind == "dense-docs")
    torch.testing.assert_close(auto, results[chosen], rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_compiled_flex_serves_new_routes_without_recompiling():
    kv_length, heads, groups = 2048, 8, 2
    q, k, v, _ = _inputs(1, kv_length, heads, groups, 128, kv_length, torch.bfloat16, "cuda")
    for seed in range(2):
        ids, sources, _ = _cuda_case("csa", kv_length, groups, 0, seed)
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            out = sparse_region_attention(q, k, v, ids, sources, backend="flex")
        ref = sparse_region_attention_reference(q.float(), k.float(), v.float(), ids, sources)
        assert _relative_error(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant",
    [
        {"KEY_SPLIT": 256},
        {"KEY_SPLIT": 1000},
        {"DKV": "key_major"},
        {"DKV": "key_major", "QUERY_CHUNK": 512},
    ],
    ids=["passes-256", "passes-1000", "key-major", "key-major-chunk512"],
)
def test_cuda_gather_backward_variants_match_the_oracle(variant):
    kv_length, heads, groups = 4096, 16, 2
    ids, sources, _ = _cuda_case("csa", kv_length, groups, 0, 1)
    q, k, v, gen = _inputs(1, kv_length, heads, groups, 192, kv_length, torch.bfloat16, "cuda")
    mask = build_region_block_mask(ids, sources, kv_length, heads, build_flex=False)
    grad = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = sparse_region_attention_reference(qf, kf, vf, ids, sources)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    args = [t.detach() for t in (q, k, v)]
    scale = 192**-0.5
    out, lse = region_attention_forward(*args, mask.routes, mask.counts, sources, 0, scale)
    config = {"BLOCK_W": 32, "num_warps": 4, "num_stages": 3, **variant}
    grads = region_attention_backward(
        *args, out, grad, lse, mask.routes, mask.counts, sources, 0, scale, _config=config
    )
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert _relative_error(got, want) < 2e-2, f"d{name}"


@pytest.mark.gpu
@pytest.mark.parametrize("dkv", ["key_major", "atomic"])
def test_cuda_gather_reads_head_offsets_past_int32(dkv):
    """Q, K, V and dO as head-major views whose head offsets pass 2**31 elements (what a [B, H, S,
    D] tensor at 1M tokens and 64 heads gives): the same results as contiguous copies."""
    kv_length, heads, groups = 2048, 4, 4
    ids, sources, _ = _cuda_case("csa", kv_length, groups, 1024, 5)
    q, k, v, gen = _inputs(1, 1024, heads, groups, 64, kv_length, torch.bfloat16, "cuda")
    grad = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    mask = build_region_block_mask(ids, sources, kv_length, heads, query_start=1024)
    config = {**default_config(64, True), "DKV": dkv}
    results = []
    for tensors in ((q, k, v, grad), [spread_copy(t, 2, 2**30 + 64) for t in (q, k, v, grad)]):
        args = [t.detach() for t in tensors[:3]]
        out, lse = region_attention_forward(*args, mask.routes, mask.counts, sources, 1024, 0.125)
        grads = region_attention_backward(
            *args, out, tensors[3], lse, mask.routes, mask.counts, sources, 1024, 0.125,
            _config=config,
        )  # fmt: skip
        results.append((out, *grads))
        del tensors, args
    for name, got, want in zip(("out", "dq", "dk", "dv"), results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [96, 256], ids=["D96", "D256"])
def test_cuda_fp32_gather_is_exact_to_fp32_rounding(head_dim):
    """FP32 forward and backward against the float64 oracle; at D 256 the default launches must
    also fit an SM90 block's shared memory."""
    ids, sources, _ = _cuda_case("csa", 2048, 3, 1024, 2)
    q, k, v, gen = _inputs(2, 1024, 12, 3, head_dim, 2048, torch.float32, "cuda")
    ids, sources = ids.expand(2, -1, -1, -1), sources.expand(2, -1, -1)
    grad = torch.randn(q.shape, generator=gen, device="cuda")
    out = sparse_region_attention(q, k, v, ids, sources, query_start=1024, backend="gather")
    grads = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sparse_region_attention_reference(q64, k64, v64, ids, sources, 1024)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert _relative_error(got.double(), want) < 1e-4, f"d{name}"
