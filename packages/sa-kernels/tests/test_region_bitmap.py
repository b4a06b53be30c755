"""pack_region_bitmap: Triton segmented-OR packing vs the reference and vs decoding the bits back."""

import pytest
import torch

from sa_kernels import pack_region_bitmap
from sa_kernels.region_bitmap import reference, triton_kernels


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
    pytest.param((1, 1, 3, 1), 33, id="B1-G1-Q3-slots1-R33-odd-rows"),
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


def _config_id(cfg):
    return "block{BLOCK_S}-tail{BLOCK_T}-align{ALIGN}-zero{BLOCK_W}-rows{ROWS}".format(**cfg)


def _small(**cfg):
    return {"ALIGN": 4, "BLOCK_W": 16, "ROWS": 1, **cfg}


# Interpreter-sized versions of the sweep configs' kinds: 16-byte (ALIGN 4) and 8-byte (ALIGN 2) aligned reads,
# the zeroing step of the scan's shape or not, 1, 2 and 4 rows per program. The default itself runs in the
# public-function tests above.
SMALL_CONFIGS = [
    _small(BLOCK_S=4, BLOCK_T=2),
    # The tail step grows to the 1..16 positions after the full steps; zeroing has the scan's shape.
    _small(BLOCK_S=16, BLOCK_T=1),
    _small(BLOCK_S=8, BLOCK_T=8, ALIGN=2, BLOCK_W=8),
    # 6 rows: three programs of 2 rows.
    _small(BLOCK_S=8, BLOCK_T=4, ROWS=2),
    # 6 rows: the second program has 2 rows and 2 past the end.
    _small(BLOCK_S=8, BLOCK_T=4, ROWS=4),
]


@pytest.mark.parametrize("config", SMALL_CONFIGS, ids=_config_id)
def test_every_sweep_config_writes_the_reference_bits_over_a_poisoned_out(config):
    # 6 rows of 45 slots: with ALIGN 4 the rows start 0..3 ids past a 16-byte boundary, so each reads up to 3
    # ids of the previous row; 45 slots over 10 words, so words span full steps and the tail; negative ids
    # lead one row, padding (the sentinel and beyond) ends others.
    ids = _sorted_ids((1, 3, 2, 45), 300, seed=3)
    ids[0, 0, 0, :3] = torch.tensor([-5, -1, -1], dtype=torch.int32)
    ids[0, 2, 1] = torch.arange(64, 64 + 45, dtype=torch.int32)  # word 2 spans 32 slots
    out = torch.full((1, 3, 2, 10), -1, dtype=torch.int32)
    triton_kernels.pack_region_bitmap(ids, 300, out, _config=config)
    torch.testing.assert_close(out, reference.pack_region_bitmap(ids, 300), rtol=0, atol=0)


@pytest.mark.parametrize("config", SMALL_CONFIGS, ids=_config_id)
@pytest.mark.parametrize(
    ("slots", "regions"),
    [
        pytest.param(13, 70, id="slots13-R70-tail-of-a-word"),
        pytest.param(33, 33, id="slots33-R33-dense-repeats"),
        pytest.param(7, 1000, id="slots7-R1000-sparse"),
    ],
)
def test_rows_read_from_a_strided_view_ignore_the_ids_between_rows(config, slots, regions):
    # Rows of a wider tensor: the 16-byte-aligned reads start inside the previous row's unused columns, which
    # hold member-looking ids (small, in range) that must not leak into the bitmap.
    wide = torch.randint(0, min(regions, 32), (5, 3, slots + 2), dtype=torch.int32)
    wide[..., :slots] = _sorted_ids((5, 3, slots), regions, pad_fraction=0.3, seed=slots)
    ids = wide[..., :slots]
    ids[1, 2] = regions  # a row of padding only
    out = torch.full((5, 3, (regions + 31) // 32), -7, dtype=torch.int32)
    triton_kernels.pack_region_bitmap(ids, regions, out, _config=config)
    torch.testing.assert_close(out, reference.pack_region_bitmap(ids, regions), rtol=0, atol=0)
    assert (out[1, 2] == 0).all()


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
    with pytest.raises(
        ValueError, match=r"out must be a contiguous tensor \(int32, shape \(1, 1, 2, 1\)"
    ):
        pack_region_bitmap(ids, 10, out=torch.empty(1, 1, 2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"regions must be an int"):
        pack_region_bitmap(ids, 10.0)
    strided = torch.empty(1, 1, 2, 2, dtype=torch.int32)[..., :1]
    with pytest.raises(
        ValueError,
        match=r"on cpu\); got \(1, 1, 2, 1\) torch.int32 on cpu with strides \(4, 4, 2, 1\)",
    ):
        pack_region_bitmap(ids, 10, out=strided)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_rows_without_slots_select_nothing(backend):
    ids = torch.empty(1, 2, 3, 0, dtype=torch.int32)
    out = torch.full((1, 2, 3, 2), -1, dtype=torch.int32)
    assert pack_region_bitmap(ids, 40, out=out, backend=backend).eq(0).all()
    assert pack_region_bitmap(ids[:, :, :0], 40, backend=backend).shape == (1, 2, 0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    triton_kernels.SWEEP_CONFIGS,
    ids=lambda c: _config_id(c) + ("-default" if c == triton_kernels.DEFAULT_CONFIG else ""),
)
def test_cuda_matches_reference_at_4092_queries_513_slots(config):
    # Row count, slots and regions specialise like the benchmark's shape, so the sweep reuses these compilations.
    ids = _sorted_ids((1, 4, 4092, 513), 16384, device="cuda")
    out = torch.full((1, 4, 4092, 512), -1, dtype=torch.int32, device="cuda")
    triton_kernels.pack_region_bitmap(ids, 16384, out, _config=config)
    torch.testing.assert_close(out, reference.pack_region_bitmap(ids, 16384), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("slots", "regions"),
    [
        pytest.param(7, 1000, id="slots7-R1000-tail-only"),
        pytest.param(45, 300, id="slots45-R300-words-span-steps"),
        pytest.param(2051, 40000, id="slots2051-R40000-four-steps-and-a-tail"),
    ],
)
def test_cuda_default_matches_reference_on_strided_rows_negatives_and_padding_rows(slots, regions):
    # The compiled default (16-byte vector loads, the scatter's layout conversion, 2 rows per program with an odd
    # row count) on strided rows (reads start in the previous row's unused columns, which hold member-looking
    # ids), negative ids, a row of padding only, regions not a multiple of 32.
    wide = torch.randint(0, 32, (3, 69, slots + 2), dtype=torch.int32)
    wide[..., :slots] = _sorted_ids((3, 69, slots), regions, pad_fraction=0.3, seed=slots)
    ids = wide.cuda()[..., :slots]
    ids[0, 5] = regions
    ids[1, 3, : min(3, slots)] = -1
    out = torch.full((3, 69, (regions + 31) // 32), -7, dtype=torch.int32, device="cuda")
    pack_region_bitmap(ids, regions, out=out)
    torch.testing.assert_close(out, reference.pack_region_bitmap(ids, regions), rtol=0, atol=0)
    assert (out[0, 5] == 0).all()
