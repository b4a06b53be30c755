"""FlashMLA forward + cuDNN backward against the oracle on CUDA (skipped, naming what is missing, without them)."""

import pytest
import torch
from mla_cases import errors_against_oracle, random_problem

from sa_mla import cudnn_sparse_attention, sparse_mla_attention
from sa_mla.sparse_mla import select_backend
from sa_mla.sparse_mla.canonical import fused_sparse_mla
from sa_mla.sparse_mla.cudnn_flashmla import FLASHMLA_CUDNN, unavailable_reason
from sa_mla.sparse_mla.reference import sparse_mla_reference_with_lse


@pytest.fixture
def fused_runtime():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"cudnn_sparse_attention cannot run: {reason}")


def within_tolerances(errors):
    return (
        errors["out"] <= 5e-3
        and errors["dq"] <= 1e-2
        and errors["dkv"] <= 1e-2
        and errors.get("dsink", 0) <= 1e-2
    )


CASES = [
    pytest.param(16, 576, 200, True, id="H16-D576-W200-sink"),
    pytest.param(32, 512, 450, False, id="H32-D512-W450"),
    pytest.param(64, 576, 300, True, id="H64-D576-W300-sink"),
    pytest.param(128, 512, 500, True, id="H128-D512-W500-sink"),
    pytest.param(128, 576, 1000, False, id="H128-D576-W1000"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "head_dim", "width", "sink"), CASES)
def test_fused_path_matches_oracle(fused_runtime, heads, head_dim, width, sink):
    p = random_problem(
        300, heads, head_dim, 3000, width, sink=sink, device="cuda", seed=heads + width
    )
    errors = errors_against_oracle(cudnn_sparse_attention, p)
    assert within_tolerances(errors), errors


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [20, 200])
def test_fused_path_pads_and_splits_odd_head_counts_with_lengths(fused_runtime, heads):
    p = random_problem(
        129, heads, 576, 777, 333, sink=True, lengths=True, device="cuda", seed=heads
    )
    errors = errors_against_oracle(cudnn_sparse_attention, p)
    assert within_tolerances(errors), errors


@pytest.mark.gpu
@pytest.mark.parametrize("hint", ["all_rows_nonempty", "valid_row_indices"])
def test_fused_path_with_row_hints(fused_runtime, hint):
    p = random_problem(
        256,
        64,
        576,
        2000,
        256,
        sink=True,
        invalid=hint == "valid_row_indices",
        device="cuda",
        seed=7,
    )
    if hint == "all_rows_nonempty":
        kwargs = dict(all_rows_nonempty=True)
    else:
        keep = torch.ones(256, dtype=torch.bool, device="cuda")
        keep[p.empty_rows] = False
        kwargs = dict(valid_row_indices=keep.nonzero().flatten())
    errors = errors_against_oracle(cudnn_sparse_attention, p, **kwargs)
    assert within_tolerances(errors), errors


@pytest.mark.gpu
def test_flashmla_lse_is_natural_log_and_inf_for_empty_rows(fused_runtime):
    p = random_problem(200, 64, 576, 1500, 300, device="cuda", seed=3, requires_grad=False)
    _, lse = fused_sparse_mla(FLASHMLA_CUDNN, *p.args(), False, None, None)
    _, expected = sparse_mla_reference_with_lse(*p.args())
    finite = torch.isfinite(expected)
    assert torch.all(torch.isposinf(lse[~finite]))
    assert (lse[finite] - expected[finite]).abs().max().item() <= 1e-3


@pytest.mark.gpu
def test_auto_backend_prefers_the_fused_path(fused_runtime):
    p = random_problem(8, 64, 576, 100, 64, device="cuda", requires_grad=False)
    assert select_backend("auto", p.q, p.kv_latent, p.topk_indices) == "cudnn"
    torch.testing.assert_close(
        sparse_mla_attention(*p.args()), cudnn_sparse_attention(*p.args()), rtol=0, atol=0
    )
