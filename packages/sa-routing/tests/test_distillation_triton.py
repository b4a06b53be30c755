"""The Triton path of the indexer distillation losses: its kernels against explicit float64 sums, its
losses and gradients against the float64 oracle (documents, padding, CP shards, repeated and invalid
ids), and on CUDA against the blockwise PyTorch path at the reference geometries."""

import pytest
import torch
from distillation_cases import assert_matches_oracle, seeded
from step5_cases import document_positions

from sa_kernels.backend import triton_interpret
from sa_kernels.testing import spread_copy
from sa_routing import (
    csa_indexer_distillation_loss,
    qsa_indexer_distillation_loss,
    region_metadata,
    select_qsa_token_ids,
    select_regions,
)
from sa_routing.distillation.reference import (
    csa_indexer_distillation_loss_reference,
    qsa_indexer_distillation_loss_reference,
)
from sa_routing.distillation.triton_kernels import dense_lse, dense_mass, sparse_mass
from sa_routing.qsa.lengths import packed_block_starts
from sa_routing.step5.selection.reference import reference_select_regions

MODES = ["dense_warmup", "sparse"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- kernels against explicit sums ---------------------------------------------------------------


def _check_slot_kernels(
    weighted: bool, heads: int, dim: int, device: str, tolerance: float, group_stride: int = 0
) -> None:
    """The slot kernels on `device` against autograd of the explicit float64 sum; with
    `group_stride`, the slot ids and validity are views whose groups lie that many elements apart
    (tiles of a long sequence's `[G, Q, K]` slot layout)."""
    from sa_routing.distillation.slot_logits import slot_grads, slot_logits

    gen = seeded(11)
    rows, groups, units, slots = 5, 3, 9, 37
    queries = torch.randn(rows, heads, groups, dim, generator=gen, dtype=torch.float64)
    queries = queries.transpose(1, 2).requires_grad_()
    weights = None
    if weighted:
        weights = torch.rand(rows, groups, heads, generator=gen, dtype=torch.float64)
        weights.requires_grad_()
    keys = torch.randn(units + 2, dim, generator=gen, dtype=torch.float64)  # U' > U rows
    keys.requires_grad_()
    ids = torch.randint(0, units + 3, (groups, rows, slots), generator=gen, dtype=torch.int32)
    valid = torch.rand(groups, rows, slots, generator=gen) < 0.7
    valid[0, 1] = False  # a row without a valid slot
    scale = 0.3
    # validity with other strides than the ids (copied to one layout)
    strided = valid if weighted else valid.transpose(0, 1).contiguous().transpose(0, 1)
    on = lambda t: None if t is None else t.detach().to(device, torch.float32)
    slot_args = (ids.to(device), strided.to(device))
    if group_stride:
        slot_args = tuple(spread_copy(t, 0, group_stride) for t in slot_args)
    kernel_args = (on(queries), on(weights), scale, on(keys), *slot_args)
    logits = slot_logits(*kernel_args, count=units)
    picked = keys[ids.long().clamp_max(units - 1)]  # [G, rows, K, Di]
    dots = queries.transpose(0, 1) @ picked.transpose(-1, -2)  # [G, rows, Hi, K]
    coefficient = scale if weights is None else weights.transpose(0, 1)[..., None]
    want = torch.where(valid, (torch.relu(dots) * coefficient).sum(dim=2), 0.0)
    close = dict(rtol=tolerance, atol=tolerance, check_device=False, check_dtype=False)
    torch.testing.assert_close(logits, want.detach(), **close)
    d_logits = torch.randn(valid.shape, generator=gen, dtype=torch.float64) * valid
    inputs = (queries, keys) + ((weights,) if weighted else ())
    expected = torch.autograd.grad(want, inputs, d_logits)
    d_queries = torch.full((rows, groups, heads, dim), float("nan"), device=device)  # overwritten
    d_weights = torch.full((rows, groups, heads), float("nan"), device=device) if weighted else None
    d_keys = torch.ones(units + 2, dim, device=device)  # added to
    slot_grads(
        *kernel_args, on(d_logits), d_queries, d_weights, d_keys, count=units,
    )  # fmt: skip
    torch.testing.assert_close(d_queries, expected[0], **close)
    torch.testing.assert_close(d_keys - 1, expected[1], **close)
    if weighted:
        torch.testing.assert_close(d_weights, expected[2], **close)
    assert expected[1][units:].abs().max() == 0 and expected[1][units - 1].abs().max() > 0


@pytest.mark.parametrize(
    ("heads", "dim"),
    [(3, 20), (4, 130), (17, 20)],
    ids=["broadcast-products", "broadcast-products-8-slots-a-step", "dots"],
)
@pytest.mark.parametrize("weighted", [True, False], ids=["head-weights", "one-scale"])
def test_slot_logits_and_grads_equal_autograd_of_the_explicit_sum(weighted, heads, dim) -> None:
    """Invalid slots, an id past the unit count (read as the last unit), strided index queries,
    index heads and dims that are not powers of two, more slots than one step; few index heads take
    the broadcast products, many the dots."""
    _check_slot_kernels(weighted, heads, dim, "cpu", 1e-5)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("heads", "dim"), [(4, 256), (17, 130)], ids=["broadcast", "dots"])
