"""The FlashMLA + cuDNN wrapping logic, run on CPU with fake kernels that enforce the real kernels' contracts."""

import pytest
import torch
from mla_cases import random_problem

from sa_mla.sparse_mla.canonical import (
    FusedKernels,
    HeadChunk,
    backward_rows,
    canonical_topk,
    forward_head_chunks,
    fused_sparse_mla,
    sink_gradient_from_lse,
)
from sa_mla.sparse_mla.reference import sparse_mla_reference_with_lse, valid_slots


class FakeKernels:
    """Oracle-backed stand-ins for flash_mla_sparse_fwd and the cuDNN DSA backward, asserting their input rules."""

    def __init__(self):
        self.forward_calls = []
        self.backward_calls = []

    def forward(self, q, kv, ids, scale, sink, lengths):
        tokens, heads, _ = q.shape
        assert heads in (64, 128), heads
        assert ids.dtype == torch.int32 and ids.shape[:2] == (tokens, 1) and ids.shape[2] % 512 == 0
        assert lengths.dtype == torch.int32 and lengths.shape == (tokens,)
        assert torch.all((lengths >= 0) & (lengths <= ids.shape[2]))
        assert sink is None or (sink.dtype == torch.float32 and sink.shape == (heads,))
        self.forward_calls.append(dict(q=q, ids=ids, sink=sink, lengths=lengths))
        with torch.no_grad():
            out, lse = sparse_mla_reference_with_lse(q, kv, ids, scale, lengths, sink)
        return out.to(q.dtype), lse.float()

    def backward(self, q, kv, out, dout, lse, sink, ids, scale, lengths):
        rows, heads, _ = q.shape
        assert heads % 16 == 0 and kv.dim() == 2 and ids.dim() == 2 and ids.shape[1] % 512 == 0
        assert sink.shape == (heads,) and out.shape == dout.shape == (rows, heads, 512)
        assert valid_slots(ids.long(), kv.shape[0], lengths).any(dim=-1).all(), (
            "backward got an empty row"
        )
        self.backward_calls.append(dict(q=q, sink=sink, lse=lse, rows=rows))
        q = q.detach().requires_grad_()
        kv = kv.detach()[:, None].requires_grad_()
        with torch.enable_grad():
            ref, ref_lse = sparse_mla_reference_with_lse(q, kv, ids[:, None], scale, lengths, sink)
            real = ~torch.isposinf(lse)  # padded heads carry lse = +inf and zero out/dout
            torch.testing.assert_close(ref.to(out.dtype)[real], out[real])
            torch.testing.assert_close(ref_lse.float()[real], lse[real])
            dq, dkv = torch.autograd.grad(ref, [q, kv], dout)
        return dq, dkv[:, 0]

    def kernels(self):
        return FusedKernels(forward=self.forward, backward=self.backward)


@pytest.mark.parametrize(
    ("heads", "chunks"),
    [
        (1, [HeadChunk(0, 1, 64)]),
        (64, [HeadChunk(0, 64, 64)]),
        (65, [HeadChunk(0, 65, 128)]),
        (128, [HeadChunk(0, 128, 128)]),
        (200, [HeadChunk(0, 128, 128), HeadChunk(128, 200, 128)]),
        (300, [HeadChunk(0, 128, 128), HeadChunk(128, 256, 128), HeadChunk(256, 300, 64)]),
    ],
    ids=lambda v: f"H{v}" if isinstance(v, int) else "",
)
def test_heads_split_into_chunks_padded_to_flashmla_counts(heads, chunks):
    assert list(forward_head_chunks(heads, (64, 128))) == chunks


def test_ids_without_lengths_compact_to_ascending_prefix_padded_to_512():
    ids = torch.tensor([[5, -1, 9, 2, 40, 5, 3], [-1, -1, 77, -2, 50, 50, -1]], dtype=torch.int64)
    out, lengths = canonical_topk(ids, 50, None, 512)
    assert out.dtype == torch.int32 and out.shape == (2, 512)
    assert lengths.tolist() == [6, 0]
    assert out[0, :6].tolist() == [2, 3, 5, 5, 9, 40]
    assert torch.all(out[0, 6:] == -1) and torch.all(out[1] == -1)


def test_ids_with_lengths_pass_through_and_lengths_clamp_to_width():
    ids = torch.randint(-1, 60, (3, 600), dtype=torch.int32)
    out, lengths = canonical_topk(ids, 50, torch.tensor([-4, 100, 700]), 512)
    assert (
        out.shape == (3, 1024) and torch.equal(out[:, :600], ids) and torch.all(out[:, 600:] == -1)
    )
    assert lengths.tolist() == [0, 100, 600] and lengths.dtype == torch.int32


def test_backward_rows_follow_the_callers_promise_or_the_nonempty_mask():
    nonempty = torch.tensor([True, False, True, True])
    assert backward_rows(nonempty, True, None) is None
    assert backward_rows(nonempty, False, None).tolist() == [0, 2, 3]
    assert backward_rows(nonempty, False, torch.tensor([2, 3])).tolist() == [2, 3]
    assert backward_rows(torch.ones(3, dtype=torch.bool), False, None) is None


