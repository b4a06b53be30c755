"""rms_norm, rms_norm_with_rstd and grouped_rms_norm: Triton (interpreted on CPU, compiled on CUDA) vs the reference."""

import pytest
import torch

from sa_kernels import grouped_rms_norm, rms_norm, rms_norm_with_rstd

EPS = 1e-5


def _tol(dtype: torch.dtype) -> dict:
    return (
        {"atol": 2e-2, "rtol": 2e-2}
        if dtype in (torch.bfloat16, torch.float16)
        else {"atol": 2e-5, "rtol": 2e-5}
    )


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype).to(device)
    w_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    w = (torch.randn(shape[-1], generator=gen) * 0.2).to(w_dtype).to(device)
    return x, w


CASES = [
    pytest.param((1, 16), torch.float32, torch.float32, id="1x16-fp32"),
    pytest.param((37, 100), torch.bfloat16, torch.bfloat16, id="37x100-bf16"),
    pytest.param((3, 5, 130), torch.float32, torch.bfloat16, id="3x5x130-fp32-residual-to-bf16"),
    pytest.param((6, 257), torch.float16, torch.float16, id="6x257-fp16"),
]


@pytest.mark.parametrize("zero_centered", [True, False], ids=["zero-centred", "plain-weight"])
@pytest.mark.parametrize(("shape", "dtype", "out_dtype"), CASES)
def test_triton_matches_reference_forward_backward_and_rstd(shape, dtype, out_dtype, zero_centered):
    x, w = _inputs(shape, dtype)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, rstd = rms_norm_with_rstd(xt, wt, EPS, out_dtype, zero_centered, backend="triton")
    yr, rstdr = rms_norm_with_rstd(xr, wr, EPS, out_dtype, zero_centered, backend="reference")
    assert y.dtype == out_dtype and y.shape == x.shape and rstd.shape == x.shape[:-1]
    assert not y.isnan().any()
    torch.testing.assert_close(y, yr, **_tol(out_dtype))
    torch.testing.assert_close(rstd, rstdr, atol=1e-6, rtol=1e-5)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(out_dtype)
    (y.float() * grad.float()).sum().backward()
    (yr.float() * grad.float()).sum().backward()
    assert xt.grad.dtype == dtype and wt.grad.dtype == torch.float32
    torch.testing.assert_close(xt.grad, xr.grad, **_tol(dtype))
    torch.testing.assert_close(wt.grad, wr.grad, atol=1e-3 * x.shape[0], rtol=1e-4)


def test_reference_forward_matches_the_textbook_formula_in_float64():
    x, w = _inputs((9, 33), torch.float64)
    expected = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * (1 + w)
    torch.testing.assert_close(rms_norm(x, w, EPS, backend="reference"), expected)


@pytest.mark.parametrize("zero_centered", [True, False], ids=["zero-centred", "plain-weight"])
def test_reference_backward_passes_gradcheck_in_float64(zero_centered):
    x, w = _inputs((4, 7), torch.float64)
    fn = lambda x, w: rms_norm(x, w, EPS, None, zero_centered, backend="reference")
    assert torch.autograd.gradcheck(fn, (x.requires_grad_(), w.requires_grad_()))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_weight_in_activation_dtype_rounds_the_weight_first(backend):
    x, _ = _inputs((11, 64), torch.bfloat16)
    # bf16 values nudged away from zero by far less than half an ulp: round-to-nearest (CUDA, torch) and the
    # interpreter's truncating cast both give the bf16 value back, while the unrounded weight differs.
    w_bf16 = (torch.randn(64, generator=torch.Generator().manual_seed(3)) * 0.37).to(torch.bfloat16)
    w = w_bf16.float() * (1 + 2**-12)
    y = rms_norm(x, w, EPS, torch.float32, weight_in_activation_dtype=True, backend=backend)
    expected = rms_norm(x, w.to(torch.bfloat16).float(), EPS, torch.float32, backend="reference")
    unrounded = rms_norm(x, w, EPS, torch.float32, backend="reference")
    torch.testing.assert_close(y, expected, atol=2e-6, rtol=2e-6)
    assert (y - unrounded).abs().max() > 1e-4