def test_cuda_slot_logits_and_grads_are_fp32_accurate(heads, dim) -> None:
    """Both forms on the GPU stay within FP32-level error of the float64 sums."""
    _check_slot_kernels(True, heads, dim, "cuda", 1e-4)


@pytest.mark.gpu
@cuda
def test_cuda_slot_kernels_read_group_offsets_past_int32() -> None:
    """Slot ids whose group offsets pass 2**31 elements, as a tile of the `[G, Q, K]` slot layout
    does at 4 groups, top-2048 and 350k local queries."""
    _check_slot_kernels(True, 4, 256, "cuda", 1e-4, group_stride=2**30 + 64)


def _check_dense_tile_kernels(
    weighted: bool, heads: int, dim: int, device: str, tolerance: float
) -> None:
    """The dense warm-up's tile kernels on `device` against autograd of the explicit float64 KL."""
    from sa_routing.distillation.dense_logits import dense_tile_loss

    gen = seeded(13 + heads)
    rows, groups, units, scale = 70, 2, 75, 0.3  # five query blocks, two unit steps
    queries = torch.randn(rows, heads, groups, dim, generator=gen, dtype=torch.float64)
    queries = queries.transpose(1, 2).requires_grad_()  # strided
    weights = None
    if weighted:
        weights = torch.rand(rows, groups, heads, generator=gen, dtype=torch.float64)
        weights.requires_grad_()
    keys = torch.randn(units, dim, generator=gen, dtype=torch.float64).requires_grad_()
    # causal-looking candidate runs, a row without candidates, one whose target has no mass
    stop = torch.clamp(torch.arange(rows) * units // rows + 3, max=units)
    start = torch.randint(0, 4, (rows,), generator=gen).minimum(stop)
    stop[7] = start[7]
    unit = torch.arange(units)
    candidates = (unit >= start[:, None]) & (unit < stop[:, None])  # [rows, units]
    mass = torch.rand(groups, rows, units, generator=gen, dtype=torch.float64) * candidates
    mass[:, :, ::5] = 0  # zero-mass candidates
    mass[1, 9] = 0
    target = mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-300)
    row_weight = (torch.rand(groups, rows, generator=gen, dtype=torch.float64) < 0.8) * 0.5
    row_weight[1, 9] = 0  # the loss weight of a row without mass
    dots = queries.permute(1, 2, 0, 3) @ keys.t()  # [G, Hi, rows, units]
    coefficient = scale if weights is None else weights.permute(1, 2, 0)[..., None]
    logits = (torch.relu(dots) * coefficient).sum(dim=1)  # [G, rows, units]
    log_p = torch.log_softmax(logits.masked_fill(~candidates, float("-inf")), dim=-1)
    kl = torch.where(target > 0, target * (target.clamp_min(1e-300).log() - log_p), 0.0).sum(-1)
    want = (kl * row_weight).sum()
    inputs = (queries, keys) + ((weights,) if weighted else ())
    expected = torch.autograd.grad(want, inputs)
    on = lambda t: None if t is None else t.detach().to(device, torch.float32)
    d_queries = torch.ones(rows, groups, heads, dim, device=device)  # the gradients are added
    d_weights = torch.ones(rows, groups, heads, device=device) if weighted else None
    d_keys = torch.ones(units, dim, device=device)
    got = dense_tile_loss(
        on(queries), on(weights), scale, on(keys), on(target), start.to(device, torch.int32),
        stop.to(device, torch.int32), on(row_weight), d_queries, d_weights, d_keys,
    )  # fmt: skip
    close = dict(rtol=tolerance, atol=tolerance, check_device=False, check_dtype=False)
    torch.testing.assert_close(got, want.detach(), **close)
    torch.testing.assert_close(d_queries - 1, expected[0], **close)
    torch.testing.assert_close(d_keys - 1, expected[1], **close)
    if weighted:
        torch.testing.assert_close(d_weights - 1, expected[2], **close)
    assert expected[0][7].abs().max() == 0 and expected[0][8:].abs().max() > 0
    loss_only = dense_tile_loss(
        on(queries), on(weights), scale, on(keys), on(target), start.to(device, torch.int32),
        stop.to(device, torch.int32), on(row_weight), None, None, None,
    )  # fmt: skip
    torch.testing.assert_close(loss_only, got, rtol=0, atol=0)