def test_sink_gradient_formula_matches_autograd_of_the_oracle():
    p = random_problem(9, 3, 512, 20, 11, sink=True, dtype=torch.float64, seed=23)
    out, lse = sparse_mla_reference_with_lse(*p.args(), attn_sink=p.attn_sink)
    dout = torch.randn_like(out)
    (expected,) = torch.autograd.grad(out, [p.attn_sink], dout)
    assert torch.all(torch.isposinf(lse[p.empty_rows]))
    got = sink_gradient_from_lse(p.attn_sink.detach(), lse.detach(), out.detach(), dout)
    torch.testing.assert_close(got, expected)


CASES = [
    pytest.param(
        dict(tokens=7, heads=5, head_dim=576, keys=40, width=21, sink=True), id="H5-D576-W21-sink"
    ),
    pytest.param(dict(tokens=6, heads=64, head_dim=512, keys=33, width=9), id="H64-D512-W9"),
    pytest.param(
        dict(tokens=5, heads=130, head_dim=576, keys=25, width=600, sink=True),
        id="H130-D576-W600-sink",
    ),
    pytest.param(
        dict(tokens=8, heads=20, head_dim=576, keys=30, width=13, lengths=True),
        id="H20-D576-W13-len",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_fused_path_with_fake_kernels_matches_the_oracle(case):
    p = random_problem(**case, dtype=torch.float32, seed=29)
    fake = FakeKernels()
    out, _ = fused_sparse_mla(fake.kernels(), *p.args(), False, None, p.attn_sink)
    inputs = p.grad_inputs()
    expected, _ = sparse_mla_reference_with_lse(*p.args(), attn_sink=p.attn_sink)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[p.empty_rows] == 0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    expected_grads = torch.autograd.grad(expected, inputs, dout)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.all(grads[0][p.empty_rows] == 0)
    # Forward: padded heads are zero queries with -inf sinks; backward ran only on rows with a valid id.
    heads = case["heads"]
    for call, chunk in zip(fake.forward_calls, forward_head_chunks(heads, (64, 128)), strict=True):
        width = chunk.stop - chunk.start
        assert torch.all(call["q"][:, width:] == 0)
        if p.attn_sink is not None:
            assert torch.all(torch.isneginf(call["sink"][width:]))
            torch.testing.assert_close(
                call["sink"][:width], p.attn_sink[chunk.start : chunk.stop].detach()
            )
        if case.get("lengths") is None:
            ids, lengths = call["ids"][:, 0], call["lengths"]
            prefix = torch.arange(ids.shape[1]) < lengths[:, None]
            assert torch.all((ids >= 0) == prefix)
            assert torch.all(
                (ids[:, 1:] >= ids[:, :-1]) | ~prefix[:, 1:]
            )  # ascending within the prefix
    (bwd,) = fake.backward_calls
    nonempty = valid_slots(p.topk_indices[:, 0].long(), case["keys"], p.topk_length).any(dim=-1)
    assert bwd["rows"] == int(nonempty.sum())
    assert bwd["q"].shape[1] == -(-heads // 16) * 16
    assert torch.all(torch.isposinf(bwd["lse"][:, heads:]))


@pytest.mark.parametrize("hint", ["all_rows_nonempty", "valid_row_indices"])
def test_callers_row_promise_skips_the_nonempty_search(hint):
    p = random_problem(6, 4, 512, 30, 10, invalid=False, dtype=torch.float32, seed=31)
    fake = FakeKernels()
    kwargs = dict(all_rows_nonempty=True, valid_row_indices=None)
    if hint == "valid_row_indices":
        kwargs = dict(all_rows_nonempty=False, valid_row_indices=torch.tensor([0, 2, 3, 5]))
    out, _ = fused_sparse_mla(
        fake.kernels(), *p.args(), kwargs["all_rows_nonempty"], kwargs["valid_row_indices"], None
    )
    (dq,) = torch.autograd.grad(out, [p.q], torch.randn_like(out))
    (bwd,) = fake.backward_calls
    assert bwd["rows"] == (6 if hint == "all_rows_nonempty" else 4)
    if hint == "valid_row_indices":
        assert torch.all(dq[[1, 4]] == 0) and torch.all(dq[[0, 2, 3, 5]].abs().sum(dim=(1, 2)) > 0)


def test_all_rows_empty_gives_zero_output_and_no_backward_call():
    p = random_problem(4, 3, 512, 10, 6, dtype=torch.float32, seed=37)
    ids = torch.full_like(p.topk_indices, -1)
    fake = FakeKernels()
    out, _ = fused_sparse_mla(
        fake.kernels(), p.q, p.kv_latent, ids, p.softmax_scale, None, False, None, None
    )
    assert torch.all(out == 0)
    dq, dkv = torch.autograd.grad(out, [p.q, p.kv_latent], torch.randn_like(out))
    assert torch.all(dq == 0) and torch.all(dkv == 0) and not fake.backward_calls
