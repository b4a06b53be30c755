"""The backward's sorted id rows: the Triton marking (interpreted on CPU, compiled on CUDA) against
the PyTorch definition, and hand-written cases for both."""

import pytest
import torch

from sa_mla.sparse_mla import triton_sorted_ids as sorted_ids
from sa_mla.sparse_mla.reference import ascending_valid_ids_reference
from sa_mla.sparse_mla.triton_sorted_ids import ascending_valid_ids, kernel_runs

# Without CUDA or the interpreter `ascending_valid_ids` is the reference itself: nothing to compare.
KERNEL = pytest.mark.skipif(
    not kernel_runs(torch.empty(0, dtype=torch.int32)),
    reason="the marking kernel needs CUDA or TRITON_INTERPRET=1",
)
BOTH = pytest.mark.parametrize(
    "sort",
    [ascending_valid_ids_reference, pytest.param(ascending_valid_ids, marks=KERNEL)],
    ids=["reference", "kernel"],
)


@BOTH
def test_each_rows_valid_ids_ascending_then_keys_and_their_count(sort):
    """-1, out-of-range ids and slots past topk_length become `keys` (5) at the row's end; duplicates
    stay; the counts are the rows' valid slots. topk_length below 0 keeps nothing, above the width
    everything; int64 ids are judged before the cast (2**32 + 3 is not 3)."""
    ids = torch.tensor(
        [[4, -1, 2, 4, 9, 0], [3, 1, 2, 0, 4, 4], [-1, -1, 7, 5, 6, -3]], dtype=torch.int32
    )
    ordered, counts = sort(ids, 5, None)
    expected = [[0, 2, 4, 4, 5, 5], [0, 1, 2, 3, 4, 4], [5, 5, 5, 5, 5, 5]]
    assert ordered.tolist() == expected and ordered.dtype == torch.int32
    assert counts.tolist() == [4, 6, 0] and counts.dtype == torch.int32
    ordered, counts = sort(ids, 5, torch.tensor([3, 0, 6]))
    assert ordered.tolist() == [[2, 4, 5, 5, 5, 5], [5] * 6, [5] * 6]
    assert counts.tolist() == [2, 0, 0]
    ordered, counts = sort(ids[:2], 5, torch.tensor([-2, 9]))
    assert ordered.tolist() == [[5] * 6, [0, 1, 2, 3, 4, 4]] and counts.tolist() == [0, 6]
    wide = torch.tensor([[2**32 + 3, 1, -(2**33), 3]], dtype=torch.int64)
    ordered, counts = sort(wide, 5, None)
    assert ordered.tolist() == [[1, 3, 5, 5]] and ordered.dtype == torch.int32
    assert counts.tolist() == [2]


@KERNEL
@pytest.mark.parametrize("width", [1, 7, 64, 100])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_kernel_equals_reference_on_random_rows(width, id_dtype, with_lengths):
    gen = torch.Generator().manual_seed(width)
    keys = 50
    ids = torch.randint(-5, keys + 5, (9, width), generator=gen).to(id_dtype)
    lengths = torch.randint(-2, width + 3, (9,), generator=gen) if with_lengths else None
    expected = ascending_valid_ids_reference(ids, keys, lengths)
    got = ascending_valid_ids(ids, keys, None if lengths is None else lengths.to(torch.int32))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@KERNEL
def test_strided_topk_length_is_read_per_row():
    ids = torch.tensor([[4, 1, 3, 0], [2, 2, 9, 1], [0, 1, 2, 3]], dtype=torch.int32)
    lengths = torch.tensor([[9, 2], [9, 4], [9, 0]], dtype=torch.int32)[:, 1]  # stride 2
    ordered, counts = ascending_valid_ids(ids, 5, lengths)
    assert ordered.tolist() == [[1, 4, 5, 5], [1, 2, 2, 5], [5, 5, 5, 5]]
    assert counts.tolist() == [2, 3, 0]


def test_rows_wider_than_the_kernel_take_the_reference(monkeypatch):
    monkeypatch.setattr(sorted_ids, "MAX_KERNEL_WIDTH", 8)
    launched = []
    monkeypatch.setattr(
        sorted_ids,
        "_valid_ids_or_keys_kernel",
        type("Recorder", (), {"__getitem__": lambda self, grid: launched.append(grid)})(),
    )
    ids = torch.tensor([[3, 1, -1, 2, 0, 9, 4, 4, 1]], dtype=torch.int32)
    ordered, counts = ascending_valid_ids(ids, 5, None)
    assert not launched
    assert ordered.tolist() == [[0, 1, 1, 2, 3, 4, 4, 5, 5]] and counts.tolist() == [7]


@pytest.mark.gpu
def test_kernel_equals_reference_on_cuda_at_the_goal_shape():
    """4096 rows of 2048 random ids over 64k keys (issue 6's shape), some invalid, with lengths."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    keys = 65_536
    ids = torch.randint(-100, keys + 100, (4096, 2048), device="cuda", generator=gen)
    lengths = torch.randint(0, 2100, (4096,), device="cuda", generator=gen)
    for id_dtype in (torch.int32, torch.int64):
        for topk_length in (None, lengths.to(torch.int32)):
            expected = ascending_valid_ids_reference(ids.to(id_dtype), keys, topk_length)
            got = ascending_valid_ids(ids.to(id_dtype), keys, topk_length)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