@pytest.mark.parametrize("three_tf32", [False, True], ids=["fp32", "3xtf32-split"])
@pytest.mark.parametrize(("heads", "dim"), [(3, 20), (4, 16)], ids=["Hi3-Di20", "Hi4-Di16"])
@pytest.mark.parametrize("weighted", [True, False], ids=["head-weights", "one-scale"])
def test_dense_tile_loss_and_grads_equal_autograd_of_the_explicit_kl(
    weighted, heads, dim, three_tf32, monkeypatch
) -> None:
    """Strided index queries, index heads and dims that are not powers of two, candidate runs that
    start anywhere, zero-mass candidates, a row without candidates and one without mass, partial
    query and unit blocks, a unit count padded to the GEMM alignment; the loss alone equals the loss
    with gradients. `three_tf32` takes the CUDA default's split path (the kernel writes d_dot in
    TF32 and low parts; on the CPU each part's product is FP32)."""
    from sa_routing.distillation import dense_logits

    monkeypatch.setattr(dense_logits, "_three_tf32", lambda tensor: three_tf32)
    _check_dense_tile_kernels(weighted, heads, dim, "cpu", 1e-5)


def test_tf32_matmuls_restore_the_precision_setting_as_it_was() -> None:
    """Inside, CUDA FP32 matmuls may use TF32; after, the setting is the caller's again, "none"
    (inherit) included, so that a later global `torch.backends.fp32_precision` still applies."""
    from sa_kernels.backend import cuda_matmuls_use_tf32
    from sa_routing.distillation.dense_logits import _tf32_matmuls

    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        for setting in ("none", "ieee"):
            matmul.fp32_precision = setting
            with _tf32_matmuls():
                assert cuda_matmuls_use_tf32()
            assert matmul.fp32_precision == setting and not cuda_matmuls_use_tf32()
        matmul.fp32_precision = "none"
        with pytest.raises(RuntimeError, match="inside"), _tf32_matmuls():
            raise RuntimeError("inside")
        assert matmul.fp32_precision == "none"
    finally:
        matmul.fp32_precision = saved


def test_tf32_parts_keep_22_bits_of_every_fp32() -> None:
    """hi and lo are TF32 values (10 mantissa bits); hi is the nearest to x, lo to the rest, and
    x − hi − lo is within 2⁻²² |x|."""
    from sa_routing.distillation.dense_logits import _tf32_parts

    x = torch.randn(4096, generator=seeded(3)) * torch.logspace(-20, 20, 4096)
    hi, lo = _tf32_parts(x)
    for part in (hi, lo):
        assert torch.all(part.view(torch.int32) & 0x1FFF == 0)
    assert ((x - hi).abs() <= x.abs() * 2.0**-11).all()  # nearest: half a TF32 ulp
    assert ((x - hi - lo).abs() <= x.abs() * 2.0**-22).all()
    assert (x - hi).abs().max() > 0 and lo.abs().max() > 0
    # NaN (CUDA's canonical 0x7FFFFFFF and its negative), ±inf, zeros, a value that rounds up past
    # the largest TF32 value, and a subnormal
    bits = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32)
    special = torch.cat(
        [
            bits.view(torch.float32),
            torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38]),
            torch.tensor([1e-40]),
        ]
    )
    hi, lo = _tf32_parts(special)
    assert hi[:3].isnan().all() and torch.equal(hi[3:5], special[3:5])
    assert torch.equal(lo[:5], torch.zeros(5)) and torch.equal(hi[5:7], special[5:7])
    near_max = special[7:9]
    assert hi[7:9].isfinite().all() and lo[7:9].isfinite().all()
    assert (((near_max - hi[7:9]) - lo[7:9]).abs() <= near_max.abs() * 2.0**-22).all()
    assert hi[9:].isfinite().all() and lo[9:].isfinite().all()  # subnormal: no bound claimed
    assert torch.all(hi[3:].view(torch.int32) & 0x1FFF == 0)
    assert torch.all(lo.view(torch.int32) & 0x1FFF == 0)


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpret()), reason="needs CUDA or TRITON_INTERPRET=1"
)
def test_split_rows_kernel_writes_the_tf32_parts_bit_for_bit() -> None:
    """`_split_rows`' kernel writes exactly the parts of `_tf32_parts`, side by side in the asked
    order, on a ragged, row-strided block (rows and columns off the kernel's block) with NaN, ±inf,
    zeros, subnormals and values that round past the largest TF32."""
    from sa_routing.distillation.dense_logits import _HI, _LO, _split_rows, _tf32_parts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(37, 70, generator=seeded(5)) * torch.logspace(-30, 30, 70)
    special = torch.tensor([0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32).view(torch.float32)
    x[3, :3] = special
    x[5, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38])
    x[7, :2] = torch.tensor([1e-40, -1e-45])  # subnormals
    # a row-strided view: the kernel reads rows at their stride, not at the column count
    x = torch.cat((torch.randn(37, 10, generator=seeded(6)), x), dim=1).to(device)[:, 10:]
    hi, lo = _tf32_parts(x.cpu())
    for parts in ((_HI, _HI, _LO), (_HI, _LO, _HI), (_HI, _LO)):
        got = _split_rows(x, parts).cpu().view(torch.int32)
        want = torch.cat([(hi, lo)[part] for part in parts], dim=1).view(torch.int32)
        assert torch.equal(got, want), parts


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("heads", "dim"), [(4, 256), (4, 128)], ids=["csa", "qsa"])
def test_cuda_dense_tile_loss_and_grads_are_fp32_accurate(heads, dim) -> None:
    """The 3xTF32 GEMMs and the kernel on the GPU (PyTorch's default "highest" FP32 matmul precision)
    stay within FP32-level error of the float64 KL."""
    assert torch.get_float32_matmul_precision() == "highest"
    _check_dense_tile_kernels(True, heads, dim, "cuda", 1e-4)
    assert torch.get_float32_matmul_precision() == "highest"  # restored after the TF32 GEMMs


