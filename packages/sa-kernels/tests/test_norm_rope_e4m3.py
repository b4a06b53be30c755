"""rms_norm_rope_e4m3: the fused kernel against the composed oracle, the oracle against the formula."""

import pytest
import torch

from sa_kernels import rms_norm_rope_e4m3
from sa_kernels.e4m3.reference import round_to_e4m3
from sa_kernels.norm_rope_e4m3 import reference, rotate_half_split_, triton_kernels
from sa_kernels.rms_norm import reference as rms_norm_reference

EPS = 1e-5
THETA = 10000.0


def _inputs(tokens, heads, dim, half, dtype, device="cpu", seed=0, signs_only=False):
    gen = torch.Generator().manual_seed(seed)
    if signs_only:  # mean square 1: with eps 0 every rstd is exactly 1 on every backend
        x = torch.randint(0, 2, (tokens, heads, dim), generator=gen).float() * 2 - 1
    else:
        x = torch.randn(tokens, heads, dim, generator=gen) * 3
    w = torch.randn(dim, generator=gen) * 0.3
    positions = torch.randint(0, 200_000, (tokens,), generator=gen)
    inv_freq = THETA ** (-torch.arange(0, 2 * half, 2).float() / max(2 * half, 1))
    angles = positions.float()[:, None] * inv_freq
    to = dict(device=device)
    return x.to(dtype).to(**to), w.to(**to), angles.cos().to(**to), angles.sin().to(**to)


def _within_one_e4m3_step(got, expected, max_fraction):
    got, expected = got.float(), expected.float()
    # one E4M3 step is at most 1/8 of the value; the absolute term covers a rotation that cancels
    # (x1 * cos - x2 * sin near 0 keeps a one-ulp difference of its O(1) inputs)
    far = (got - expected).abs() > 2**-3 * expected.abs() + 2**-7
    assert not far.any(), f"{int(far.sum())} values differ by more than one E4M3 step"
    differ = (got != expected).float().mean().item()
    assert differ <= max_fraction, f"{differ:.2e} of the values differ (allowed {max_fraction})"


def test_oracle_follows_the_formula_element_by_element():
    x, w, cos, sin = _inputs(3, 2, 12, 4, torch.bfloat16, seed=1)
    got = reference.rms_norm_rope_e4m3(x, w, EPS, cos, sin)
    for t in range(3):
        for h in range(2):
            row = x[t, h].float()
            rstd = torch.rsqrt(row.square().mean() + EPS)
            y = (row * rstd * (1 + w.to(torch.bfloat16).float())).to(torch.bfloat16).float()
            expected = y.clone()
            for d in range(4):
                a, b = y[d], y[d + 4]
                expected[d] = a * cos[t, d] - b * sin[t, d]
                expected[d + 4] = b * cos[t, d] + a * sin[t, d]
            expected = round_to_e4m3(expected.to(torch.bfloat16))
            assert torch.equal(got[t, h], expected), (t, h)


@pytest.mark.parametrize(
    ("dtype", "dim", "half", "differ"),
    [
        (torch.float16, 64, 8, 0.02),
        (torch.float32, 48, 24, 0.02),
        (torch.float16, 32, 0, 0.02),
    ],
    # no BF16 here: Triton's interpreter truncates FP32 -> BF16 casts (the GPU tests cover BF16)
    ids=["fp16", "fp32-rope-all-of-48", "fp16-no-rope"],
)
def test_triton_matches_the_oracle(dtype, dim, half, differ):
    x, w, cos, sin = _inputs(37, 3, dim, half, dtype, seed=2)
    got = rms_norm_rope_e4m3(x, w, EPS, cos, sin, backend="triton")
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    # the norm's sum of squares is summed in another order: a rare one-ulp rstd moves a rounding
    _within_one_e4m3_step(got, reference.rms_norm_rope_e4m3(x, w, EPS, cos, sin), differ)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triton_rounds_the_rotation_like_the_oracle_bit_for_bit(device):
    # FP32 rows, no E4M3 rounding: the rotation's own bits, which a fused multiply-add (one
    # rounding of x1 * cos - x2 * sin instead of three) changes in about half the channels; entries
    # +-1 and eps 0 make rstd exactly 1 on both paths. On the CPU the interpreter never fuses: there
    # the test checks the formula and the strided reads.
    x, w, cos, sin = _inputs(64, 4, 64, 16, torch.float32, device, seed=3, signs_only=True)
    strided = torch.cat([x, x[..., :16]], dim=-1)[..., :64]  # heads 80 apart, tokens 320
    got = triton_kernels.rms_norm_rope_e4m3(strided, w, 0.0, cos, sin, _round_e4m3=False)
    normed, _ = rms_norm_reference.rms_norm_forward(strided, w, 0.0, torch.float32, True, True)
    expected = rotate_half_split_(normed, cos[:, None], sin[:, None])
    assert torch.equal(got, expected)
    # and with the E4M3 rounding, as the public op does
    rounded = rms_norm_rope_e4m3(strided, w, 0.0, cos, sin, backend="triton")
    assert torch.equal(rounded, reference.rms_norm_rope_e4m3(strided, w, 0.0, cos, sin))


def test_a_bf16_weight_and_empty_rows_are_accepted():
    x, w, cos, sin = _inputs(5, 2, 32, 4, torch.bfloat16, seed=7)
    expected = reference.rms_norm_rope_e4m3(x, w, EPS, cos, sin)
    for backend in ("reference", "triton"):
        got = rms_norm_rope_e4m3(x, w.to(torch.bfloat16), EPS, cos, sin, backend=backend)
        assert (got.float() - expected.float()).abs().max() <= 2**-3 * expected.float().abs().max()
        empty = rms_norm_rope_e4m3(x[:0], w, EPS, cos[:0], sin[:0], backend=backend)
        assert empty.shape == (0, 2, 32)


@pytest.mark.gpu
def test_cuda_matches_the_oracle_at_the_indexer_shape():
    x, w, cos, sin = _inputs(4096, 16, 256, 16, torch.bfloat16, "cuda", seed=4)
    got = rms_norm_rope_e4m3(x, w, EPS, cos, sin)
    _within_one_e4m3_step(got, reference.rms_norm_rope_e4m3(x, w, EPS, cos, sin), 1e-3)


def test_bad_arguments_are_named():
    x, w, cos, sin = _inputs(4, 2, 16, 4, torch.bfloat16)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        rms_norm_rope_e4m3(x.double(), w, EPS, cos, sin)
    with pytest.raises(TypeError, match="weight must be a floating tensor"):
        rms_norm_rope_e4m3(x, w.int(), EPS, cos, sin)
    with pytest.raises(TypeError, match="cos must be float32"):
        rms_norm_rope_e4m3(x, w, EPS, cos.half(), sin)
    with pytest.raises(ValueError, match=r"x must be \[tokens, heads, dim"):
        rms_norm_rope_e4m3(x[0], w, EPS, cos, sin)
    with pytest.raises(ValueError, match=r"weight must be \[dim=16\]"):
        rms_norm_rope_e4m3(x, w[:8], EPS, cos, sin)
    with pytest.raises(ValueError, match=r"2 \* half <= dim=16"):
        rms_norm_rope_e4m3(x, w, EPS, torch.zeros(4, 9), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="sin must have cos' shape"):
        rms_norm_rope_e4m3(x, w, EPS, cos, sin[:2])
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm_rope_e4m3(x, w, -1.0, cos, sin)
