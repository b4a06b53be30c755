"""round_to_e4m3: bit-for-bit equal to PyTorch's saturating float8_e4m3fn cast, on every BF16 value and FP32 ties."""

import pytest
import torch

from sa_kernels import round_to_e4m3
from sa_kernels.e4m3 import reference


def _assert_bitwise_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    int_view = {
        torch.float32: torch.int32,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
    }[got.dtype]
    mismatch = (got.view(int_view) != expected.view(int_view)) & ~nan
    assert not mismatch.any(), f"first mismatches: {got[mismatch][:5]} vs {expected[mismatch][:5]}"


def _e4m3_grid_probes() -> torch.Tensor:
    """Every finite E4M3 value, the midpoints between neighbours (ties), one FP32 ulp either side, ±inf, ±0."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = torch.unique(codes[~codes.isnan()].abs())
    mids = (values[1:].double() + values[:-1].double()).div(2).float()
    above = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    below = torch.nextafter(mids, torch.zeros_like(mids))
    extra = torch.tensor(
        [448.0, 464.0, 479.99, 480.0, 1e30, float("inf"), 2.0**-10, 2.0**-11, 1e-30, 0.0]
    )
    probes = torch.cat([values, mids, above, below, extra])
    return torch.cat([probes, -probes])


def test_every_bf16_bit_pattern_rounds_like_torch():
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    _assert_bitwise_equal(round_to_e4m3(x, backend="triton"), reference.round_to_e4m3(x))


def test_fp32_ties_neighbours_saturation_and_signed_zeros_round_like_torch():
    x = _e4m3_grid_probes()
    out = round_to_e4m3(x, backend="triton")
    _assert_bitwise_equal(out, reference.round_to_e4m3(x))
    assert out.abs().max() == 448.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_random_values_over_the_exponent_range_round_like_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp2(torch.randint(-14, 10, (3, 1111), generator=gen).float())
    x = (torch.randn(3, 1111, generator=gen) * scale).to(dtype)
    x[0, :5] = torch.tensor([float("nan"), float("-inf"), -0.0, 0.0, 1000.0]).to(dtype)
    _assert_bitwise_equal(round_to_e4m3(x, backend="triton"), reference.round_to_e4m3(x))


def test_non_contiguous_input_gives_a_contiguous_result_of_its_shape():
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).t()
    out = round_to_e4m3(x, backend="triton")
    assert out.is_contiguous()
    _assert_bitwise_equal(out, reference.round_to_e4m3(x))


def test_errors_name_the_argument_and_the_dtype():
    with pytest.raises(
        TypeError, match=r"round_to_e4m3: x must be bfloat16, float16 or float32; got torch.float64"
    ):
        round_to_e4m3(torch.randn(3, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x must be a tensor"):
        round_to_e4m3([1.0])


@pytest.mark.gpu
def test_cuda_rounds_every_bf16_pattern_and_16m_fp32_values_like_torch():
    x = (
        torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda")
        .to(torch.int16)
        .view(torch.bfloat16)
    )
    _assert_bitwise_equal(round_to_e4m3(x), reference.round_to_e4m3(x))
    probes = _e4m3_grid_probes().cuda()
    _assert_bitwise_equal(round_to_e4m3(probes), reference.round_to_e4m3(probes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = torch.exp2(torch.randint(-14, 10, (4096, 4096), generator=gen, device="cuda").float())
    y = torch.randn(4096, 4096, generator=gen, device="cuda") * scale
    _assert_bitwise_equal(round_to_e4m3(y), reference.round_to_e4m3(y))
