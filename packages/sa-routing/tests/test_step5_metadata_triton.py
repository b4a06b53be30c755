"""region_metadata's Triton kernels (interpreted on CPU, and on CUDA) against its PyTorch path."""

import dataclasses

import pytest
import torch
from step5_cases import document_positions

from sa_routing import region_metadata
from sa_routing.step5.layouts import CausalDocumentLayout, RegionMetadata


def assert_same_metadata(got: RegionMetadata, expected: RegionMetadata) -> None:
    for field in dataclasses.fields(RegionMetadata):
        a, b = getattr(got, field.name), getattr(expected, field.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), field.name
        elif isinstance(b, CausalDocumentLayout):
            assert isinstance(a, CausalDocumentLayout), field.name
            for part in dataclasses.fields(CausalDocumentLayout):
                x, y = getattr(a, part.name), getattr(b, part.name)
                same = torch.equal(x.cpu(), y.cpu()) if isinstance(y, torch.Tensor) else x == y
                assert same, f"{field.name}.{part.name}: {x} != {y}"
        else:
            assert a == b, field.name


def random_rows(
    gen: torch.Generator, batch: int, length: int, interior_padding: bool, tail: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of random lengths, a padding tail (unless `tail` is False: every token valid), and
    (optionally) padding tokens between valid ones, which keep their documents' positions counting."""
    rows_pos, rows_pad = [], []
    for _ in range(batch):
        valid = int(torch.randint(0, length + 1, (1,), generator=gen)) if tail else length
        lengths, left = [], valid
        while left:
            n = int(torch.randint(1, left + 1, (1,), generator=gen))
            lengths.append(n)
            left -= n
        pos, pad = document_positions(lengths, length)
        if interior_padding and valid > 2:
            at = torch.randint(0, valid, (max(1, valid // 6),), generator=gen)
            pos = pos.clone()
            keep = torch.ones(length, dtype=torch.bool)
            keep[at] = False
            # drop the chosen tokens from the documents: positions of the kept ones recount
            pad = pad | ~keep
            counted = torch.zeros_like(pos)
            run = -1
            for t in range(length):
                if pad[t]:
                    continue
                run = 0 if pos[t] == 0 or run < 0 else run + 1
                counted[t] = run
            pos = torch.where(pad, 0, counted)
        rows_pos.append(pos)
        rows_pad.append(pad)
    return torch.stack(rows_pos), torch.stack(rows_pad)


@pytest.mark.parametrize("interior_padding", [False, True], ids=["tail-padding", "any-padding"])
@pytest.mark.parametrize("seed", range(6))
def test_kernels_build_the_pytorch_paths_metadata(seed: int, interior_padding: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = 1 + seed % 3
    length = int(torch.randint(1, 2600, (1,), generator=gen))  # several 1024-token scan blocks
    pos, pad = random_rows(gen, batch, length, interior_padding)
    query_start = int(torch.randint(0, length, (1,), generator=gen))
    queries = int(torch.randint(1, length - query_start + 1, (1,), generator=gen))
    options = {
        "region_size": int(torch.randint(1, 9, (1,), generator=gen)),
        "topk": int(torch.randint(1, 40, (1,), generator=gen)),
        "window": [None, 5, 300][seed % 3],
        "tile_size": [128, 7, 64][seed % 3],
    }
    # the same layout with padding, and documents filling every token without (no padding mask)
    full_pos, _ = random_rows(gen, batch, length, interior_padding=False, tail=False)
    for positions, padding in ((pos, pad), (full_pos, None)):
        args = (positions, padding, query_start, queries)
        expected = region_metadata(*args, **options, backend="reference")
        assert_same_metadata(region_metadata(*args, **options, backend="triton"), expected)


def test_kernels_without_padding_with_a_fully_padded_shard_and_padding_across_scan_blocks() -> None:
    pos, pad = document_positions([300, 1, 900, 5], 1300)
    # one document of 2000 valid tokens, padding at tokens 1020..1030: the scan's second block
    # must carry the last valid token of the first (its position continues from 1019)
    across = torch.zeros(2011, dtype=torch.bool)
    across[1020:1031] = True
    across_pos = torch.zeros(2011, dtype=torch.int64)
    across_pos[~across] = torch.arange(2000)
    cases = [
        (pos[None, :1206], None, 0, 1206),
        (pos[None], pad[None], 1206, 94),
        (pos[None], pad[None], 100, 1200),
        (across_pos[None], across[None], 0, 2011),
    ]
    for positions, padding, start, queries in cases:
        for window in (None, 64):
            args = (positions, padding, start, queries, 4, 16, window)
            assert_same_metadata(
                region_metadata(*args, backend="triton"),
                region_metadata(*args, backend="reference"),
            )


@pytest.mark.parametrize(
    ("pos", "pad", "match"),
    [
        ([[0, 1, -2, 3]], None, "must be >= 0"),
        ([[0, 1, 3, 4]], None, "count up by one"),
        ([[1, 2, 3, 4]], None, "count up by one"),
        ([[0, 5, 1, 2]], [[False, True, False, False]], "right-padded tail"),
    ],
)
def test_kernels_raise_the_pytorch_paths_errors(pos: list, pad: list | None, match: str) -> None:
    positions = torch.tensor(pos)
    padding = None if pad is None else torch.tensor(pad)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match=match):
            region_metadata(
                positions, padding, 0, 4, 2, 1, require_varlen_layout=True, backend=backend
            )


@pytest.mark.gpu
def test_cuda_kernels_build_the_pytorch_paths_metadata_at_128k() -> None:
    lengths = [16384 + 37 * (i - 4) for i in range(8)]
    total = sum(lengths) + 512
    pos, pad = document_positions(lengths, total)
    pos, pad = pos[None].cuda(), pad[None].cuda()
    for query_start, queries in ((0, total), (total // 4, total // 4)):
        args = (pos, pad, query_start, queries, 8, 512, 512)
        assert_same_metadata(
            region_metadata(*args, backend="auto"), region_metadata(*args, backend="reference")
        )
