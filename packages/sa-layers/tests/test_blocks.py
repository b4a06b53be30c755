"""Decoder building blocks against the SEMANTICS §1.1 formulas written out in float64."""

import pytest
import torch

from sa_layers import ClampedSwiGLUMLP, Step5RMSNorm


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * (1 + weight.double())


def clamped_swiglu_formula(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    activation = torch.nn.functional.silu(gate.double())
    up = up.double()
    if limit > 0:
        activation = activation.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return activation * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-residual", "bf16"])
def test_step5_rms_norm_matches_the_formula_and_rounds_once(dtype):
    norm = Step5RMSNorm(96, eps=1e-5, output_dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    x = torch.randn(3, 7, 96, dtype=dtype) * 4
    y = norm(x)
    assert y.dtype == torch.bfloat16
    assert norm.weight.dtype == torch.float32
    expected = rms_norm_formula(x, norm.weight.detach(), 1e-5).to(torch.bfloat16)
    # one rounding from FP32 math: at most one bf16 ulp from the float64 result rounded once
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=1e-6)


def test_step5_rms_norm_weight_stays_fp32_when_the_model_moves_to_bf16():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Step5RMSNorm(8, output_dtype=torch.bfloat16))
    model.to(torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32
    assert model(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_step5_rms_norm_gradients_match_the_formula():
    norm = Step5RMSNorm(16)
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 16, dtype=torch.float64)
    (norm(x) * upstream).sum().backward()
    weight = norm.weight.detach().double().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    (rms_norm_formula(x_ref, weight, 1e-5) * upstream).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(norm.weight.grad.double(), weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("limit", [0.0, 1.5], ids=["no-clamp", "limit-1.5"])
def test_clamped_swiglu_mlp_matches_the_formula(limit):
    torch.manual_seed(0)
    mlp = ClampedSwiGLUMLP(24, 40, limit, dtype=torch.float64)
    x = torch.randn(5, 24, dtype=torch.float64) * 3
    expected = (
        clamped_swiglu_formula(mlp.gate_proj(x), mlp.up_proj(x), limit) @ mlp.down_proj.weight.T
    )
    torch.testing.assert_close(mlp(x), expected)


def test_clamped_swiglu_mlp_gradients_match_the_formula_with_active_clamps():
    torch.manual_seed(1)
    mlp = ClampedSwiGLUMLP(8, 12, limit=0.5, dtype=torch.float64)
    x = torch.randn(6, 8, dtype=torch.float64) * 3
    assert (mlp.up_proj(x).abs() > 0.5).any()  # the clamp is active somewhere
    mlp(x).square().sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    (
        clamped_swiglu_formula(mlp.gate_proj(x), mlp.up_proj(x), 0.5) @ mlp.down_proj.weight.T
    ).square().sum().backward()
    for grad, p in zip(grads, mlp.parameters(), strict=True):
        torch.testing.assert_close(grad, p.grad)


def test_mlp_inputs_of_another_width_or_dtype_raise_named_errors():
    mlp = ClampedSwiGLUMLP(8, 12, 1.0)
    with pytest.raises(ValueError, match=r"hidden_size=8\]; got \(2, 9\)"):
        mlp(torch.randn(2, 9))
    with pytest.raises(TypeError, match=r"MLP's dtype \(torch.float32\); got torch.bfloat16"):
        mlp(torch.randn(2, 8, dtype=torch.bfloat16))
    with torch.autocast("cpu", torch.bfloat16):  # autocast casts the matmul inputs itself
        assert mlp(torch.randn(2, 8, dtype=torch.bfloat16)).shape == (2, 8)
    with pytest.raises(TypeError, match="limit must be a float"):
        ClampedSwiGLUMLP(4, 4, "7")


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: Step5RMSNorm(0), "hidden_size must be >= 1"),
        (lambda: ClampedSwiGLUMLP(0, 4, 1.0), "hidden_size and intermediate_size"),
        (lambda: ClampedSwiGLUMLP(4, 4, float("nan")), "limit must not be NaN"),
    ],
    ids=["norm-empty", "mlp-empty", "mlp-nan-limit"],
)
def test_bad_sizes_raise(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: Step5RMSNorm(8.0), "hidden_size must be an int; got 8.0"),
        (lambda: ClampedSwiGLUMLP("8", 4, 1.0), "hidden_size must be an int; got '8'"),
    ],
    ids=["norm-float", "mlp-str"],
)
def test_sizes_of_another_type_raise(factory, message):
    with pytest.raises(TypeError, match=message):
        factory()
