"""pack_region_bitmap: Triton segmented-OR packing vs the reference and vs decoding the bits back."""

import pytest
import torch

from sa_kernels import pack_region_bitmap
from sa_kernels.region_bitmap import reference


def _sorted_ids(shape, regions, pad_fraction=0.2, device="cpu", seed=0):
    """Sorted rows of region ids with repeats, padding at `regions` and above (the sentinel and beyond)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, regions, shape, generator=gen, dtype=torch.int32)
    pad = torch.rand(shape, generator=gen) < pad_fraction
    ids = torch.where(
        pad, regions + torch.randint(0, 3, shape, generator=gen, dtype=torch.int32), ids
    )
    return ids.sort(-1).values.to(device)


def _decode(bitmap: torch.Tensor, regions: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmap.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :regions].bool()


CASES = [
    pytest.param((2, 3, 5, 37), 100, id="B2-G3-Q5-slots37-R100"),
    pytest.param((1, 2, 3, 1), 33, id="B1-G2-Q3-slots1-R33"),
    pytest.param((1, 1, 4, 513), 2049, id="B1-G1-Q4-slots513-R2049"),
    pytest.param((1, 1, 2, 64), 32, id="B1-G1-Q2-slots64-R32-dense"),
    pytest.param((1, 2, 3, 300), 40000, id="B1-G2-Q3-slots300-R40000-two-word-blocks"),
]


@pytest.mark.parametrize(("shape", "regions"), CASES)
def test_triton_matches_reference_and_decodes_to_the_id_sets(shape, regions):
    ids = _sorted_ids(shape, regions)
    out = torch.full((*shape[:-1], (regions + 31) // 32), -1, dtype=torch.int32)
    got = pack_region_bitmap(ids, regions, out=out, backend="triton")
    assert got is out
    torch.testing.assert_close(got, reference.pack_region_bitmap(ids, regions), rtol=0, atol=0)
    members = _decode(got, regions)
    for row_ids, row_members in zip(
        ids.reshape(-1, shape[-1]), members.reshape(-1, regions), strict=True
    ):
        expected = {int(i) for i in row_ids if i < regions}
        assert set(torch.nonzero(row_members).flatten().tolist()) == expected


def test_rows_of_padding_give_zero_words_and_region_31_sets_the_sign_bit():
    ids = torch.tensor([[40, 40, 40], [31, 31, 40], [-1, 0, 40]], dtype=torch.int32)
    out = torch.full((3, 2), 7, dtype=torch.int32)
    got = pack_region_bitmap(ids, 40, out=out, backend="triton")
    assert got.tolist() == [[0, 0], [-(2**31), 0], [1, 0]]


def test_errors_name_the_argument_and_the_values():
    ids = _sorted_ids((1, 1, 2, 4), 10)
    with pytest.raises(TypeError, match=r"pack_region_bitmap: ids must be int32; got torch.int64"):
        pack_region_bitmap(ids.long(), 10)
    with pytest.raises(ValueError, match=r"regions must be in \[1, 2\*\*31 - 32\); got 0"):
        pack_region_bitmap(ids, 0)
    with pytest.raises(ValueError, match=r"out must be a contiguous int32 tensor \(1, 1, 2, 1\)"):
        pack_region_bitmap(ids, 10, out=torch.empty(1, 1, 2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"regions must be an int"):
        pack_region_bitmap(ids, 10.0)


@pytest.mark.gpu
def test_cuda_matches_reference_at_4096_queries_513_slots():
    ids = _sorted_ids((1, 4, 4096, 513), 16384, device="cuda")
    out = torch.full((1, 4, 4096, 512), -1, dtype=torch.int32, device="cuda")
    torch.testing.assert_close(
        pack_region_bitmap(ids, 16384, out=out),
        reference.pack_region_bitmap(ids, 16384),
        rtol=0,
        atol=0,
    )
