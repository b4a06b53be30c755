"""stable_topk: exactly the first k positions of a stable descending sort, ties to the lower position."""

import sys

import pytest
import torch

from sa_kernels import stable_topk
from sa_kernels.stable_topk import reference
from sa_kernels.stable_topk.triton_kernels import (
    LaunchConfig,
    _prefilter_maxima,
    default_config,
    stable_topk_rows,
)
from sa_kernels.testing import run_without_interpreter


def _tied_scores(shape, dtype, seed, device="cpu"):
    """Few distinct values (many exact ties), a run of -inf, signed zeros."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, shape, generator=generator).to(dtype)
    scores[..., 1::7] = float("-inf")
    scores[..., 2::5] = -0.0
    return scores.to(device)


CASES = [
    pytest.param((37,), 5, -1, id="1d-n37-k5"),
    pytest.param((6, 130), 17, -1, id="rows6-n130-k17"),
    pytest.param((3, 4, 61), 61, -1, id="3d-k-equals-n"),
    pytest.param((3, 4, 61), 1, -1, id="3d-k1"),
    pytest.param((50, 9), 4, 0, id="dim0-n50"),
    pytest.param((2, 33, 5), 8, 1, id="middle-dim"),
]


BACKENDS = ["reference", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str
)
@pytest.mark.parametrize(("shape", "k", "dim"), CASES)
def test_equals_the_stable_sort_on_tied_scores(shape, k, dim, dtype, backend):
    scores = _tied_scores(shape, dtype, seed=sum(shape) + k)
    before = scores.clone()
    if backend == "triton" and dtype == torch.float64:
        with pytest.raises(ValueError, match="float32/bfloat16/float16"):
            stable_topk(scores, k, dim, backend=backend)
        return
    got = stable_topk(scores, k, dim, backend=backend)
    expected = reference.stable_topk(scores, k, dim)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)
    assert torch.equal(scores, before), "scores must not be modified"


@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_the_stable_sort_on_random_scores_with_repeated_columns(backend):
    generator = torch.Generator().manual_seed(7)
    scores = torch.randn(9, 301, generator=generator)
    scores[:, 150:] = scores[:, :151]  # every value appears twice: the lower position must win
    got = stable_topk(scores, 100, backend=backend)
    assert torch.equal(got, reference.stable_topk(scores, 100))
    assert (got < 151).sum() >= 50


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_equal_scores_keep_the_first_positions(backend):
    got = stable_topk(torch.full((4, 20), 2.5), 6, backend=backend)
    assert torch.equal(got, torch.arange(6).expand(4, 6))


@pytest.mark.parametrize(
    ("n", "k"),
    [(1, 1), (16, 16), (17, 9), (1025, 512), (2048, 1)],
    ids=["n1", "n16-k-equals-n", "n17-just-past-a-block", "n1025-k512", "n2048-k1"],
)
def test_triton_rows_equal_the_stable_sort_across_block_sizes(n, k):
    """Row lengths on and just past the kernel's power-of-two blocks; extreme magnitudes and -inf;
    the output phase over the whole row and in tiles (ties and kept slots carried across tiles)."""
    generator = torch.Generator().manual_seed(n + k)
    scores = torch.randn(5, n, generator=generator) * torch.logspace(-30, 30, n)
    scores[1] = scores[0].flip(0)
    scores[2, ::3] = float("-inf")
    scores[3] = scores[3].round()  # ties between distinct positions
    expected = reference.stable_topk(scores, k)
    assert torch.equal(stable_topk(scores, k, backend="triton"), expected)
    for config in (LaunchConfig(output_tile=16), LaunchConfig(output_tile=256, prefilter=64)):
        assert torch.equal(stable_topk_rows(scores, k, _config=config), expected), config


def _emulated_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys in the kernel's order (`_order_keys`): -0.0 folded into +0.0, sign-flipped bits."""
    x = scores.float()
    bits = torch.where(x == 0, 0.0, x).view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >= 2**31, (~bits) & 0xFFFFFFFF, bits | 2**31)