def _documents(lengths: list[int], total: int) -> torch.Tensor:
    """int64 [S]: document of every row (documents packed in order, then -1 padding)."""
    docs = torch.full((total,), -1, dtype=torch.int64)
    start = 0
    for d, n in enumerate(lengths):
        docs[start : start + n] = d
        start += n
    return docs


def _explicit_probabilities(query, key, docs, query_start, scale):
    """float64 [Q, H, S] softmax of every head over its visible keys (0 for padding queries)."""
    queries, heads = query.shape[:2]
    per_kv = heads // key.shape[1]
    scores = torch.einsum("qhd,shd->qhs", query.double(), key.double().repeat_interleave(per_kv, 1))
    rows = torch.arange(query_start, query_start + queries)
    qdoc = docs[rows]
    visible = (docs[None, :] == qdoc[:, None]) & (torch.arange(len(docs))[None, :] <= rows[:, None])
    visible &= qdoc[:, None] >= 0
    scores = (scores * scale).masked_fill(~visible[:, None], float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(probabilities, nan=0.0), visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "groups", "dim"),
    [(6, 2, 1, 24), (4, 1, 2, 16), (8, 4, 4, 40)],
    ids=["H6-kv2-G1-D24", "H4-kv1-G2-D16", "H8-kv4-G4-D40"],
)
def test_dense_kernels_equal_explicit_softmax_mass_per_unit(dtype, heads, kv_heads, groups, dim):
    """LSE of every head over its document's causal keys, and the mass each route group's heads put
    on each unit of 3 (c = 3: one padded slot per unit), restricted to each query's candidates; a
    CP-style shard (queries from row 9) with documents 17 + 13 and 6 padding rows."""
    total, query_start, queries, scale = 36, 9, 27, 0.3
    g = seeded(heads * 10 + dim)
    query = torch.randn(1, queries, heads, dim, generator=g).to(dtype)
    key = torch.randn(1, total, kv_heads, dim, generator=g).to(dtype)
    docs = _documents([17, 13], total)
    starts = torch.tensor([0] * 17 + [17] * 13 + [30] * 6)
    rows = torch.arange(query_start, query_start + queries)
    lse = dense_lse(
        query,
        key,
        docs[None],
        docs[rows][None],
        starts[rows][None],
        query_start=query_start,
        softmax_scale=scale,
    )
    probabilities, visible = _explicit_probabilities(query[0], key[0], docs, query_start, scale)
    scores = torch.einsum(
        "qhd,shd->qhs", query[0].double(), key[0].double().repeat_interleave(heads // kv_heads, 1)
    )
    want = torch.logsumexp((scores * scale).masked_fill(~visible[:, None], float("-inf")), dim=-1)
    live = docs[rows] >= 0
    torch.testing.assert_close(lse[0][live].double(), want[live], rtol=1e-5, atol=1e-5)
    assert torch.isinf(lse[0][~live]).all()

    # units: complete groups of 3 of each document; unit u of rows [first(u), first(u) + 3)
    firsts = [*range(0, 15, 3), *range(17, 29, 3)]
    unit_rows = torch.tensor([[f, f + 1, f + 2, -1] for f in firsts], dtype=torch.int32)
    unit_doc = docs[unit_rows[:, 0].long()]
    # candidates: a query's own document's units that end at or before it; one query has none
    cand_start = torch.where(docs[rows] == 0, 0, 5)
    cand_stop = torch.tensor(
        [
            max(
                (
                    u + 1
                    for u in range(len(firsts))
                    if unit_doc[u] == docs[r] and firsts[u] + 2 <= r
                ),
                default=0,
            )
            for r in rows.tolist()
        ]
    )
    cand_stop = torch.maximum(cand_stop, cand_start)
    q0, q1, u0, u1 = 2, 25, 1, 9
    mass = dense_mass(
        query[0],
        key[0],
        lse[0],
        unit_rows,
        docs,
        docs[rows],
        cand_start,
        cand_stop,
        groups=groups,
        rows=(q0, q1),
        units=(u0, u1),
        query_start=query_start,
        softmax_scale=scale,
    )
    grouped = probabilities.view(queries, groups, heads // groups, total).sum(dim=2)
    expected = torch.zeros(groups, q1 - q0, u1 - u0, dtype=torch.float64)
    for i, r in enumerate(range(q0, q1)):
        for u in range(u0, u1):
            if cand_start[r] <= u < cand_stop[r]:
                expected[:, i, u - u0] = grouped[r, :, firsts[u] : firsts[u] + 3].sum(dim=-1)
    assert expected.sum() > 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(mass.double(), expected, rtol=tol, atol=tol * 1e-1)


@pytest.mark.parametrize("compute_lse", [True, False], ids=["lse-computed", "lse-given"])
def test_sparse_kernel_counts_each_selected_unit_once_and_adds_the_suffix_to_the_lse(compute_lse):
    """Each (query, group) selects units with repeats and invalid ids (-1 and the unit count): the
    kernel's LSE runs over the distinct valid units' visible keys plus the suffix table's rows (the
    suffix start up to the query); each first occurrence gets its unit's mass, repeats and invalid
    ids get 0."""
    heads, kv_heads, groups, dim, total, scale = 6, 2, 2, 20, 40, 0.35
    g = seeded(7)
    query = torch.randn(total, heads, dim, generator=g)
    key = torch.randn(total, kv_heads, dim, generator=g)
    docs = _documents([40], total)
    c = 4
    units = total // c
    unit_rows = torch.arange(total, dtype=torch.int32).view(units, c)
    suffix = torch.arange(total) // c * c  # the query's own (partial) unit is its suffix
    tail = suffix[:, None] + torch.arange(c)
    suffix_rows = torch.where(tail <= torch.arange(total)[:, None], tail, -1).int()
    k = 6
    ids = torch.randint(-1, units + 1, (groups, total, k), generator=g)
    ids[:, :, 1] = ids[:, :, 0]  # a repeat in every row
    ordered = torch.where((ids >= 0) & (ids < units), ids, units).sort(dim=-1).values.int()
    lse = torch.full((total, heads), float("inf"))
    per_group = heads // groups
    kv_of = torch.arange(heads) // (heads // kv_heads)
    scores = torch.einsum("qhd,shd->qhs", query.double(), key.double()[:, kv_of]) * scale
    want_lse = torch.zeros(total, heads, dtype=torch.float64)
    attended = torch.zeros(groups, total, total, dtype=torch.bool)
    for gi in range(groups):
        for q in range(total):
            chosen = {int(u) for u in ids[gi, q] if 0 <= u < units}
            keys = [t for t in range(q + 1) if t // c in chosen or t >= suffix[q]]
            attended[gi, q, keys] = True
            hs = slice(gi * per_group, (gi + 1) * per_group)
            want_lse[q, hs] = torch.logsumexp(scores[q, hs][:, keys], dim=-1)
    if not compute_lse:
        lse = want_lse.float().contiguous()
    q0, q1 = 9, 27
    mass = sparse_mass(
        query,
        key,
        lse,
        unit_rows,
        docs,
        docs,
        suffix,
        suffix_rows,
        ordered,
        rows=(q0, q1),
        query_start=0,
        softmax_scale=scale,
        compute_lse=compute_lse,
    )
    if compute_lse:
        torch.testing.assert_close(lse[q0:q1].double(), want_lse[q0:q1], rtol=1e-5, atol=1e-5)
    probabilities = torch.exp(scores - want_lse[..., None])  # [Q, H, S]
    expected = torch.zeros(groups, q1 - q0, k, dtype=torch.float64)
    for gi in range(groups):
        hs = slice(gi * per_group, (gi + 1) * per_group)
        for i, q in enumerate(range(q0, q1)):
            row = ordered[gi, q].tolist()
            for slot, u in enumerate(row):
                if u < units and (slot == 0 or row[slot - 1] != u):
                    keys = [t for t in range(u * c, u * c + c) if t <= q]
                    expected[gi, i, slot] = probabilities[q, hs][:, keys].sum()
    assert expected.sum() > 0
    torch.testing.assert_close(mass.double(), expected, rtol=1e-5, atol=1e-6)


# -- losses against the float64 oracle -----------------------------------------------------------


def _qsa_tensors(seed, batch, queries, total, blocks, heads=4, kv_heads=2, dim=8):
    g = seeded(seed)
    query = torch.randn(batch, queries, heads, dim, generator=g)
    key = torch.randn(batch, total, kv_heads, dim, generator=g)
    index_queries = torch.randn(batch, queries, 3, 6, generator=g).requires_grad_()
    keys = torch.randn(batch, blocks, 1, 6, generator=g).requires_grad_()
    return query, key, index_queries, keys


QSA_CASES = {
    # name: (batch, queries, total, query_start, lengths, cu_seqlens)
    "padded-B2-S24": (2, 24, 24, 0, [24, 19], None),
    "packed-docs-13-3-16-tail4": (1, 36, 36, 0, None, (0, 13, 16, 32)),
    "cp-shard-2-of-2-packed": (1, 15, 30, 15, None, (0, 11, 30)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", QSA_CASES, ids=list(QSA_CASES))
def test_triton_qsa_loss_and_gradients_equal_the_float64_oracle(mode, case) -> None:
    batch, queries, total, start, lengths, cu = QSA_CASES[case]
    c, budget = 3, 6
    units = packed_block_starts(cu, c)[-1] if cu else total // c
    query, key, iq, ck = _qsa_tensors(len(case), batch, queries, total, units)
    routes = None
    if mode == "sparse":
        routes = select_qsa_token_ids(
            iq.detach(),
            ck.detach(),
            lengths,
            token_budget=budget,
            compress_ratio=c,
            query_position_offset=start,
            global_sequence_length=total,
            cu_seqlens=cu,
        )
    common = dict(
        token_budget=budget,
        compress_ratio=c,
        mode=mode,
        routes=routes,
        sequence_lengths=lengths,
        cu_seqlens=cu,
        query_start=start,
        softmax_scale=0.4,
    )
    loss = qsa_indexer_distillation_loss(
        query, key, iq, ck, **common, query_block=9, backend="triton"
    )
    oracle, _ = qsa_indexer_distillation_loss_reference(query, key, iq, ck, **common)
    assert_matches_oracle(
        loss, torch.autograd.grad(loss, (iq, ck)), oracle, torch.autograd.grad(oracle, (iq, ck))
    )


def test_triton_qsa_routes_with_repeated_ids_give_the_loss_of_their_set() -> None:
    """Routes whose blocks repeat (set semantics) and whose padding is -1: the Triton loss equals the
    oracle's and the loss of the routes with every repeat dropped."""
    batch, total, c, budget = 1, 21, 3, 6
    query, key, iq, ck = _qsa_tensors(21, batch, total, total, total // c)
    routes = select_qsa_token_ids(iq.detach(), ck.detach(), None, token_budget=6, compress_ratio=c)
    repeated = routes.clone()
    sparse_rows = (torch.arange(total) + 1) // c > budget // c
    repeated[0, sparse_rows, c : 2 * c] = repeated[0, sparse_rows, :c]  # block 2 := block 1
    common = dict(token_budget=budget, compress_ratio=c, mode="sparse", softmax_scale=0.5)
    loss = qsa_indexer_distillation_loss(
        query, key, iq, ck, **common, routes=repeated, backend="triton"
    )
    oracle, _ = qsa_indexer_distillation_loss_reference(
        query, key, iq, ck, **common, routes=repeated
    )
    torch.testing.assert_close(loss.double(), oracle, rtol=2e-5, atol=1e-7)
    deduplicated = repeated.clone()
    deduplicated[0, sparse_rows, c : 2 * c] = -1
    once = qsa_indexer_distillation_loss(
        query, key, iq, ck, **common, routes=deduplicated, backend="triton"
    )
    torch.testing.assert_close(loss, once, rtol=1e-6, atol=1e-7)
    original, _ = qsa_indexer_distillation_loss_reference(
        query, key, iq, ck, **common, routes=routes
    )
    assert abs(loss.item() - original.item()) > 1e-4  # the repeat changed the route


def _csa_case(start: int, queries: int):
    """Two rows of 36: documents 14 + 4 + 18 and a 24-token document followed by 12 padding."""
    rows = [document_positions([14, 4, 18], 36), document_positions([24], 36)]
    pos = torch.stack([r[0] for r in rows])
    pad = torch.stack([r[1] for r in rows])
    metadata = region_metadata(pos, pad, start, queries, 3, 2, tile_size=8)
    g = seeded(start + queries)
    query = torch.randn(2, queries, 4, 8, generator=g)
    key = torch.randn(2, 36, 2, 8, generator=g)
    iq = torch.randn(2, queries, 2, 3, 6, generator=g).requires_grad_()
    iw = torch.randn(2, queries, 2, 3, generator=g).requires_grad_()
    summaries = torch.randn(2, metadata.region_count, 6, generator=g).requires_grad_()
    return pos, pad, metadata, query, key, iq, iw, summaries


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("start", "queries"), [(0, 36), (18, 18)], ids=["unsharded", "cp-shard-2-of-2"]
)
def test_triton_csa_loss_and_gradients_equal_the_float64_oracle(mode, start, queries) -> None:
    pos, pad, metadata, query, key, iq, iw, summaries = _csa_case(start, queries)
    selection = None
    if mode == "sparse":
        selection = reference_select_regions(
            iq.detach(), iw.detach(), summaries.detach(), pos, pad, start, 3, 2
        )
    loss = csa_indexer_distillation_loss(
        query, key, iq, iw, summaries, metadata, mode=mode, selection=selection,
        softmax_scale=0.4, query_block=16, backend="triton",
    )  # fmt: skip
    oracle, _ = csa_indexer_distillation_loss_reference(
        query, key, iq, iw, summaries, pos, pad, region_size=3, topk=2, mode=mode,
        region_ids=selection, query_start=start, softmax_scale=0.4,
    )  # fmt: skip
    inputs = (iq, iw, summaries)
    assert_matches_oracle(
        loss, torch.autograd.grad(loss, inputs), oracle, torch.autograd.grad(oracle, inputs)
    )


def test_triton_csa_selection_with_repeats_and_invalid_ids_equals_the_oracle() -> None:
    """Region ids with a repeated region and -1 among the unused slots (the sentinel elsewhere)."""
    pos, pad, metadata, query, key, iq, iw, summaries = _csa_case(18, 18)
    ids = reference_select_regions(iq.detach(), iw.detach(), summaries.detach(), pos, pad, 18, 3, 2)
    ids = ids.clone()
    ids[..., 1] = ids[..., 0]  # the lowest selected region twice
    ids[0, 1, 5:, 2] = -1
    kwargs = dict(mode="sparse", selection=ids, softmax_scale=0.4)
    loss = csa_indexer_distillation_loss(
        query, key, iq, iw, summaries, metadata, **kwargs, backend="triton"
    )
    oracle, _ = csa_indexer_distillation_loss_reference(
        query, key, iq, iw, summaries, pos, pad, region_size=3, topk=2, mode="sparse",
        region_ids=ids, query_start=18, softmax_scale=0.4,
    )  # fmt: skip
    torch.testing.assert_close(loss.double(), oracle, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_triton_losses_with_the_attention_lse_equal_the_losses_that_compute_it(mode) -> None:
    pos, pad, metadata, query, key, iq, iw, summaries = _csa_case(18, 18)
    selection = None
    if mode == "sparse":
        selection = reference_select_regions(iq, iw, summaries, pos, pad, 18, 3, 2)
    _, lse = csa_indexer_distillation_loss_reference(
        query, key, iq, iw, summaries, pos, pad, region_size=3, topk=2, mode=mode,
        region_ids=selection, query_start=18,
    )  # fmt: skip
    args = (query, key, iq, iw, summaries, metadata)
    kwargs = dict(mode=mode, selection=selection, backend="triton")
    computed = csa_indexer_distillation_loss(*args, **kwargs)
    given = csa_indexer_distillation_loss(*args, **kwargs, lse=lse.float())
    torch.testing.assert_close(given, computed, rtol=1e-5, atol=1e-7)


def test_triton_bf16_loss_and_gradients_equal_the_pytorch_path() -> None:
    """BF16 main queries and keys (head dim 24: a 16 + 8 split), both modes: the Triton and the
    blockwise PyTorch paths agree within BF16-product tolerances."""
    batch, total, c, budget = 1, 30, 3, 6
    query, key, iq, ck = _qsa_tensors(31, batch, total, total, total // c, heads=6, dim=24)
    query, key = query.bfloat16(), key.bfloat16()
    routes = select_qsa_token_ids(iq.detach(), ck.detach(), None, token_budget=6, compress_ratio=c)
    for mode in MODES:
        common = dict(token_budget=budget, compress_ratio=c, mode=mode, softmax_scale=0.3)
        if mode == "sparse":
            common["routes"] = routes
        results = []
        for backend in ("triton", "torch"):
            loss = qsa_indexer_distillation_loss(query, key, iq, ck, **common, backend=backend)
            results.append((loss, *torch.autograd.grad(loss, (iq, ck))))
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_backend_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    query, key, iq, ck = _qsa_tensors(1, 1, 12, 12, 4)
    common = dict(token_budget=6, compress_ratio=3, mode="dense_warmup")
    with pytest.raises(
        RuntimeError, match="backend='triton' on cpu tensors needs TRITON_INTERPRET"
    ):
        qsa_indexer_distillation_loss(query, key, iq, ck, **common, backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        qsa_indexer_distillation_loss(query, key, iq, ck, **common, backend="cuda")


# -- CUDA ------------------------------------------------------------------------------------------


def _cuda_qsa(total: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    query = torch.randn(1, total, 24, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    key = torch.randn(1, total, 2, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    iq = torch.randn(1, total, 4, 128, device="cuda", generator=g).requires_grad_()
    ck = torch.randn(1, total // 4, 1, 128, device="cuda", generator=g).requires_grad_()
    return query, key, iq, ck


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_triton_qsa_reference_geometry_equals_the_pytorch_path(mode) -> None:
    """24 heads of 256 over 2 KV heads, c 4, budget 256, 4096 packed tokens in 3 documents."""
    total, cu = 4096, (0, 1500, 1503, 4000)
    query, key, iq, ck = _cuda_qsa(total, 3)
    ck = ck.detach()[:, : packed_block_starts(cu, 4)[-1]].requires_grad_()
    common = dict(token_budget=256, compress_ratio=4, mode=mode, cu_seqlens=cu)
    if mode == "sparse":
        common["routes"] = select_qsa_token_ids(
            iq.detach(), ck.detach(), None, token_budget=256, compress_ratio=4, cu_seqlens=cu
        )
    results = []
    for backend in ("triton", "torch"):
        loss = qsa_indexer_distillation_loss(query, key, iq, ck, **common, backend=backend)
        results.append((loss, *torch.autograd.grad(loss, (iq, ck))))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_triton_csa_reference_geometry_equals_the_pytorch_path(mode) -> None:
    """64 heads of 192 over 4 KV groups (head dim split 128 + 64), region 8, top-64, 4096 tokens of 2
    documents, CP shard 2 of 2."""
    total, start, queries = 4096, 2048, 2048
    pos, pad = document_positions([1000, 3096], total)
    pos, pad = pos[None].cuda(), pad[None].cuda()
    metadata = region_metadata(pos, pad, start, queries, 8, 64)
    g = torch.Generator(device="cuda").manual_seed(5)
    query = torch.randn(1, queries, 64, 192, device="cuda", generator=g, dtype=torch.bfloat16)
    key = torch.randn(1, total, 4, 192, device="cuda", generator=g, dtype=torch.bfloat16)
    iq = torch.randn(1, queries, 4, 4, 64, device="cuda", generator=g).requires_grad_()
    iw = torch.randn(1, queries, 4, 4, device="cuda", generator=g).requires_grad_()
    summaries = torch.randn(1, metadata.region_count, 64, device="cuda", generator=g)
    summaries.requires_grad_()
    selection = None
    if mode == "sparse":
        selection = select_regions(
            iq.detach().bfloat16(), iw.detach(), summaries.detach().bfloat16(), metadata
        )
    results = []
    for backend in ("triton", "torch"):
        loss = csa_indexer_distillation_loss(
            query, key, iq, iw, summaries, metadata, mode=mode, selection=selection, backend=backend
        )
        results.append((loss, *torch.autograd.grad(loss, (iq, iw, summaries))))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.gpu
@cuda
def test_cuda_triton_dense_warmup_at_32k_tokens_stays_within_2_gib_of_extra_memory() -> None:
    """The QSA reference geometry at 32 768 tokens: loss and backward allocate at most 2 GiB beyond
    the inputs (FP32 index gradients, the LSE, one merged tile's target and logits)."""
    query, key, iq, ck = _cuda_qsa(32768, 9)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = qsa_indexer_distillation_loss(
        query, key, iq, ck, token_budget=2048, compress_ratio=4, mode="dense_warmup"
    )
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(loss) and loss.item() > 0
    assert peak <= 2 * 1024**3, peak
