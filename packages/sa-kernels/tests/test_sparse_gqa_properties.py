"""Property tests for sparse_gqa_attention: random geometries and routes (hypothesis, CPU only)."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402

from sa_kernels.sparse_gqa import build_route_block_mask, sparse_gqa_attention  # noqa: E402
from sa_kernels.sparse_gqa.reference import (  # noqa: E402
    dense_route_mask,
    sparse_gqa_attention_reference,
)

geometry = st.fixed_dictionaries(
    {
        "batch": st.integers(1, 2),
        "queries": st.integers(1, 20),
        "kv_heads": st.integers(1, 3),
        "group": st.integers(1, 5),
        "head_dim": st.integers(4, 40),
        "kv_length": st.integers(1, 40),
        "width": st.integers(1, 24),
        "per_group": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


def _case(g, dtype):
    gen = torch.Generator().manual_seed(g["seed"])
    hq = g["kv_heads"] * g["group"]
    q = torch.randn(g["batch"], g["queries"], hq, g["head_dim"], generator=gen).to(dtype)
    k = torch.randn(g["batch"], g["kv_length"], g["kv_heads"], g["head_dim"], generator=gen).to(
        dtype
    )
    v = torch.randn(g["batch"], g["kv_length"], g["kv_heads"], g["head_dim"], generator=gen).to(
        dtype
    )
    lead = (g["batch"], g["kv_heads"]) if g["per_group"] else (g["batch"],)
    ids = torch.randint(-2, g["kv_length"] + 2, (*lead, g["queries"], g["width"]), generator=gen)
    return q, k, v, ids.to(torch.int32)


@settings(max_examples=25, deadline=None)
@given(geometry)
def test_reference_equals_dense_masked_softmax_for_any_routes(g):
    q, k, v, ids = _case(g, torch.float64)
    hq = q.shape[2]
    mask = dense_route_mask(ids, k.shape[1], hq)
    kk = k.repeat_interleave(g["group"], dim=2)
    vv = v.repeat_interleave(g["group"], dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q, kk) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    dense = torch.einsum("bhqs,bshd->bqhd", probs, vv)
    chunk = max(1, g["queries"] // 3)
    out = sparse_gqa_attention_reference(q, k, v, ids, query_chunk=chunk)
    torch.testing.assert_close(out, dense, rtol=1e-12, atol=1e-12)


@settings(max_examples=8, deadline=None)
@given(geometry)
def test_gather_kernels_equal_reference_for_any_routes(g):
    q, k, v, ids = _case(g, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = sparse_gqa_attention(q, k, v, ids, backend="gather")
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = sparse_gqa_attention_reference(q, k, v, ids)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@settings(max_examples=10, deadline=None)
@given(
    st.integers(1, 300),
    st.integers(1, 300),
    st.integers(1, 40),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_route_block_mask_encodes_exact_membership(queries, kv_length, width, per_group, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 2, queries, width) if per_group else (1, queries, width)
    ids = torch.randint(-1, kv_length, shape, generator=gen, dtype=torch.int32)
    if queries >= 128 and kv_length >= 128 and width >= 8:  # some dense rows make full tiles likely
        ids[..., : queries // 2, :] = torch.arange(min(width, kv_length), dtype=torch.int32).repeat(
            width
        )[:width]
    mask = build_route_block_mask(ids, kv_length, 4)
    heads = mask.flex.kv_num_blocks.shape[1]
    mod = create_mask(mask.flex.mask_mod, 1, heads, queries, kv_length, device="cpu")
    assert torch.equal(mod, dense_route_mask(ids, kv_length, 4 if per_group else 1))
