"""layer_norm_e2: Triton vs the reference, the E[x²] − E[x]² variance, rounded weight and bias, no autograd."""

import pytest
import torch

from sa_kernels import layer_norm_e2
from sa_kernels.layer_norm import reference

EPS = 1e-5


def _inputs(shape, dtype, device="cpu", seed=0, offset=0.5):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2 + offset).to(dtype).to(device)
    w = (torch.randn(shape[-1], generator=gen) * 0.3 + 1).to(device)
    b = (torch.randn(shape[-1], generator=gen) * 0.1).to(device)
    return x, w, b


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 3e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 2e-5, "rtol": 2e-5}


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        pytest.param((37, 256), torch.bfloat16, id="37x256-bf16"),
        pytest.param((5, 3, 130), torch.float32, id="5x3x130-fp32"),
        pytest.param((2, 17), torch.bfloat16, id="2x17-bf16"),
    ],
)
def test_triton_matches_reference(shape, dtype):
    x, w, b = _inputs(shape, dtype)
    out = layer_norm_e2(x, w, b, EPS, backend="triton")
    assert out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    torch.testing.assert_close(out, reference.layer_norm_e2(x, w, b, EPS), **_tol(dtype))


def test_reference_equals_torch_layer_norm_with_weight_and_bias_rounded_to_bf16():
    x, w, b = _inputs((64, 256), torch.bfloat16, offset=0.0)
    expected = torch.nn.functional.layer_norm(
        x.float(), (256,), w.bfloat16().float(), b.bfloat16().float(), EPS
    )
    torch.testing.assert_close(
        reference.layer_norm_e2(x, w, b, EPS), expected.bfloat16(), atol=2e-2, rtol=1e-2
    )


def test_variance_is_the_difference_of_moments_in_fp32():
    x, w, b = _inputs((8, 128), torch.float32, offset=300.0)
    xf = x.double()
    var = (x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True).square()
    expected = (xf - xf.mean(-1, keepdim=True)) * torch.rsqrt(
        var.double() + EPS
    ) * w.double() + b.double()
    torch.testing.assert_close(
        layer_norm_e2(x, w, b, EPS, backend="reference").double(), expected, atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        layer_norm_e2(x, w, b, EPS, backend="triton").double(), expected, atol=5e-2, rtol=5e-2
    )


def test_result_carries_no_autograd_history():
    x, w, b = _inputs((4, 32), torch.float32)
    out = layer_norm_e2(x.requires_grad_(), w.requires_grad_(), b, EPS, backend="triton")
    assert not out.requires_grad


def test_errors_name_the_argument_and_the_values():
    x, w, b = _inputs((4, 32), torch.float32)
    with pytest.raises(
        ValueError, match=r"layer_norm_e2: bias must be \[channels\].*\(32\); got \(31,\)"
    ):
        layer_norm_e2(x, w, b[:31], EPS)
    with pytest.raises(
        TypeError, match=r"layer_norm_e2: x must be a floating tensor; got torch.int32"
    ):
        layer_norm_e2(x.int(), w, b, EPS)
    with pytest.raises(TypeError, match=r"Triton path.*float64"):
        layer_norm_e2(x.double(), w, b, EPS, backend="triton")
    with pytest.raises(ValueError, match=r"eps must be a finite, non-negative"):
        layer_norm_e2(x, w, b, float("nan"))
    with pytest.raises(ValueError, match=r"at least one channel"):
        layer_norm_e2(torch.randn(3, 0), torch.randn(0), torch.randn(0), EPS)


def test_strided_weight_and_bias_are_read_as_their_values():
    x, w, b = _inputs((4, 32), torch.float32)
    w2, b2 = torch.stack([w, -w], -1).flatten()[::2], torch.stack([b, -b], -1).flatten()[::2]
    assert w2.stride() == (2,) and torch.equal(w2, w) and torch.equal(b2, b)
    torch.testing.assert_close(
        layer_norm_e2(x, w2, b2, EPS, backend="triton"),
        layer_norm_e2(x, w, b, EPS, backend="triton"),
    )


@pytest.mark.gpu
def test_cuda_matches_reference_at_65536x256():
    x, w, b = _inputs((65536, 256), torch.bfloat16, device="cuda")
    torch.testing.assert_close(
        layer_norm_e2(x, w, b, EPS), reference.layer_norm_e2(x, w, b, EPS), **_tol(torch.bfloat16)
    )
