"""The oracle against an independent dense FP64 formulation, its gradients, and its chunking."""

import pytest
import torch
from mla_cases import random_problem

from sa_mla import sparse_mla_reference
from sa_mla.sparse_mla.reference import VALUE_DIM, sparse_mla_reference_with_lse, valid_slots


def dense_masked_reference(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """A second, independent formulation of the oracle: dense FP64 attention over all keys with slot multiplicity.

    Each key's weight is multiplied by how many valid slots name it, then a plain softmax (plus the sink
    column) runs over every key. Differentiable; memory O(tokens * heads * keys), so small inputs only.
    """
    q64 = q.double()
    kv = kv_latent[:, 0].double()
    keys = kv.shape[0]
    ids = topk_indices[:, 0].long()
    valid = valid_slots(ids, keys, topk_length)
    counts = torch.zeros(q.shape[0], keys + 1, dtype=torch.float64, device=q.device)
    counts.scatter_add_(1, torch.where(valid, ids, keys), valid.double())
    counts = counts[:, :keys]  # [T, keys]
    scores = torch.einsum("thd,kd->thk", q64, kv) * softmax_scale
    scores = scores + torch.log(counts)[:, None, :]  # log 0 = -inf masks unnamed keys
    if attn_sink is not None:
        sink = attn_sink.double()[None, :, None].expand(q.shape[0], -1, 1)
        scores = torch.cat([scores, sink], dim=-1)
    nonempty = valid.any(dim=-1)
    safe = torch.where(nonempty[:, None, None], scores, torch.zeros_like(scores))
    probs = torch.softmax(safe, dim=-1)[..., :keys]
    out = torch.einsum("thk,kd->thd", probs, kv[:, :VALUE_DIM])
    return out * nonempty[:, None, None]


CASES = [
    pytest.param(dict(tokens=9, heads=3, head_dim=576, keys=41, width=13), id="T9-H3-D576-W13"),
    pytest.param(
        dict(tokens=6, heads=5, head_dim=512, keys=17, width=30, sink=True),
        id="T6-H5-D512-W30-sink",
    ),
    pytest.param(
        dict(tokens=11, heads=2, head_dim=576, keys=23, width=7, lengths=True),
        id="T11-H2-D576-W7-len",
    ),
    pytest.param(
        dict(tokens=7, heads=4, head_dim=576, keys=29, width=19, sink=True, lengths=True),
        id="T7-H4-D576-W19-sink-len",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_oracle_matches_dense_masked_fp64_forward_and_gradients(case):
    p = random_problem(**case, dtype=torch.float64, seed=3)
    inputs = p.grad_inputs()
    out = sparse_mla_reference(*p.args(), attn_sink=p.attn_sink)
    dense = dense_masked_reference(*p.args(), attn_sink=p.attn_sink)
    torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-12)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    dense_grads = torch.autograd.grad(dense, inputs, dout)
    for got, want in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_rows_without_valid_ids_output_zero_and_get_zero_gradients():
    p = random_problem(8, 3, 512, 19, 9, sink=True, dtype=torch.float64, seed=5)
    assert p.empty_rows.numel() > 0
    out = sparse_mla_reference(*p.args(), attn_sink=p.attn_sink)
    assert torch.all(out[p.empty_rows] == 0)
    assert torch.all(out.abs().sum(dim=(1, 2)).index_fill(0, p.empty_rows, 1.0) > 0)
    (dq,) = torch.autograd.grad(out, [p.q], torch.randn_like(out))
    assert torch.all(dq[p.empty_rows] == 0)


def test_duplicate_ids_count_once_per_slot():
    p = random_problem(
        4, 2, 512, 10, 3, invalid=False, dtype=torch.float64, seed=7, requires_grad=False
    )
    ids = p.topk_indices.clone()
    ids[:, :, 1] = ids[:, :, 0]
    twice = sparse_mla_reference(p.q, p.kv_latent, ids, p.softmax_scale)
    # A key named in two slots weighs as much as two distinct keys with its content.
    keys = torch.cat([p.kv_latent, p.kv_latent[ids[:, 0, 0].long()]])
    split = ids.clone()
    split[:, 0, 1] = torch.arange(p.kv_latent.shape[0], p.kv_latent.shape[0] + 4, dtype=ids.dtype)
    torch.testing.assert_close(twice, sparse_mla_reference(p.q, keys, split, p.softmax_scale))


def test_lse_is_natural_log_without_sink_and_inf_for_empty_rows():
    p = random_problem(
        10, 2, 576, 31, 12, sink=True, dtype=torch.float64, seed=11, requires_grad=False
    )
    _, lse = sparse_mla_reference_with_lse(*p.args(), attn_sink=p.attn_sink)
    _, lse_no_sink = sparse_mla_reference_with_lse(*p.args())
    torch.testing.assert_close(lse, lse_no_sink)
    assert torch.all(torch.isposinf(lse[p.empty_rows]))
    q, kv = p.q[0], p.kv_latent[:, 0]
    ids = p.topk_indices[0, 0].long()
    ids = ids[(ids >= 0) & (ids < kv.shape[0])]
    expected = torch.logsumexp(q @ kv[ids].T * p.softmax_scale, dim=-1)
    torch.testing.assert_close(lse[0], expected)


def test_gradcheck_fp64_with_sink_and_lengths():
    p = random_problem(3, 2, 512, 6, 5, sink=True, lengths=True, dtype=torch.float64, seed=13)

    def fn(q, kv, sink):
        return sparse_mla_reference(
            q, kv, p.topk_indices, p.softmax_scale, p.topk_length, attn_sink=sink
        )

    assert torch.autograd.gradcheck(fn, (p.q, p.kv_latent, p.attn_sink), fast_mode=True)


def test_chunked_queries_match_one_chunk_including_gradients():
    p = random_problem(13, 3, 576, 21, 11, sink=True, dtype=torch.float32, seed=17)
    inputs = [p.q, p.kv_latent, p.attn_sink]
    whole, _ = sparse_mla_reference_with_lse(*p.args(), attn_sink=p.attn_sink)
    tiny = 11 * (576 + 6) * 4 * 2  # two rows per chunk
    chunked, _ = sparse_mla_reference_with_lse(*p.args(), attn_sink=p.attn_sink, chunk_bytes=tiny)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
    dout = torch.randn_like(whole)
    for got, want in zip(
        torch.autograd.grad(chunked, inputs, dout),
        torch.autograd.grad(whole, inputs, dout),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bf16_inputs_use_fp32_math_and_return_bf16():
    p = random_problem(
        5, 4, 576, 33, 16, sink=True, dtype=torch.bfloat16, seed=19, requires_grad=False
    )
    out = sparse_mla_reference(*p.args(), attn_sink=p.attn_sink)
    assert out.dtype == torch.bfloat16
    exact = dense_masked_reference(*p.args(), attn_sink=p.attn_sink)
    torch.testing.assert_close(out.double(), exact, rtol=1e-2, atol=1e-2)
