"""The fused path's wiring on CPU: the public functions hand every argument, in order, through
`cudnn_fused_attention` and `canonical.fused_sparse_mla` to the two runtime calls, which are faked
here with the signatures of FlashMLA's `flash_mla_sparse_fwd` and the cuDNN frontend's
`DSA.sparse_attention_backward_wrapper` (each checks what it is given, then answers with the oracle)."""

import pytest
import torch
from mla_cases import errors_against_oracle, random_problem

from sa_mla import cudnn_sparse_attention, sparse_mla_attention
from sa_mla.sparse_mla import cudnn_flashmla
from sa_mla.sparse_mla.reference import VALUE_DIM, sparse_mla_reference_with_lse, valid_slots


class FakeRuntimes:
    """Stand-ins for the two runtime functions, keyword names as the runtimes define them."""

    def __init__(self, softmax_scale: float, keys: int):
        self.softmax_scale = softmax_scale
        self.keys = keys
        self.forward_calls = 0
        self.backward_calls = 0

    def flash_mla_sparse_fwd(
        self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None
    ):
        tokens, heads, head_dim = q.shape
        assert q.dtype == kv.dtype == torch.bfloat16 and heads in (64, 128)
        assert kv.shape == (self.keys, 1, head_dim) and kv.stride(-1) == 1
        assert indices.dtype == torch.int32 and indices.shape[:2] == (tokens, 1)
        assert indices.shape[2] % 512 == 0
        assert sm_scale == self.softmax_scale and d_v == VALUE_DIM
        assert attn_sink is not None and attn_sink.dtype == torch.float32
        assert attn_sink.shape == (heads,)
        assert topk_length.dtype == torch.int32 and topk_length.shape == (tokens,)
        self.forward_calls += 1
        with torch.no_grad():
            out, lse = sparse_mla_reference_with_lse(
                q, kv, indices, sm_scale, topk_length, attn_sink
            )
        return out, lse.amax(dim=-1, keepdim=True).expand_as(lse), lse

    def sparse_attention_backward_wrapper(
        self, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None
    ):
        rows, heads, head_dim = q.shape
        assert heads % 16 == 0 and kv.shape == (self.keys, head_dim)
        assert out.shape == dout.shape == (rows, heads, VALUE_DIM)
        assert out.dtype == dout.dtype == q.dtype == torch.bfloat16
        assert lse.dtype == torch.float32 and lse.shape == (rows, heads)
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (heads,)
        assert topk_idxs.dtype == torch.int32 and topk_idxs.dim() == 2
        assert topk_idxs.shape[0] == rows and topk_idxs.shape[1] % 512 == 0
        assert softmax_scale == self.softmax_scale
        assert topk_length.dtype == torch.int32 and topk_length.shape == (rows,)
        self.backward_calls += 1
        q = q.detach().float().requires_grad_()
        kv = kv.detach().float()[:, None].requires_grad_()
        with torch.enable_grad():
            ref, ref_lse = sparse_mla_reference_with_lse(
                q, kv, topk_idxs[:, None], softmax_scale, topk_length, attn_sink
            )
            real = ~torch.isposinf(lse)  # padded heads: lse +inf, zero q, out and dout
            torch.testing.assert_close(ref_lse[real], lse[real])
            torch.testing.assert_close(ref.to(out.dtype)[real], out[real])
            dq, dkv = torch.autograd.grad(ref, [q, kv], dout.float())
        return {"dq": dq.to(torch.bfloat16), "dkv": dkv[:, 0].to(torch.bfloat16), "d_sink": None}


@pytest.fixture
def fake_runtimes(monkeypatch):
    """Install fakes sized for `PROBLEM`, and let `cudnn_fused_attention` run on CPU tensors."""
    fakes = FakeRuntimes(PROBLEM["head_dim"] ** -0.5, PROBLEM["keys"])
    monkeypatch.setattr(cudnn_flashmla, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(cudnn_flashmla, "_flash_mla_sparse_fwd", lambda: fakes.flash_mla_sparse_fwd)
    monkeypatch.setattr(
        cudnn_flashmla, "_cudnn_sparse_backward", lambda: fakes.sparse_attention_backward_wrapper
    )
    return fakes


PROBLEM = dict(tokens=11, heads=3, head_dim=576, keys=40, width=9)


def attention_on_the_cudnn_backend(*args, **kwargs):
    return sparse_mla_attention(*args, **kwargs, backend="cudnn")


@pytest.mark.parametrize(
    "fn",
    [cudnn_sparse_attention, attention_on_the_cudnn_backend],
    ids=["cudnn_sparse_attention", "sparse_mla_attention-cudnn"],
)
@pytest.mark.parametrize("lengths", [False, True], ids=["compacted-ids", "topk_length"])
@pytest.mark.parametrize("hint", [None, "valid_row_indices"])
def test_public_functions_pass_every_argument_in_order_to_the_runtimes(
    fake_runtimes, fn, lengths, hint
):
    p = random_problem(**PROBLEM, sink=True, lengths=lengths, seed=17)
    hints = {}
    if hint == "valid_row_indices":
        nonempty = valid_slots(p.topk_indices[:, 0], PROBLEM["keys"], p.topk_length).any(dim=-1)
        hints = dict(valid_row_indices=nonempty.nonzero().flatten())
    errors = errors_against_oracle(fn, p, **hints)
    assert fake_runtimes.forward_calls == 1 and fake_runtimes.backward_calls == 1
    assert errors["out"] <= 1e-2 and errors["dq"] <= 2e-2 and errors["dkv"] <= 2e-2, errors
    assert errors["dsink_vs_terms"] <= 2e-2, errors
