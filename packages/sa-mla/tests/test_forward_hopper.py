"""The Gluon Hopper forward against the FP32 oracle and the portable kernel (SM90 GPUs only: Gluon has
no interpreter), and the choice between the two kernels."""

import pytest
import torch
from mla_cases import random_problem, relative_error

from sa_mla.sparse_mla import triton_forward
from sa_mla.sparse_mla.reference import sparse_mla_reference_with_lse
from sa_mla.sparse_mla.triton_launch import forward_configs

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(
    not ON_HOPPER or triton_forward.sparse_mla_forward_hopper is None,
    reason="the Gluon Hopper forward needs an SM90 GPU and Triton's Gluon",
)


def _oracle(p, lengths):
    """(out, lse) of the FP32 oracle on problem p's inputs, with `lengths` as its topk_length."""
    return sparse_mla_reference_with_lse(
        p.q.float(),
        p.kv_latent.float(),
        p.topk_indices,
        p.softmax_scale,
        lengths,
        attn_sink=p.attn_sink,
    )


CASES = [
    pytest.param(
        h, d, w, s, n, id=f"H{h}-D{d}-W{w}-{'sink' if s else 'nosink'}-{'len' if n else 'full'}"
    )
    for h, d, w, s, n in (
        (128, 576, 2048, True, False),
        (128, 512, 1000, False, True),
        (64, 576, 333, True, True),
        (16, 576, 64, False, False),
        (20, 512, 200, True, False),
        (200, 576, 130, True, True),
        (1, 576, 77, True, True),
    )
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("heads", "head_dim", "width", "sink", "lengths"), CASES)
def test_hopper_forward_matches_oracle_and_portable_kernel(heads, head_dim, width, sink, lengths):
    """-1 and out-of-range ids, duplicated slots, rows without a valid id, ragged `topk_length`
    (including 0 and beyond the width), head counts that are not multiples of the 64-head block."""
    p = random_problem(
        257,
        heads,
        head_dim,
        5000,
        width,
        sink=sink,
        lengths=lengths,
        device="cuda",
        seed=heads * 7 + width,
        requires_grad=False,
    )
    q, kv, ids = p.q, p.kv_latent[:, 0], p.topk_indices[:, 0].contiguous()
    assert triton_forward.hopper_forward_applies(q, kv)
    out, lse = triton_forward.sparse_mla_forward_hopper(
        q, kv, ids, p.softmax_scale, p.topk_length, p.attn_sink
    )
    expected_out, expected_lse = _oracle(p, p.topk_length)
    assert relative_error(out.float(), expected_out) <= 5e-3
    finite = torch.isfinite(expected_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.all(torch.isposinf(lse[~finite]))
    torch.testing.assert_close(lse[finite], expected_lse[finite], rtol=1e-4, atol=1e-4)
    assert torch.all(out[p.empty_rows] == 0)
    portable_out, portable_lse = triton_forward.sparse_mla_forward(
        q, kv, ids, p.softmax_scale, p.topk_length, p.attn_sink, config=forward_configs(heads)[0]
    )
    assert relative_error(out.float(), portable_out.float()) <= 2e-3
    torch.testing.assert_close(lse, portable_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_hopper
def test_forward_picks_the_hopper_kernel_for_bf16_and_the_portable_one_otherwise(monkeypatch):
    p = random_problem(9, 16, 576, 100, 40, device="cuda", seed=1, requires_grad=False)
    q, kv, ids = p.q, p.kv_latent[:, 0], p.topk_indices[:, 0].contiguous()
    calls = []
    real = triton_forward.sparse_mla_forward_hopper
    monkeypatch.setattr(
        triton_forward,
        "sparse_mla_forward_hopper",
        lambda *args: calls.append(args[0].dtype) or real(*args),
    )
    triton_forward.sparse_mla_forward(q, kv, ids, p.softmax_scale, None, None)
    triton_forward.sparse_mla_forward(q.float(), kv.float(), ids, p.softmax_scale, None, None)
    assert calls == [torch.bfloat16]


@pytest.mark.gpu
@needs_hopper
def test_hopper_forward_with_explicit_short_and_long_lengths_and_zero_tokens():
    p = random_problem(
        40, 64, 576, 3000, 150, sink=True, device="cuda", seed=9, requires_grad=False
    )
    q, kv, ids = p.q, p.kv_latent[:, 0], p.topk_indices[:, 0].contiguous()
    lengths = torch.randint(1, 150, (40,), dtype=torch.int32, device="cuda")
    lengths[0], lengths[1], lengths[2] = 0, 150, 10_000  # none, all, beyond the width
    out, lse = triton_forward.sparse_mla_forward_hopper(
        q, kv, ids, p.softmax_scale, lengths, p.attn_sink
    )
    expected_out, expected_lse = _oracle(p, lengths)
    assert relative_error(out.float(), expected_out) <= 5e-3
    assert torch.all(out[0] == 0) and torch.all(torch.isposinf(lse[0]))
    finite = torch.isfinite(expected_lse)
    torch.testing.assert_close(lse[finite], expected_lse[finite], rtol=1e-4, atol=1e-4)
    empty_out, empty_lse = triton_forward.sparse_mla_forward_hopper(
        q[:0], kv, ids[:0], p.softmax_scale, None, None
    )
    assert empty_out.shape == (0, 64, 512) and empty_lse.shape == (0, 64)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout", ["offset", "stride"])
def test_kv_rows_the_gathers_cannot_prove_aligned_go_to_the_portable_kernel(layout):
    """The 16-byte gathers need rows Triton can prove 16-byte aligned: a kv starting one element into
    its storage (rows 2 bytes off), or with a row stride of 584 elements (aligned, but not a multiple of
    16 elements, so not provably so), runs the portable kernel and still gives the oracle's output,
    instead of failing to compile."""
    p = random_problem(33, 16, 576, 500, 70, sink=True, device="cuda", seed=4, requires_grad=False)
    kv = p.kv_latent[:, 0]
    if layout == "offset":
        moved = torch.zeros(kv.numel() + 1, device="cuda", dtype=kv.dtype)[1:].view(kv.shape)
    else:
        moved = torch.zeros(kv.shape[0], 584, device="cuda", dtype=kv.dtype)[:, :576]
    moved.copy_(kv)
    ids = p.topk_indices[:, 0].contiguous()
    assert not triton_forward.hopper_forward_applies(p.q, moved)
    out, _ = triton_forward.sparse_mla_forward(p.q, moved, ids, p.softmax_scale, None, p.attn_sink)
    expected, _ = _oracle(p, None)
    assert relative_error(out.float(), expected) <= 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an SM90 GPU")
def test_the_gluon_kernel_imports_on_hopper():
    """The Gluon kernel's import failing falls back to the portable kernel without an error, and the
    other tests here would only skip: on an SM90 GPU with torch's Triton, it must import."""
    from sa_mla.sparse_mla import gluon_forward  # raises what the fallback would swallow

    assert triton_forward.sparse_mla_forward_hopper is gluon_forward.sparse_mla_forward_hopper


@pytest.mark.skipif(
    triton_forward.sparse_mla_forward_hopper is None, reason="this Triton has no Gluon Hopper ops"
)
def test_hopper_kernel_refuses_other_dtypes():
    q = torch.randn(3, 4, 576, dtype=torch.float16)
    ids = torch.zeros(3, 8, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"q and kv must be bfloat16; got torch\.float16"):
        triton_forward.sparse_mla_forward_hopper(q, q[:, 0], ids, 0.1, None, None)


def test_both_forward_kernels_take_the_shared_launch_arguments_in_their_own_order():
    """`triton_launch.forward_arguments` feeds the portable kernel and the Gluon one: its positional
    arguments and constexprs must name, in order, the first parameters of each kernel."""
    from sa_mla.sparse_mla.triton_launch import forward_arguments

    q = torch.empty(3, 4, 576, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(10, 576, device="meta", dtype=torch.bfloat16)
    ids = torch.empty(3, 8, device="meta", dtype=torch.int32)
    lengths = torch.empty(3, device="meta", dtype=torch.int32)
    sink = torch.empty(4, device="meta")
    out, lse, args, constexprs = forward_arguments(q, kv, ids, 0.1, lengths, sink)
    assert out.shape == (3, 4, 512) and lse.shape == (3, 4)
    assert args[3] is lengths and args[4] is sink and args[5] is out and args[6] is lse
    expected = ["Q", "KV", "IDX", "TOPK_LEN", "SINK", "OUT", "LSE", "stride_qt", "stride_qh"]
    expected += ["stride_kvt", "stride_it", "stride_ot", "stride_oh", "heads", "keys", "width"]
    expected += ["scale_log2", "HAS_LEN", "HAS_SINK", "D_ROPE", "DV"]
    assert len(args) + len(constexprs) == len(expected)
    assert list(constexprs) == expected[len(args) :]
    kernels = [triton_forward._sparse_mla_fwd_kernel]
    if triton_forward.sparse_mla_forward_hopper is not None:
        from sa_mla.sparse_mla.gluon_forward import _sparse_mla_fwd_hopper_kernel

        kernels.append(_sparse_mla_fwd_hopper_kernel)
    for kernel in kernels:
        assert kernel.arg_names[: len(expected)] == expected, kernel.fn.__name__
