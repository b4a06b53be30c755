"""clamped_swiglu: fused Triton forward/backward vs the reference, clamp semantics, gradcheck, errors."""

import pytest
import torch

from sa_kernels import clamped_swiglu
from sa_kernels.clamped_swiglu import reference, triton_kernels


def _tol(dtype: torch.dtype) -> dict:
    return (
        {"atol": 2e-2, "rtol": 2e-2}
        if dtype in (torch.bfloat16, torch.float16)
        else {"atol": 1e-5, "rtol": 1e-5}
    )


def _inputs(shape, dtype, device="cpu", seed=0, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)
    up = (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)
    return gate, up


@pytest.mark.parametrize("limit", [2.5, 0.0, -1.0], ids=["limit2.5", "limit0-off", "limit-1-off"])
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        pytest.param((7, 300), torch.bfloat16, id="7x300-bf16"),
        pytest.param((2, 3, 2100), torch.float32, id="2x3x2100-fp32-tail-past-one-block"),
        pytest.param((5, 33), torch.float16, id="5x33-fp16"),
    ],
)
def test_triton_forward_and_backward_match_reference(shape, dtype, limit):
    gate, up = _inputs(shape, dtype)
    g1, u1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = clamped_swiglu(g1, u1, limit, backend="triton")
    expected = reference.clamped_swiglu_forward(gate, up, limit)
    assert out.dtype == dtype and out.shape == gate.shape and not out.isnan().any()
    torch.testing.assert_close(out, expected, **_tol(dtype))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad)
    d_gate, d_up = reference.clamped_swiglu_backward(grad, gate, up, limit)
    torch.testing.assert_close(g1.grad, d_gate, **_tol(dtype))
    torch.testing.assert_close(u1.grad, d_up, **_tol(dtype))


def _config_id(cfg: dict) -> str:
    grid = "flat" if cfg["FLAT"] else "2d"
    evict = "-evict" if cfg["EVICT"] else ""
    wide = "-int64" if cfg.get("WIDE") else ""
    return f"block{cfg['BLOCK']}-warps{cfg['num_warps']}-{grid}{evict}{wide}"


