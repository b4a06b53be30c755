"""The opt-in split dq kernel (LaunchConfig.dv_split > 1) against the oracle and the default dq kernel."""

import pytest
import torch

from sa_mla.reference import sparse_mla_reference_with_lse
from sa_mla.testing import random_problem, relative_error
from sa_mla.triton import lse_with_sink
from sa_mla.triton.backward import sparse_mla_backward, sparse_mla_delta
from sa_mla.triton.forward import sparse_mla_forward
from sa_mla.triton.launch import DQ_SPILL_FREE_CANDIDATES, LaunchConfig


def _oracle_and_triton_dq(p, dq_config):
    """(oracle dq fp32, split-kernel dq, default-kernel dq, dkv of both runs) on one problem."""
    q = p.q.detach()
    kv = p.kv_latent.detach()[:, 0].contiguous()
    ids = p.topk_indices[:, 0].contiguous()
    sink = p.attn_sink.detach() if p.attn_sink is not None else None
    out, lse = sparse_mla_forward(q, kv, ids, p.softmax_scale, p.topk_length, sink)
    gen = torch.Generator().manual_seed(99)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    delta = sparse_mla_delta(out, dout)
    lse_total = lse_with_sink(lse, sink)
    args = (q, kv, ids, p.softmax_scale, p.topk_length, dout, lse_total, delta)
    dq_split, dkv_split = sparse_mla_backward(*args, dq_config=dq_config)
    dq_default, dkv_default = sparse_mla_backward(*args)

    q32 = q.float().requires_grad_()
    expected, _ = sparse_mla_reference_with_lse(
        q32, p.kv_latent.detach().float(), p.topk_indices, p.softmax_scale, p.topk_length, sink
    )
    (expected_dq,) = torch.autograd.grad(expected, [q32], dout.float())
    return expected_dq, dq_split, dq_default, dkv_split, dkv_default


SPLIT_CASES = [
    pytest.param(
        dict(tokens=6, heads=5, head_dim=576, keys=40, width=37, sink=True, dtype=torch.float32),
        LaunchConfig(16, 16, 4, 1, dv_split=2),
        id="H5-D576-W37-sink-fp32-split2",
    ),
    pytest.param(
        dict(tokens=5, heads=20, head_dim=576, keys=33, width=21, lengths=True),
        LaunchConfig(16, 16, 4, 1, dv_split=4),
        id="H20-D576-W21-len-bf16-split4",
    ),
    pytest.param(
        dict(tokens=4, heads=3, head_dim=512, keys=25, width=19, sink=True, lengths=True),
        LaunchConfig(16, 16, 4, 1, dv_split=2),
        id="H3-D512-W19-sink-len-bf16-split2",
    ),
]


@pytest.mark.parametrize(("case", "config"), SPLIT_CASES)
def test_split_dq_kernel_matches_oracle_and_default_kernel(case, config):
    p = random_problem(**case, seed=61, requires_grad=False)
    expected_dq, dq_split, dq_default, dkv_split, dkv_default = _oracle_and_triton_dq(p, config)
    assert torch.isfinite(dq_split).all()
    assert torch.all(dq_split[p.empty_rows] == 0)
    tolerance = 1e-5 if case.get("dtype") == torch.float32 else 1e-2
    # Every slice of the value dims and the rope dims are written by some program.
    for dims in (slice(0, 256), slice(256, 512), slice(512, None)):
        if dq_split[..., dims].numel():
            error = relative_error(dq_split[..., dims], expected_dq[..., dims])
            assert error <= tolerance, (dims, error)
    assert relative_error(dq_split, dq_default) <= tolerance
    torch.testing.assert_close(dkv_split, dkv_default, rtol=0, atol=0)


def test_split_dq_rejects_a_split_that_is_not_a_multiple_of_64_dims():
    p = random_problem(
        2, 2, 576, 8, 4, dtype=torch.float32, invalid=False, seed=3, requires_grad=False
    )
    with pytest.raises(ValueError, match="dv_split"):
        _oracle_and_triton_dq(p, LaunchConfig(16, 16, 4, 1, dv_split=3))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(c, id=f"{c.block_h}x{c.block_k}-w{c.num_warps}-split{c.dv_split}")
        for c in DQ_SPILL_FREE_CANDIDATES
    ],
)
def test_split_dq_kernel_gpu_matches_oracle(config):
    p = random_problem(
        200,
        128,
        576,
        3000,
        700,
        sink=True,
        lengths=True,
        device="cuda",
        seed=67,
        requires_grad=False,
    )
    expected_dq, dq_split, dq_default, dkv_split, dkv_default = _oracle_and_triton_dq(p, config)
    assert torch.isfinite(dq_split).all()
    assert relative_error(dq_split, expected_dq) <= 1e-2
    assert relative_error(dq_split, dq_default) <= 1e-2
