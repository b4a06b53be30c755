"""stable_topk narrowed by group maxima: the same positions as the stable sort, on every path of
`_grouped_row` (held groups, ties at the bound above and below k, rows of few finite scores)."""

import pytest
import torch

from sa_kernels import stable_topk
from sa_kernels.stable_topk import reference
from sa_kernels.stable_topk.reference import group_maxima
from sa_kernels.stable_topk.triton_kernels import LaunchConfig, stable_topk_rows


def _rows(kind: str, rows: int, n: int, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    random = torch.randn(rows, n, generator=generator)
    if kind == "random":
        return random.to(device)
    if kind == "integer-ties":  # the k-th score tied many times, maxima tied too
        return torch.randint(-3, 4, (rows, n), generator=generator).float().to(device)
    if kind == "relu-zero-ties":  # most maxima are 0: more than HELD groups tie at the bound
        return (random - 1.5).relu().to(device)
    if kind == "zeros-and-some-positive":  # a few positives above a floor of zeros, k-th is 0
        scores = torch.zeros(rows, n)
        scores[:, 3 :: max(1, n // (k // 2))] = (
            1.0 + random[:, : len(range(3, n, max(1, n // (k // 2))))]
        )
        return scores.to(device)
    if kind == "few-finite-clustered":  # more than k finite scores in fewer than k groups
        scores = torch.full((rows, n), float("-inf"))
        scores[:, 5 : 5 + k + 9] = random[:, : k + 9]
        return scores.to(device)
    if kind == "fewer-finite-than-k":  # the k-th is -inf
        scores = torch.full((rows, n), float("-inf"))
        scores[:, 7 : 7 + k // 2] = random[:, : k // 2]
        return scores.to(device)
    if kind == "signed-zeros":
        random[:, ::3] = -0.0
        random[:, 1::3] = 0.0
        return random.to(device)
    if kind == "top-tied-k-times":  # the bound equals the row's maximum
        scores = random - 10
        scores[:, 1 :: max(1, n // k)] = 4.0
        return scores.to(device)
    raise ValueError(kind)


KINDS = [
    "random",
    "integer-ties",
    "relu-zero-ties",
    "zeros-and-some-positive",
    "few-finite-clustered",
    "fewer-finite-than-k",
    "signed-zeros",
    "top-tied-k-times",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(300, 16, 8), (257, 32, 2), (1000, 20, 16), (96, 7, 4), (130, 3, 32), (64, 9, 1)],
    ids=lambda v: str(v),
)
def test_grouped_rows_equal_the_stable_sort(kind, n, k, group):
    scores = _rows(kind, 5, n, k, seed=n * 31 + k)
    maxima = group_maxima(scores, group)
    got = stable_topk(scores, k, group_maxima=maxima, group=group, backend="triton")
    assert torch.equal(got, reference.stable_topk(scores, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_grouped_rows_of_16_bit_scores(dtype):
    scores = _rows("integer-ties", 4, 200, 10, seed=3).to(dtype)
    scores[:2] += torch.randn(2, 200).to(dtype)
    got = stable_topk(scores, 10, group_maxima=group_maxima(scores, 4), group=4, backend="triton")
    assert torch.equal(got, reference.stable_topk(scores, 10))


def test_grouped_rows_along_another_dim_and_at_two_warp_counts():
    scores = _rows("random", 3, 150, 12, seed=5).reshape(3, 150, 1).expand(3, 150, 2).clone()
    scores[..., 1] = -scores[..., 1]
    maxima = group_maxima(scores.movedim(1, -1), 4).movedim(-1, 1)
    got = stable_topk(scores, 12, dim=1, group_maxima=maxima, group=4, backend="triton")
    assert torch.equal(got, reference.stable_topk(scores, 12, dim=1))
    rows = scores[..., 0].contiguous()  # the internal launcher takes last-dim stride 1
    for warps in (4, 8):
        config = LaunchConfig(grouped_warps=warps)
        chosen = stable_topk_rows(rows, 12, group_maxima(rows, 4), 4, _config=config)
        assert torch.equal(chosen, reference.stable_topk(rows, 12))


def test_reference_path_ignores_the_maxima_after_checking_them():
    scores = torch.randn(4, 40)
    maxima = group_maxima(scores, 8)
    got = stable_topk(scores, 5, group_maxima=maxima, group=8, backend="reference")
    assert torch.equal(got, reference.stable_topk(scores, 5))


@pytest.mark.parametrize(
    ("maxima", "group", "message"),
    [
        (torch.zeros(4, 4), 8, r"group_maxima must be torch.float32 \[4, 5\]"),
        (torch.zeros(4, 5, dtype=torch.float64), 8, "group_maxima must be"),
        ([0.0] * 5, 8, "got list"),
        (torch.zeros(4, 5), 3, "group must be a power of two"),
        (torch.zeros(4, 1), 64, "group must be a power of two"),
    ],
    ids=["short", "dtype", "not-a-tensor", "group-3", "group-64"],
)
def test_bad_group_maxima_raise_with_the_reason(maxima, group, message):
    with pytest.raises(ValueError, match=message):
        stable_topk(torch.randn(4, 40), 5, group_maxima=maxima, group=group)


def test_group_maxima_reference_pads_the_last_run():
    scores = torch.tensor([[1.0, 5.0, -2.0, 3.0, 7.0], [0.0, -1.0, -3.0, -4.0, -9.0]])
    assert group_maxima(scores, 2).tolist() == [[5.0, 3.0, 7.0], [0.0, -3.0, -9.0]]
    assert group_maxima(scores[:, :0], 4).shape == (2, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [16383, 4100, 32768], ids=lambda n: f"n{n}")
def test_cuda_grouped_rows_equal_the_stable_sort_at_step5_size(kind, n):
    scores = _rows(kind, 300, n, 512, seed=n, device="cuda")
    for group in (4, 8, 16):
        maxima = group_maxima(scores, group)
        got = stable_topk(scores, 512, group_maxima=maxima, group=group)
        assert torch.equal(got, reference.stable_topk(scores, 512)), group
