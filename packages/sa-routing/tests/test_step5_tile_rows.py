"""write_tile_rows: the Triton kernel (interpreted on CPU) against its PyTorch path."""

import pytest
import torch

from sa_routing.step5.tile_rows import write_tile_rows


@pytest.mark.parametrize("in_place", [False, True], ids=["kept-given", "kept-in-place"])
@pytest.mark.parametrize("narrow", [True, False], ids=["dense-ids-narrower", "dense-ids-full"])
@pytest.mark.parametrize("offset", [0, 37])
@pytest.mark.parametrize("topk", [1, 5, 8])
def test_kernel_writes_the_tiles_rows_as_the_pytorch_path_does(
    topk: int, offset: int, narrow: bool, in_place: bool
) -> None:
    gen = torch.Generator().manual_seed(topk + offset)
    groups, queries, n, q0 = 3, 20, 11, 6
    before = torch.randint(
        -5, 500, (2, groups, queries, topk + 1), generator=gen, dtype=torch.int32
    )
    # kept positions as the selection holds them: a gather's output, here a transposed (strided) view
    kept = torch.randint(0, 300, (n, groups, topk), generator=gen).transpose(0, 1)
    assert not kept.is_contiguous()
    current = torch.randint(300, 400, (n,), generator=gen)
    sparse = torch.rand(n, generator=gen) < 0.6
    sparse[0], sparse[-1] = True, False
    width = max(1, topk - 2) if narrow else topk + 1  # narrower: the slots past it get the fill
    dense = torch.randint(0, 300, (queries, width), generator=gen, dtype=torch.int32)[q0 : q0 + n]
    fill = 999
    outs = {}
    for backend in ("reference", "triton"):
        out = before.clone()
        if in_place:  # as stable_topk(out=..., offset=...) leaves them
            out[1, :, q0 : q0 + n, :topk] = (kept + offset).int()
        given = None if in_place else kept
        write_tile_rows(out, 1, q0, given, offset, current, sparse, dense, fill, backend=backend)
        outs[backend] = out
    assert torch.equal(outs["triton"], outs["reference"])
    out = outs["triton"]
    rows = out[1, :, q0 : q0 + n]
    assert torch.equal(rows[:, sparse, :topk], (kept[:, sparse] + offset).int())
    assert torch.equal(rows[:, sparse, topk], current[sparse].int().expand(groups, -1))
    assert torch.equal(rows[:, ~sparse, :width], dense[~sparse].expand(groups, -1, -1))
    assert (rows[:, ~sparse, width:] == fill).all()
    untouched = torch.ones_like(out, dtype=torch.bool)
    untouched[1, :, q0 : q0 + n] = False
    assert torch.equal(out[untouched], before[untouched])


def test_an_empty_tile_writes_nothing() -> None:
    out = torch.zeros(1, 2, 4, 3, dtype=torch.int32)
    empty = torch.empty(2, 0, 2, dtype=torch.int64)
    none = torch.empty(0, dtype=torch.int64)
    dense = torch.empty(0, 3, dtype=torch.int32)
    write_tile_rows(out, 0, 4, empty, 3, none, none.bool(), dense, 9, backend="triton")
    assert not out.any()


def test_ids_in_place_over_several_row_blocks_and_slot_chunks() -> None:
    # 300 rows: three blocks of the in-place kernel; 151 slots: two chunks of its dense copy
    gen = torch.Generator().manual_seed(3)
    groups, n, topk = 2, 300, 150
    before = torch.randint(0, 10_000, (1, groups, n, topk + 1), generator=gen, dtype=torch.int32)
    current = torch.randint(0, 10_000, (n,), generator=gen)
    sparse = torch.rand(n, generator=gen) < 0.9
    sparse[250:] = True  # the last block holds no dense row
    dense = torch.randint(0, 10_000, (n, topk + 1), generator=gen, dtype=torch.int32)
    outs = []
    for backend in ("reference", "triton"):
        out = before.clone()
        write_tile_rows(out, 0, 0, None, 0, current, sparse, dense, -1, backend=backend)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    rows = outs[1][0]
    assert torch.equal(rows[:, sparse, :topk], before[0][:, sparse, :topk])
    assert torch.equal(rows[:, sparse, topk], current[sparse].int().expand(groups, -1))
    assert torch.equal(rows[:, ~sparse], dense[~sparse].expand(groups, -1, -1))