def _emulated_kth_key(keys: torch.Tensor, k: int) -> torch.Tensor:
    """`_kth_key_rows` per row, early stop included."""
    prefix = torch.zeros(len(keys), dtype=torch.int64)
    active = torch.ones(len(keys), dtype=torch.bool)
    for shift in range(31, -1, -1):
        candidate = prefix | (1 << shift)
        reaching = (keys >= candidate[:, None]).sum(-1)
        prefix = torch.where(active & (reaching >= k), candidate, prefix)
        active &= reaching != k
    return prefix


def _prefilter_paths(scores: torch.Tensor, k: int, maxima: int) -> torch.Tensor:
    """Which path the prefilter takes per row: 0 = the bound is the k-th key (fewer than k keys above
    it), 1 = the walk over the at most 2k keys above it, 2 = the streamed whole-row walk."""
    keys = _emulated_keys(scores)
    padded = torch.nn.functional.pad(keys, (0, -scores.shape[-1] % maxima), value=0)
    bound = _emulated_kth_key(padded.view(len(scores), -1, maxima).amax(1), k)
    above = (keys > bound[:, None]).sum(-1)
    return torch.where(above < k, 0, torch.where(above <= 2 * k, 1, 2))


@pytest.mark.parametrize(("n", "k", "maxima"), [(300, 17, 64), (1000, 3, 16), (4100, 200, 512)])
def test_prefilter_paths_equal_the_stable_sort(n, k, maxima):
    """Random rows (the narrowed walk), rows sorted ascending (their best keys clustered at the end),
    few distinct values, -inf halves, signed zeros, relu-like rows tied at 0 (the bound is the k-th key),
    large keys packed into few strided groups (more than 2k above the bound: the streamed walk)."""
    generator = torch.Generator().manual_seed(n)
    scores = torch.randn(8, n, generator=generator)
    scores[1] = scores[1].sort().values
    scores[2] = torch.randint(-2, 2, (n,), generator=generator).float()
    scores[3, : n // 2] = float("-inf")
    scores[4] = 0.0
    scores[4, ::3] = -0.0
    scores[5, 7] = 5.0
    scores[6] = torch.relu(scores[6] - 2.5)  # about 0.6 % positive, the rest exactly 0
    packed = torch.arange(n) % maxima < max(1, k // 2)
    scores[7] = torch.where(packed, 10 + scores[7], scores[7])
    paths = _prefilter_paths(scores, k, maxima)
    assert set(paths.tolist()) == {0, 1, 2}, paths  # every path runs
    assert paths[[4, 5, 7]].tolist() == [0, 1, 2], paths  # the rows that lead programs below
    expected = reference.stable_topk(scores, k)
    # streamed in one chunk or in n / maxima of them; chunk loads pipelined or not; several rows per
    # program, whose paths differ
    for tile, chunk, stages, per_program in (
        (0, 2048, 1, 1),
        (64, maxima, 1, 1),
        (64, maxima, 3, 1),
        (64, maxima, 3, 2),
        (0, 2048, 2, 4),
    ):
        config = LaunchConfig(
            output_tile=tile,
            prefilter=maxima,
            prefilter_chunk=chunk,
            prefilter_stages=stages,
            rows_per_program=per_program,
        )
        assert torch.equal(stable_topk_rows(scores, k, _config=config), expected), config
        if per_program == 4:  # a last program with rows past the end, copies of its first row,
            # whose path is the tied (row 4), narrowed (row 5) or streamed (row 7) one
            for rows in (slice(0, 7), slice(1, 8), slice(3, 8)):
                got = stable_topk_rows(scores[rows], k, _config=config)
                assert torch.equal(got, expected[rows]), (config, rows)


@pytest.mark.parametrize("value", [0, 1.5, True])
def test_launch_config_refuses_a_pipeline_depth_or_row_count_below_one(value):
    with pytest.raises(ValueError, match="prefilter_stages must be an int >= 1"):
        LaunchConfig(prefilter_stages=value)
    with pytest.raises(ValueError, match="rows_per_program must be an int >= 1"):
        LaunchConfig(rows_per_program=value)
    with pytest.raises(ValueError, match="rows_per_program must be a power of two; got 3"):
        LaunchConfig(rows_per_program=3)


def test_triton_backend_refuses_rows_longer_than_a_program_holds():
    with pytest.raises(ValueError, match="at most 32768"):
        stable_topk(torch.randn(1, 32769), 4, backend="triton")


def test_k_zero_gives_an_empty_result_of_the_right_shape():
    got = stable_topk(torch.randn(3, 10, 4), 0, dim=1)
    assert got.shape == (3, 0, 4) and got.dtype == torch.int64


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((torch.arange(5), 2), TypeError, "floating-point"),
        (([1.0, 2.0], 1), TypeError, "floating-point"),
        ((torch.randn(5), 2.0), TypeError, "k must be an int"),
        ((torch.randn(5), 6), ValueError, r"k must lie in \[0, 5\]"),
        ((torch.randn(5), -1), ValueError, "k must lie"),
        ((torch.randn(5, 3), 1, 2), ValueError, "dim must lie"),
    ],
    ids=["int-scores", "list-scores", "float-k", "k-above-n", "negative-k", "dim-out-of-range"],
)
def test_invalid_arguments_raise_with_the_reason(args, error, message):
    with pytest.raises(error, match=message):
        stable_topk(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_the_stable_sort_on_cuda_at_real_size(dtype):
    scores = _tied_scores((700, 32771), dtype, seed=11, device="cuda")
    scores[:350] += torch.randn(350, 32771, device="cuda").to(dtype)
    got = stable_topk(scores, 512)
    assert torch.equal(got, reference.stable_topk(scores, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [32768, 16385, 3000, 513, 100, 1], ids=lambda n: f"n{n}")
def test_cuda_triton_rows_equal_the_stable_sort_and_the_torch_path(n, dtype):
    """Every block size the kernel compiles (16 … 32768 entries; 4 warps by default, 8 in the configs
    below), 16-bit rows too."""
    k = min(512, n)
    scores = _tied_scores((600, n), torch.float32, seed=n, device="cuda")
    scores[:300] += torch.randn(300, n, device="cuda")
    scores = scores.to(dtype)
    got = stable_topk(scores, k, backend="triton")
    assert torch.equal(got, reference.stable_topk(scores, k))
    assert torch.equal(got, stable_topk(scores, k, backend="reference"))
    configs = [LaunchConfig(8, 1024, maxima) for maxima in (0, 1024)]
    configs.append(LaunchConfig(4, 2048, 1024, 2048, prefilter_stages=1))  # unpipelined chunk loads
    configs += [LaunchConfig(4, 2048, 1024, rows_per_program=rows) for rows in (2, 4)]
    configs.append(LaunchConfig(8, 2048, 1024, rows_per_program=4))
    for config in configs:
        assert torch.equal(stable_topk_rows(scores, k, _config=config), got), config


def test_workspace_bytes_follow_the_path_that_runs():
    """Zero where the kernel reads the scores in place; the PyTorch path's keys and mask elsewhere."""
    from sa_kernels.stable_topk import TRITON_MAX_ROW, stable_topk_workspace_bytes

    assert stable_topk_workspace_bytes(TRITON_MAX_ROW, torch.float32, "cuda") == 0
    assert stable_topk_workspace_bytes(100, torch.bfloat16, "cuda") == 0
    torch_path = stable_topk_workspace_bytes(100, torch.float32, "cpu")
    assert torch_path >= 5  # int32 keys and a boolean mask at least
    assert stable_topk_workspace_bytes(TRITON_MAX_ROW + 1, torch.float32, "cuda") == torch_path
    assert stable_topk_workspace_bytes(100, torch.float64, "cuda") == torch_path


@pytest.mark.parametrize(
    ("block", "k", "maxima"),
    [
        (2048, 64, 0),
        (4096, 512, 0),
        (8192, 512, 1024),
        (16384, 512, 1024),
        (16384, 1000, 2048),
        (32768, 512, 1024),
        (32768, 2048, 4096),
        (8192, 1000, 2048),
        (8192, 2000, 0),
    ],
    ids=lambda v: str(v),
)
def test_default_launch_narrows_long_rows_with_maxima_sized_from_k(block, k, maxima):
    """The H200-measured defaults (k 512) and their extension to larger k: 2k maxima rounded up to a
    power of two, only where the block holds 4 entries per maximum."""
    assert _prefilter_maxima(default_config(block, k), block, k) == maxima


def _row_kinds(rows: int, n: int, k: int, device: str) -> dict[str, torch.Tensor]:
    """Rows that take every path of the prefilter: the usual narrow selection, a bound that is the
    k-th key (relu zeros, fewer finite scores than k), heavy ties above the bound, clustered scores;
    and rows that the interpolating selection finds hard: Step-5-like head sums and relu scores
    with fewer positives than k, whose zeros tie in bulk at the k-th key, and magnitudes over the
    whole float32 range (subnormals too) with infinities at both ends."""
    generator = torch.Generator().manual_seed(n + k)
    random = torch.randn(rows, n, generator=generator)
    few = torch.full((rows, n), float("-inf"))
    few[:, 7 : 7 + k // 2] = random[:, : k // 2]
    clustered = random - 10.0
    clustered[:, n // 3 : n // 3 + 3 * k] += 12.0
    # k - 1 of the 1024 strided groups hold three 5.0s each and every other group's maximum is
    # 1.0: the bound is 1.0 and 3k - 3 > 2k keys (k > 3) tie above it
    heavy = torch.rand(rows, n, generator=generator) - 1.0
    heavy[:, 3000 : 3000 + 1024] = 1.0 if n >= 4024 else heavy[:, 3000 : 3000 + 1024]
    for copy in range(3):
        heavy[:, copy * 1024 : copy * 1024 + k - 1] = 5.0
    signed = random.clone()
    signed[:, ::3] = -0.0
    signed[:, 1::3] = 0.0
    # sum_h w_h relu(x_h) over 4 heads, most weights negative: scores <= 0 tie at zero in bulk
    heads = torch.randn(4, rows, n, generator=generator).relu()
    weights = torch.randn(4, rows, 1, generator=generator) - 1.0
    head_sums = (weights * heads).sum(0)
    exponents = torch.randint(-149, 128, (rows, n), generator=generator).float()  # subnormals too
    wide = torch.sign(random) * torch.exp2(exponents)
    wide[:, 5::97] = float("inf")
    wide[:, 11::89] = float("-inf")
    # relu scores with fewer positives than k: the k-th key is an exact zero among many
    positives = max(k - 1 - k // 8, 0)
    cut = random.topk(positives + 1, dim=1).values[:, -1:]
    kinds = {
        "random": random,
        "head-sums-tied-at-zero": head_sums,
        "relu-fewer-positives-than-k": (random - cut).relu(),
        "whole-float32-range": wide,
        "relu-zero-ties": (random - 1.5).relu(),
        "fewer-finite-than-k": few,
        "clustered": clustered,
        "heavy-ties-above-bound": heavy,
        "integer-ties": torch.randint(-3, 4, (rows, n), generator=generator).float(),
        "signed-zeros": signed,
    }
    return {name: rows_.to(device) for name, rows_ in kinds.items()}


def _relu_rows_with_nans(rows: int, n: int, k: int) -> torch.Tensor:
    """Rows whose k-th key is an exact zero (k // 2 positives), three NaNs each."""
    generator = torch.Generator().manual_seed(n + k)
    random = torch.randn(rows, n, generator=generator)
    cut = random.topk(k // 2 + 1, dim=1).values[:, -1:]
    scores = (random - cut).relu()
    scores[:, [5, n // 2, n - 3]] = float("nan")
    return scores


def _written_past_k(scores: torch.Tensor, k: int, **options) -> torch.Tensor:
    """stable_topk into the first k slots of rows of width k + 8 filled with -7: the 8 after."""
    buffer = torch.full((scores.shape[0], k + 8), -7, dtype=torch.int64, device=scores.device)
    stable_topk(scores, k, out=buffer[:, :k], **options)
    return buffer[:, k:]


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's maxima
def test_nan_scores_never_write_past_the_output():
    """NaN makes the positions unspecified (documented), but the kernels still write k of them:
    the streamed store of a row whose k-th key is the bound kept NaN keys past the k it counted."""
    for n, k in ((8192, 16), (600, 9)):  # Triton's prefilter (8192 entries), its whole-row walk
        past = _written_past_k(_relu_rows_with_nans(2, n, k), k, backend="triton")
        assert (past == -7).all(), (n, k)


def _written_in_place(scores, k, offset, out_dtype, **options):
    """stable_topk into slots [1, 1 + k) of rows of width k + 2 of a [G, Q + 2] selection-like
    buffer filled with a sentinel: the call's rows are [G, 1:Q+1] (two strides that no single
    stride can merge); returns the buffer."""
    groups, queries, _ = scores.shape
    buffer = torch.full((groups, queries + 2, k + 2), -7, dtype=out_dtype, device=scores.device)
    out = buffer[:, 1 : queries + 1, 1 : k + 1]
    assert stable_topk(scores, k, out=out, offset=offset, **options) is out
    return buffer


def _expected_in_place(scores, k, offset, out_dtype):
    groups, queries, _ = scores.shape
    buffer = torch.full((groups, queries + 2, k + 2), -7, dtype=out_dtype, device=scores.device)
    buffer[:, 1 : queries + 1, 1 : k + 1] = reference.stable_topk(scores, k) + offset
    return buffer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize(("n", "k"), [(40, 5), (5000, 7)], ids=["whole-row", "prefilter"])
def test_out_and_offset_write_the_positions_in_place(n, k, out_dtype, backend):
    scores = _tied_scores((3, 4, n), torch.float32, seed=n)
    got = _written_in_place(scores, k, 1000, out_dtype, backend=backend)
    assert torch.equal(got, _expected_in_place(scores, k, 1000, out_dtype))
    # without out the offset is added too; a negative one as well
    shifted = stable_topk(scores, k, offset=-3, backend=backend)
    assert torch.equal(shifted, reference.stable_topk(scores, k) - 3)


def test_out_is_checked_and_named():
    scores = torch.randn(2, 3, 50)
    good = torch.empty(2, 3, 4, dtype=torch.int32)
    laid_out = r"out must be a tensor with last-dim stride 1 and no overlapping elements"
    with pytest.raises(ValueError, match=laid_out + r" \(torch.int32, shape \(2, 3, 4\)"):
        stable_topk(scores, 4, out=torch.empty(2, 3, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out must be int32 or int64; got torch\.float32"):
        stable_topk(scores, 4, out=good.float())
    with pytest.raises(ValueError, match="out needs dim to be the last dim"):
        stable_topk(scores, 2, dim=1, out=good)
    with pytest.raises(ValueError, match=laid_out):
        stable_topk(scores, 4, out=torch.empty(2, 3, 8, dtype=torch.int32)[..., ::2])
    with pytest.raises(ValueError, match=laid_out):  # every row in the same memory
        stable_topk(scores, 4, out=torch.zeros(1, 1, 4, dtype=torch.int32).expand(2, 3, 4))
    wide = torch.empty(2, 7, 3, 8, dtype=torch.int32)[:, :5:2, :, :4]  # no two dims merge
    with pytest.raises(ValueError, match="viewable as at most two dims"):
        stable_topk(torch.randn(2, 3, 3, 50), 4, out=wide)
    with pytest.raises(ValueError, match=r"offset and offset \+ n must lie in int32's range"):
        stable_topk(scores, 4, out=good, offset=2**31 - 10)
    with pytest.raises(TypeError, match="offset must be an int"):
        stable_topk(scores, 4, offset=1.0)
    # k = 1: the last dim's stride does not matter
    column = torch.full((2, 3, 2), -1, dtype=torch.int64)[..., 1:]
    assert torch.equal(stable_topk(scores, 1, out=column), reference.stable_topk(scores, 1))


def _with_lengths(scores, k, seed):
    """Row lengths over every case (0, below k, k, inside, n, past n; rows with a random one), and
    the scores with large values past them, which `lengths` must make -inf."""
    *lead, n = scores.shape
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, n + 1, lead, generator=generator)
    flat = lengths.view(-1)
    cases = [0, max(k - 1, 0), k, n // 2, n, n + 5]
    flat[: len(cases)] = torch.tensor(cases[: flat.numel()])
    lengths = lengths.to(scores.device)
    positions = torch.arange(n, device=scores.device)
    noisy = torch.where(positions >= lengths.unsqueeze(-1), 1000.0, scores.float()).to(scores.dtype)
    masked = torch.where(positions >= lengths.unsqueeze(-1), float("-inf"), scores.float())
    return noisy, lengths, reference.stable_topk(masked.to(scores.dtype), k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n", "k"), [(40, 5), (5000, 7), (300, 300)], ids=["short", "long", "k=n"])
def test_lengths_make_each_row_minus_inf_past_its_length(n, k, backend):
    scores = _tied_scores((3, 4, n), torch.float32, seed=n + k)
    noisy, lengths, expected = _with_lengths(scores, k, seed=n)
    for given in (lengths, lengths.int()):
        assert torch.equal(stable_topk(noisy, k, lengths=given, backend=backend), expected)
    # the same lengths for every row of a dim: an expanded view; and along another dim
    same_rows = stable_topk(
        noisy[:1].expand(3, 4, n), k, lengths=lengths[:1].expand(3, 4), backend=backend
    )
    assert torch.equal(same_rows, expected[:1].expand(3, 4, k))
    moved = stable_topk(noisy.movedim(-1, 1), k, dim=1, lengths=lengths, backend=backend)
    assert torch.equal(moved, expected.movedim(-1, 1))
    out = torch.full((3, 4, k + 1), -7, dtype=torch.int32)
    stable_topk(noisy, k, lengths=lengths, out=out[..., :k], offset=10, backend=backend)
    assert torch.equal(out[..., :k], (expected + 10).int()) and bool((out[..., k] == -7).all())


@pytest.mark.parametrize(
    ("n", "k", "backend"),
    [(40, 5, "triton"), (300, 300, "triton"), (40, 5, "reference"), (5000, 7, "reference")],
    ids=["short-triton", "k=n-triton", "short-reference", "long-reference"],
)
def test_masked_tail_lengths_give_the_call_without_lengths(n, k, backend):
    """Rows whose entries at or past their length are -inf already: with `masked_tail`, `lengths`
    changes nothing, ties included (-inf and signed zeros before the length, tails that tie with
    them, lengths of 0, below k, negative and past n, whose k is filled from the tail)."""
    scores = _tied_scores((3, 4, n), torch.float32, seed=n + k + 1)
    generator = torch.Generator().manual_seed(n)
    lengths = torch.randint(0, n + 1, (3, 4), generator=generator)
    cases = [0, max(k - 1, 0), k, n // 2, n, n + 5, -3]
    lengths.view(-1)[: len(cases)] = torch.tensor(cases)
    tailed = scores.masked_fill(torch.arange(n) >= lengths.unsqueeze(-1), float("-inf"))
    expected = stable_topk(tailed, k, backend=backend)
    assert torch.equal(expected, reference.stable_topk(tailed, k))
    for given in (lengths, lengths.int(), lengths[:1].expand(3, 4)):
        rows = tailed if given.stride(0) else tailed[:1].expand(3, 4, n)
        want = expected if given.stride(0) else expected[:1].expand(3, 4, k)
        got = stable_topk(rows, k, lengths=given, masked_tail=True, backend=backend)
        assert torch.equal(got, want)
    out = torch.full((3, 4, k + 1), -7, dtype=torch.int32)
    stable_topk(
        tailed, k, lengths=lengths, masked_tail=True, out=out[..., :k], offset=10, backend=backend
    )
    assert torch.equal(out[..., :k], (expected + 10).int()) and bool((out[..., k] == -7).all())
    with pytest.raises(TypeError, match="masked_tail must be a bool"):
        stable_topk(tailed, k, lengths=lengths, masked_tail=1, backend=backend)


def test_lengths_are_checked_and_named():
    scores = torch.randn(2, 3, 50)
    with pytest.raises(ValueError, match=r"lengths must be int32 or int64 of shape \(2, 3\)"):
        stable_topk(scores, 4, lengths=torch.full((2, 3), 7.0))
    with pytest.raises(ValueError, match=r"of shape \(2, 3\) \(scores' shape without dim\)"):
        stable_topk(scores, 4, lengths=torch.full((2, 50), 7))
    with pytest.raises(ValueError, match=r"of shape \(2, 50\)"):
        stable_topk(scores, 2, dim=1, lengths=torch.full((2, 3), 7))
    with pytest.raises(TypeError, match="lengths must be a tensor or None"):
        stable_topk(scores, 4, lengths=[7, 7])
    # dims that no two strides merge are taken too (the Gluon kernels get a contiguous copy)
    wide = torch.randint(0, 60, (2, 7, 3, 8))[:, :5:2, :, 0]
    scores = torch.randn(2, 3, 3, 50)
    masked = torch.where(torch.arange(50) >= wide.unsqueeze(-1), float("-inf"), scores)
    assert torch.equal(stable_topk(scores, 4, lengths=wide), reference.stable_topk(masked, 4))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "k"),
    [(16383, 512), (8192, 512), (3000, 100), (2049, 3), (2048, 512), (4095, 700), (600, 9)],
)
def test_cuda_lengths_on_every_kernel(n, k):
    """The Gluon prefilter and whole-row kernels read only up to each row's length (large values
    past it must not be kept); Triton's walk (600 entries) takes the masked copy. Int64 and int32
    lengths, and the selection's layout: one length per query, expanded over the groups."""
    for name, rows in _row_kinds(48, n, k, "cuda").items():
        for dtype in (torch.float32, torch.bfloat16):
            noisy, lengths, expected = _with_lengths(rows.to(dtype).view(4, 12, n), k, seed=n)
            assert torch.equal(stable_topk(noisy, k, lengths=lengths), expected), (name, dtype)
            assert torch.equal(stable_topk(noisy, k, lengths=lengths.int()), expected), name
            per_query = lengths[:1].expand(4, 12)  # strides (0, 1)
            shared = noisy[:1].expand(4, 12, n).contiguous()
            out = torch.empty(4, 12, k + 1, dtype=torch.int32, device="cuda")
            stable_topk(shared, k, lengths=per_query, out=out[..., :k], offset=3)
            assert torch.equal(out[..., :k].long(), expected[:1].expand(4, 12, k) + 3), name
            # tails that are -inf already: `masked_tail` gives the call without lengths
            past = torch.arange(n, device="cuda") >= lengths.unsqueeze(-1)
            tailed = noisy.masked_fill(past, float("-inf"))
            plain = stable_topk(tailed, k)
            assert torch.equal(plain, expected), name
            assert torch.equal(stable_topk(tailed, k, lengths=lengths, masked_tail=True), plain), (
                name
            )


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(16383, 512), (3000, 100), (2048, 512), (600, 9)])
def test_cuda_out_and_offset_on_every_kernel(n, k):
    # the Gluon prefilter and whole-row kernels (SM90), and Triton's whole-row walk (600 entries)
    for name, rows in _row_kinds(48, n, k, "cuda").items():
        scores = rows.view(4, 12, n)
        got = _written_in_place(scores, k, 4096, torch.int32)
        assert torch.equal(got, _expected_in_place(scores, k, 4096, torch.int32)), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("n", "k"),
    [
        *((16383, 512), (4096, 512), (32768, 100), (8192, 1), (5000, 7)),
        *((3000, 512), (2049, 3)),  # narrowed, at most three entries per group maximum
        *((1024, 1), (2048, 2048), (4095, 700), (2048, 512)),  # held whole
    ],
)
def test_cuda_gluon_kernels_equal_the_stable_sort_on_every_path(n, k, dtype):
    from sa_kernels.stable_topk import gluon_kernel_applies, gluon_kernels

    for name, scores in _row_kinds(64, n, k, "cuda").items():
        scores = scores.to(dtype)
        assert gluon_kernel_applies(scores, k) == (torch.cuda.get_device_capability()[0] == 9)
        expected = reference.stable_topk(scores, k)
        assert torch.equal(gluon_kernels.stable_topk_rows(scores, k), expected), name
        assert torch.equal(stable_topk(scores, k), expected), name


@pytest.mark.gpu
def test_cuda_nan_scores_never_write_past_the_output():
    # the Gluon prefilter (4096, 16384 entries), the whole-row kernel (2048), Triton's walk (600)
    for n, k in ((4096, 512), (16383, 100), (2048, 512), (600, 9)):
        past = _written_past_k(_relu_rows_with_nans(64, n, k).cuda(), k)
        assert (past == -7).all(), (n, k)


@pytest.mark.gpu
def test_cuda_gluon_launch_options_and_strided_rows_give_the_same_positions():
    from sa_kernels.stable_topk import gluon_kernels

    for n, k in ((16383, 512), (3000, 100)):
        wide = torch.randn(96, n + 5, device="cuda")
        scores = wide[:, :n]  # rows 5 entries apart from where a contiguous row would end
        expected = reference.stable_topk(scores, k)
        for options in (
            {},
            {"programs_per_sm": 2},
            {"prefilter_warps": 8},
            {"whole_row_warps": 8},
        ):
            assert torch.equal(gluon_kernels.stable_topk_rows(scores, k, **options), expected), (
                n,
                options,
            )


@pytest.mark.gpu
def test_cuda_gluon_kernels_leave_other_rows_to_triton():
    from sa_kernels.stable_topk import gluon_kernel_applies

    scores = torch.randn(4, 8192, device="cuda")
    assert not gluon_kernel_applies(scores[:, :1023], 5)  # short rows: Triton's whole-row walk
    assert not gluon_kernel_applies(scores, 513)  # 2k above the 1024 survivors' slots
    assert not gluon_kernel_applies(scores.cpu(), 5)


def test_gluon_module_is_imported_once_or_is_none():
    """Dispatch asks for the Gluon kernels on every call: a module that imports comes back as it
    is, one that cannot gives None (not an exception), both from the cache."""
    from sa_kernels.backend import gluon_module

    name = "sa_kernels.stable_topk.triton_kernels"
    assert gluon_module(name) is sys.modules[name]
    assert gluon_module("sa_kernels.stable_topk.no_such_kernels") is None
    hits = gluon_module.cache_info().hits
    assert gluon_module("sa_kernels.stable_topk.no_such_kernels") is None
    assert gluon_module.cache_info().hits == hits + 1  # the failed import is not retried


def test_the_gluon_kernels_take_the_rows_they_were_written_for():
    gluon_kernels = pytest.importorskip("sa_kernels.stable_topk.gluon_kernels")
    from sa_kernels.stable_topk import gluon_kernel_applies

    takes = {
        (1023, 5): False,  # short: the Triton kernel's whole-row walk
        (1024, 5): True,  # held whole
        (4095, 700): True,  # held whole, any k
        (2000, 2001): False,  # k above n
        (2048, 512): True,  # held whole
        (2049, 512): True,  # narrowed: 2k fits the 1024 slots
        (4096, 512): True,
        (4096, 513): False,
        (32768, 512): True,
        (32769, 1): False,  # above TRITON_MAX_ROW
    }
    assert {shape: gluon_kernels.applies(*shape) for shape in takes} == takes
    assert not gluon_kernel_applies(torch.randn(2, 5000), 5)  # CPU rows: never


_COMPILE_GLUON_KERNELS = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from sa_kernels.stable_topk import gluon_kernels as m

pointers = {"scores_ptr": "*fp32", "out_ptr": "*i64", "slots_ptr": "*i32", "lengths_ptr": "*i64"}
prefilter = {"MAXIMA": m.MAXIMA, "RUN": m.RUN, "WARPS": 4}
capped = {"maxnreg": m.SHORT_ROW_REGISTERS}  # how rows of up to SHORT_ROW entries are launched
for kernel, constants, options in (
    (m._stable_topk_prefilter_kernel, prefilter, {}),
    (m._stable_topk_whole_row_kernel, {"RUN": 32, "WARPS": 4}, {}),
    (m._stable_topk_prefilter_kernel, {**prefilter, "HAS_LENGTHS": True}, {}),
    (m._stable_topk_prefilter_kernel, {**prefilter, "HAS_LENGTHS": True}, capped),
    (m._stable_topk_prefilter_kernel, prefilter, capped),
    (m._stable_topk_whole_row_kernel, {"RUN": 32, "WARPS": 4, "HAS_LENGTHS": True}, {}),
):
    constants = {"HAS_LENGTHS": False, **constants}
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32")
        for name in kernel.arg_names
    }
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options}
    )
    assert compiled.asm["cubin"], kernel.__name__
    if options:  # the cap reached ptxas
        assert f".maxnreg {m.SHORT_ROW_REGISTERS}" in compiled.asm["ptx"], "no register cap in the PTX"
print("compiled")
"""


def test_the_gluon_kernels_compile_for_hopper_with_the_installed_triton():
    """Offline, no GPU: both Gluon kernels go through the installed Triton's whole pipeline to a
    cubin for sm_90 (the GPU machine runs Triton 3.6; this runs whatever the lock file installs),
    the prefilter also with the register cap its short rows are launched with.
    In a subprocess without TRITON_INTERPRET, which would turn the kernels into interpreted ones."""
    pytest.importorskip("sa_kernels.stable_topk.gluon_kernels")
    run = run_without_interpreter(_COMPILE_GLUON_KERNELS, timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