@pytest.mark.parametrize(
    ("tokens", "groups", "heads", "dim"),
    [(5, 3, 4, 48), (7, 1, 2, 130)],
    ids=["T5-G3-H4-D48", "T7-G1-H2-D130"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_grouped_rms_norm_reads_query_rows_of_fused_qkv_in_place(tokens, groups, heads, dim, dtype):
    gen = torch.Generator().manual_seed(4)
    qkv = (
        (torch.randn(tokens, groups * (heads + 2) * dim, generator=gen) * 2)
        .to(dtype)
        .requires_grad_()
    )
    w = (torch.randn(dim, generator=gen) * 0.2).requires_grad_()
    q = qkv.view(tokens, groups, heads + 2, dim)[:, :, :heads].flatten(0, 1)
    assert not q.is_contiguous()
    y = grouped_rms_norm(q, w, EPS, backend="triton")
    q_copy = q.detach().contiguous().requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    yr = rms_norm(q_copy, w_ref, EPS, backend="reference")
    assert y.shape == (tokens * groups, heads, dim) and not y.isnan().any()
    torch.testing.assert_close(y, yr, **_tol(dtype))
    grad = torch.randn(y.shape, generator=gen).to(dtype)
    (y.float() * grad.float()).sum().backward()
    (yr.float() * grad.float()).sum().backward()
    dqkv = qkv.grad.view(tokens, groups, heads + 2, dim)
    assert (dqkv[:, :, heads:] == 0).all()
    torch.testing.assert_close(dqkv[:, :, :heads].flatten(0, 1), q_copy.grad, **_tol(dtype))
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-3 * tokens * groups, rtol=1e-4)


def test_backward_without_weight_grad_returns_no_weight_gradient():
    x, w = _inputs((8, 40), torch.float32)
    x.requires_grad_()
    rms_norm(x, w, EPS, backend="triton").sum().backward()
    assert w.grad is None and x.grad is not None and not x.grad.isnan().any()


def test_errors_name_the_argument_and_the_values():
    x, w = _inputs((4, 8), torch.float32)
    with pytest.raises(
        ValueError, match=r"rms_norm: weight must be \[channels\].*\(8\); got \(9,\)"
    ):
        rms_norm(x, torch.randn(9), EPS)
    with pytest.raises(TypeError, match=r"rms_norm: x must be float32.*torch.int64"):
        rms_norm(torch.ones(4, 8, dtype=torch.int64), w, EPS)
    with pytest.raises(TypeError, match=r"Triton path.*float64"):
        rms_norm(x.double(), w, EPS, backend="triton")
    with pytest.raises(ValueError, match=r"eps must be a finite, non-negative"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match=r"eps must be a finite, non-negative"):
        rms_norm(x, w, float("nan"))
    with pytest.raises(ValueError, match=r"at least one channel"):
        rms_norm(torch.randn(3, 0), torch.randn(0), EPS)
    with pytest.raises(ValueError, match=r"grouped_rms_norm: q must"):
        grouped_rms_norm(x, w, EPS)
    with pytest.raises(ValueError, match=r"channel stride 1"):
        grouped_rms_norm(torch.randn(2, 8, 3).transpose(1, 2), w, EPS)
    with pytest.raises(ValueError, match=r"backend must be"):
        rms_norm(x, w, EPS, backend="cuda")


def test_strided_weights_are_read_as_their_values():
    """A weight view with stride 2 (or an expanded one): the kernels read the weight at unit stride."""
    x, _ = _inputs((5, 8), torch.float32)
    for weight in (torch.randn(16)[::2], torch.full((1,), 0.5).expand(8)):
        want = rms_norm(x, weight.contiguous(), EPS, backend="reference")
        torch.testing.assert_close(rms_norm(x, weight, EPS, backend="triton"), want)
        q = x.view(5, 1, 8)
        got = grouped_rms_norm(q, weight, EPS, backend="triton")
        torch.testing.assert_close(got.view(5, 8), want)


def test_triton_backend_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = _inputs((4, 8), torch.float32)
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1"):
        rms_norm(x, w, EPS, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
    ids=["bf16", "fp32-residual-to-bf16"],
)
def test_cuda_matches_reference_at_8192x4096(dtype, out_dtype):
    x, w = _inputs((8192, 4096), dtype, device="cuda")
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xt, wt, EPS, out_dtype)
    yr = rms_norm(xr, wr, EPS, out_dtype, backend="reference")
    torch.testing.assert_close(y, yr, **_tol(out_dtype))
    grad = torch.randn_like(y)
    y.backward(grad)
    yr.backward(grad)
    torch.testing.assert_close(xt.grad, xr.grad, **_tol(dtype))
    torch.testing.assert_close(wt.grad, wr.grad, atol=1.0, rtol=1e-3)


@pytest.mark.gpu
def test_cuda_grouped_rms_norm_on_fused_qkv_matches_reference():
    tokens, groups, heads, dim = 4096, 4, 16, 192
    qkv = torch.randn(tokens, groups * (heads + 2) * dim, device="cuda").to(torch.bfloat16)
    w = torch.randn(dim, device="cuda") * 0.2
    grads = []
    for backend in ("auto", "reference"):
        qkv_leaf = qkv.clone().requires_grad_()
        w_leaf = w.clone().requires_grad_()
        q = qkv_leaf.view(tokens, groups, heads + 2, dim)[:, :, :heads].flatten(0, 1)
        y = grouped_rms_norm(q, w_leaf, EPS, backend=backend)
        y.backward(
            torch.randn(
                y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5)
            ).to(y.dtype)
        )
        grads.append((y, qkv_leaf.grad, w_leaf.grad))
    (y, dqkv, dw), (y_ref, dqkv_ref, dw_ref) = grads
    torch.testing.assert_close(y, y_ref, **_tol(torch.bfloat16))
    torch.testing.assert_close(dqkv, dqkv_ref, **_tol(torch.bfloat16))  # K/V rows: zero in both
    torch.testing.assert_close(dw, dw_ref, atol=1.0, rtol=1e-3)