CPU_SWEEP = [
    {"BLOCK": 256, "num_warps": 4, "FLAT": False, "EVICT": False},
    {"BLOCK": 128, "num_warps": 2, "FLAT": True, "EVICT": True},
    {"BLOCK": 256, "num_warps": 4, "FLAT": False, "EVICT": False, "WIDE": True},
    {"BLOCK": 128, "num_warps": 4, "FLAT": True, "EVICT": False, "WIDE": True},
    {"BLOCK": 512, "num_warps": 4, "FLAT": True, "EVICT": False},
]


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided-halves"])
@pytest.mark.parametrize("cfg", CPU_SWEEP, ids=_config_id)
def test_launch_configs_give_bit_identical_forward_and_backward(cfg, contiguous):
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(5, 2 * 333, generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    if contiguous:
        gate, up = gate.contiguous(), up.contiguous()
    grad = torch.randn(5, 333, generator=gen).bfloat16()
    base = triton_kernels.clamped_swiglu_forward(gate, up, 3.0)
    got = triton_kernels.clamped_swiglu_forward(gate, up, 3.0, _config=cfg)
    assert not got.isnan().any()
    assert torch.equal(got, base)
    torch.testing.assert_close(
        got, reference.clamped_swiglu_forward(gate, up, 3.0), atol=2e-2, rtol=2e-2
    )
    base_grads = triton_kernels.clamped_swiglu_backward(grad, gate, up, 3.0)
    grads = triton_kernels.clamped_swiglu_backward(grad, gate, up, 3.0, _config=cfg)
    for g, b in zip(grads, base_grads, strict=True):
        assert torch.equal(g, b)


def test_strided_halves_of_a_fused_gate_up_projection_are_read_in_place():
    gate_up = (
        torch.randn(6, 2, 2 * 150, generator=torch.Generator().manual_seed(2))
        .mul(3)
        .requires_grad_()
    )
    gate, up = gate_up.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    out = clamped_swiglu(gate, up, 3.0, backend="triton")
    torch.testing.assert_close(out, reference.clamped_swiglu_forward(gate, up, 3.0))
    out.sum().backward()
    d_gate, d_up = reference.clamped_swiglu_backward(torch.ones_like(out), gate, up, 3.0)
    torch.testing.assert_close(gate_up.grad, torch.cat([d_gate, d_up], -1))


@pytest.mark.parametrize("limit", [1.5, 0.0], ids=["clamped", "unclamped"])
def test_reference_backward_passes_gradcheck_in_float64(limit):
    gate, up = _inputs((5, 9), torch.float64, scale=2.0)
    fn = lambda g, u: clamped_swiglu(g, u, limit, backend="reference")
    assert torch.autograd.gradcheck(fn, (gate.requires_grad_(), up.requires_grad_()))


def test_reference_backward_equals_autograd_of_the_reference_forward():
    gate, up = _inputs((4, 50), torch.float64, seed=5)
    gate.requires_grad_()
    up.requires_grad_()
    out = reference.clamped_swiglu_forward(gate, up, 2.0)
    grad = torch.randn_like(out)
    auto = torch.autograd.grad(out, (gate, up), grad)
    manual = reference.clamped_swiglu_backward(grad, gate.detach(), up.detach(), 2.0)
    torch.testing.assert_close(manual, auto)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_clamp_acts_on_silu_of_gate_and_zeroes_gradients_where_active(backend):
    limit = 7.0
    # silu(7.005) ≈ 6.9989 < 7: a clamp on gate itself would clip this value, the clamp on silu(gate) does not.
    gate = torch.tensor([7.005, 20.0, 1.0, 1.0, -3.0], dtype=torch.float64).float().requires_grad_()
    up = torch.tensor([2.0, 2.0, 9.0, -9.0, 0.5]).requires_grad_()
    out = clamped_swiglu(gate, up, limit, backend=backend)
    g = gate.detach().double()
    silu = g * torch.sigmoid(g)
    expected = torch.stack(
        [
            silu[0] * 2.0,
            torch.tensor(limit * 2.0).double(),
            silu[2] * limit,
            silu[3] * -limit,
            silu[4] * 0.5,
        ]
    ).float()
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert gate.grad[0] != 0 and gate.grad[1] == 0  # silu(20) > limit: no gradient to gate
    assert up.grad[2] == 0 and up.grad[3] == 0  # |up| > limit: no gradient to up
    assert gate.grad[2] != 0 and up.grad[0] != 0


def test_errors_name_the_argument_and_the_values():
    gate, up = _inputs((3, 4), torch.float32)
    with pytest.raises(
        TypeError,
        match=r"clamped_swiglu: up must have gate's dtype \(torch.float32\); got torch.bfloat16",
    ):
        clamped_swiglu(gate, up.bfloat16(), 1.0)
    with pytest.raises(ValueError, match=r"up must have gate's shape \(3, 4\); got \(3, 5\)"):
        clamped_swiglu(gate, torch.randn(3, 5), 1.0)
    with pytest.raises(TypeError, match=r"gate must be"):
        clamped_swiglu(gate.int(), up.int(), 1.0)
    with pytest.raises(TypeError, match=r"Triton path.*float64"):
        clamped_swiglu(gate.double(), up.double(), 1.0, backend="triton")
    with pytest.raises(TypeError, match=r"limit must be a float"):
        clamped_swiglu(gate, up, "7")
    with pytest.raises(ValueError, match=r"limit must not be NaN"):
        clamped_swiglu(gate, up, float("nan"))


def test_empty_inputs_give_empty_outputs_on_every_backend():
    for backend in ("triton", "reference"):
        gate = torch.randn(3, 0, requires_grad=True)
        out = clamped_swiglu(gate, torch.randn(3, 0), 1.0, backend=backend)
        assert out.shape == (3, 0)
        out.sum().backward()
        assert gate.grad.shape == (3, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", triton_kernels.SWEEP_CONFIGS, ids=_config_id)
def test_cuda_sweep_configs_are_bit_identical_to_the_default(cfg):
    gate, up = _inputs((1000, 4096), torch.bfloat16, device="cuda", seed=6)
    grad = torch.randn_like(gate)
    base = triton_kernels.clamped_swiglu_forward(gate, up, 7.0)
    assert torch.equal(triton_kernels.clamped_swiglu_forward(gate, up, 7.0, _config=cfg), base)
    base_grads = triton_kernels.clamped_swiglu_backward(grad, gate, up, 7.0)
    grads = triton_kernels.clamped_swiglu_backward(grad, gate, up, 7.0, _config=cfg)
    for g, b in zip(grads, base_grads, strict=True):
        assert torch.equal(g, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_matches_reference_at_8192x4096(dtype):
    gate, up = _inputs((8192, 4096), dtype, device="cuda")
    g1, u1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = clamped_swiglu(g1, u1, 7.0)
    torch.testing.assert_close(out, reference.clamped_swiglu_forward(gate, up, 7.0), **_tol(dtype))
    grad = torch.randn_like(out)
    out.backward(grad)
    d_gate, d_up = reference.clamped_swiglu_backward(grad, gate, up, 7.0)
    torch.testing.assert_close(g1.grad, d_gate, **_tol(dtype))
    torch.testing.assert_close(u1.grad, d_up, **_tol(dtype))
