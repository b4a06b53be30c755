"""Step5SparseIndexer and its parts (config, norms, w_proj, RoPE, summaries) against the plain PyTorch oracle."""

import pytest
import torch
from step5_cases import document_positions

from sa_kernels import round_to_e4m3
from sa_routing import (
    Step5IndexerLayerNorm,
    Step5IndexerRMSNorm,
    Step5IndexerRotaryEmbedding,
    Step5IndexerWeightProjection,
    Step5SparseConfig,
    Step5SparseIndexer,
    gather_region_payload,
    region_metadata,
    region_summaries,
)
from sa_routing.step5.projection.reference import (
    reference_project_keys,
    reference_project_queries,
    reference_rope,
)
from sa_routing.step5.selection.reference import (
    reference_select_regions,
    selections_differ_beyond_ties,
)
from sa_routing.step5.summaries import _summarize_regions
from sa_routing.step5.summaries.reference import reference_summaries, round_e4m3

SMALL = Step5SparseConfig(
    proxy_dim=32,
    index_heads=6,
    num_provider_groups=2,
    rope_dim=8,
    rope_theta=(10000.0, 500.0),
    region_size=4,
    topk=3,
    hidden_size=48,
)


def make_indexer(
    config: Step5SparseConfig, layer_idx: int = 1, device: str = "cpu"
) -> Step5SparseIndexer:
    indexer = Step5SparseIndexer(config, layer_idx, torch.bfloat16, device=device)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(
                torch.randn_like(p) * p.shape[-1] ** -0.5
                if p.dim() == 2
                else torch.randn_like(p) * 0.1
            )
    return indexer


def test_config_defaults_are_the_reference_geometry() -> None:
    cfg = Step5SparseConfig()
    assert (cfg.proxy_dim, cfg.index_heads, cfg.num_provider_groups, cfg.rope_dim) == (
        256,
        16,
        4,
        32,
    )
    assert (cfg.region_size, cfg.topk, cfg.norm_eps, cfg.heads_per_group) == (8, 512, 1e-5, 4)
    assert SMALL.rope_theta_for(1) == 500.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"topk": 0}, "topk"),
        ({"region_size": 0}, "region_size"),
        ({"index_heads": 6, "num_provider_groups": 4}, "multiple of num_provider_groups"),
        ({"rope_dim": 7}, "rope_dim"),
        ({"rope_dim": 512}, "rope_dim"),
        ({"rope_theta": ()}, "rope_theta"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"norm_eps": float("inf")}, "norm_eps"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rope_theta": (1e4, float("inf"))}, "rope_theta"),
    ],
    ids=[
        "topk-0",
        "region-0",
        "heads-not-divisible",
        "rope-odd",
        "rope-too-large",
        "theta-empty",
        "eps-0",
        "eps-inf",
        "theta-nan",
        "theta-inf",
    ],
)
def test_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Step5SparseConfig(**kwargs)


def test_parts_reject_inputs_they_would_silently_get_wrong() -> None:
    """Integer activations (an int-cast weight projects to zeros), float or bool positions (would be
    rotated as given), a non-positive RoPE base (NaN angles), keys of another batch than the
    metadata (rows summarised as zeros)."""
    with pytest.raises(TypeError, match="hidden must be a floating tensor"):
        Step5IndexerWeightProjection(8, 2, 3)(torch.ones(1, 2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"hidden_size=8"):
        Step5IndexerWeightProjection(8, 2, 3)(torch.ones(1, 2, 9))
    rope = Step5IndexerRotaryEmbedding(4, 100.0)
    x = torch.randn(1, 2, 6)
    with pytest.raises(TypeError, match="positions must be int64"):
        rope(x, torch.tensor([[0.5, 1.5]]))
    with pytest.raises(TypeError, match="positions must be int64"):
        rope(x, torch.tensor([[True, False]]))
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        rope(x.long(), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="rope_dim=4"):
        rope(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.int64))
    for theta in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="theta must be a finite float > 0"):
            Step5IndexerRotaryEmbedding(4, theta)
    with pytest.raises(ValueError, match="rope_dim must be an even int"):
        Step5IndexerRotaryEmbedding(5, 100.0)
    positions, padding = document_positions([16], 16)
    metadata = region_metadata(positions[None], padding[None], 0, 16, SMALL.region_size, SMALL.topk)
    keys = torch.randn(2, 16, SMALL.proxy_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(batch, global_length\) = \(1, 16\)"):
        region_summaries(keys, keys, metadata)


def test_q_norm_rounds_its_weight_to_bf16_before_the_zero_centred_scale() -> None:
    torch.manual_seed(0)
    norm = Step5IndexerRMSNorm(40)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40) * 0.3)
    x = torch.randn(3, 7, 40).to(torch.bfloat16)
    xf = x.float()
    want = (
        xf
        * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5)
        * (1 + norm.weight.bfloat16().float())
    )
    got = norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.bfloat16().float(), atol=0, rtol=2**-8)


def test_k_norm_is_layer_norm_with_e2_variance_and_bf16_parameters() -> None:
    torch.manual_seed(1)
    norm = Step5IndexerLayerNorm(40)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(40) * 0.3)
        norm.bias.copy_(torch.randn(40) * 0.3)
    x = (torch.randn(5, 40) * 3 + 1).to(torch.bfloat16)
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = xf.square().mean(-1, keepdim=True) - mean.square()
    want = (xf - mean) / torch.sqrt(
        var + 1e-5
    ) * norm.weight.bfloat16().float() + norm.bias.bfloat16().float()
    torch.testing.assert_close(norm(x).float(), want.bfloat16().float(), atol=2**-7, rtol=2**-7)


def test_weight_projection_rounds_the_fp32_weight_and_scales_by_heads() -> None:
    torch.manual_seed(2)
    proj = Step5IndexerWeightProjection(24, 2, 3)
    hidden = torch.randn(2, 5, 24).to(torch.bfloat16)
    out = proj(hidden)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 2, 3)
    want = (hidden @ proj.weight.bfloat16().t()).float() * 3**-0.5
    assert torch.equal(out, want.view(2, 5, 2, 3))


def test_rotary_rotates_half_split_pairs_of_the_leading_dims_only() -> None:
    torch.manual_seed(3)
    rope = Step5IndexerRotaryEmbedding(8, 10000.0)
    x = torch.randn(2, 9, 3, 20).to(torch.bfloat16)
    positions = torch.randint(0, 5000, (2, 9))
    out = rope(x, positions)
    assert torch.equal(out, reference_rope(x, positions, 8, 10000.0))
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert torch.equal(rope(x, torch.zeros_like(positions)), x)
    # pairs (d, d + 4) keep their norm
    pairs = lambda t: (t[..., :4].float() ** 2 + t[..., 4:8].float() ** 2).sqrt()
    torch.testing.assert_close(pairs(out), pairs(x), atol=0.05, rtol=0.02)
    # in place: the same bits, written into x itself
    inplace = x.clone()
    assert rope.rotate_(inplace, positions) is inplace
    assert torch.equal(inplace, out)
    # the frequencies are computed once per device, and again for another theta
    assert rope.inverse_frequencies(x.device) is rope.inverse_frequencies(x.device)
    rope.theta = 500.0
    assert torch.equal(rope(x, positions), reference_rope(x, positions, 8, 500.0))
    assert not torch.equal(rope(x, positions), out)


def test_summaries_pool_each_region_with_a_softmax_over_its_valid_tokens() -> None:
    torch.manual_seed(4)
    pos, pad = document_positions([13, 2, 22], 41)
    keys = torch.randn(1, 41, 32).to(torch.bfloat16)
    logits = (torch.randn(1, 41, 32) * 4).to(torch.bfloat16)
    m = region_metadata(pos[None], pad[None], 0, 41, region_size=4, topk=2)
    out = _summarize_regions(keys, logits, m.region_sources, m.region_source_valid)
    want = reference_summaries(keys, logits, pos[None], pad[None], 4)
    assert out.dtype == torch.bfloat16 and out.shape == (1, m.region_count, 32)
    assert torch.equal(out, want)
    assert torch.equal(round_e4m3(out), out)
    # a one-token region is that token's key, rounded
    single = int(m.token_regions[0, 12])
    assert torch.equal(out[0, single], round_e4m3(keys[0, 12]))


def test_region_summaries_pool_the_ranges_the_tiles_read_and_leave_the_rest_zero() -> None:
    torch.manual_seed(6)
    pos, pad = document_positions([13, 2, 22], 41)
    keys = torch.randn(2, 41, 32).to(torch.bfloat16)
    logits = (torch.randn(2, 41, 32) * 4).to(torch.bfloat16)
    positions, padding = pos.expand(2, -1), pad.expand(2, -1)
    m = region_metadata(positions, padding, 0, 41, region_size=4, topk=2)
    out = region_summaries(keys, logits, m)
    want = reference_summaries(keys, logits, positions, padding, 4)
    read = torch.zeros(2, m.region_count, dtype=torch.bool)
    for b, first, past in m.summary_ranges:
        read[b, first:past] = True
    assert read.any() and not read.all()
    assert torch.equal(out[read], want[read])
    assert not out[~read].any()


def test_payload_gather_returns_exactly_the_source_rows() -> None:
    torch.manual_seed(5)
    pos_a, pad_a = document_positions([10, 7], 19)
    pos_b, pad_b = document_positions([19], 19)
    pos, pad = torch.stack([pos_a, pos_b]), torch.stack([pad_a, pad_b])
    keys = torch.randn(2, 19, 16).to(torch.bfloat16)
    logits = torch.randn(2, 19, 16)
    m = region_metadata(pos, pad, 0, 19, region_size=3, topk=1)
    k_rows, z_rows = gather_region_payload(keys, logits, m.region_sources, m.region_source_valid)
    assert k_rows.shape == (2, m.region_count, 3, 16) and z_rows.dtype == torch.float32
    for b in range(2):
        for r in range(m.region_count):
            for j in range(3):
                t = int(m.region_sources[b, r, j])
                if t >= 0:
                    assert torch.equal(k_rows[b, r, j], keys[b, t])
                    assert torch.equal(z_rows[b, r, j], logits[b, t])
    with pytest.raises(ValueError, match="sources and valid"):
        gather_region_payload(keys, logits, m.region_sources[:1], m.region_source_valid)


def run_indexer_and_oracle(
    indexer: Step5SparseIndexer,
    pos: torch.Tensor,
    pad: torch.Tensor,
    query_start: int,
    queries: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    cfg = indexer.config
    batch, total = pos.shape
    device = pos.device
    hidden = torch.randn(batch, total, cfg.hidden_size, device=device).to(torch.bfloat16)
    keys, logits = indexer.project_keys(hidden, pos)
    rows = slice(query_start, query_start + queries)
    selection = indexer(hidden[:, rows], pos[:, rows], keys, logits, pos, pad, query_start)
    # Each stage against its oracle; the next oracle stage then reads the fast stage's output, so that
    # a one-ulp difference of a norm kernel cannot pass for a selection difference.
    ref_keys, ref_logits = reference_project_keys(indexer, hidden, pos)
    torch.testing.assert_close(keys.float(), ref_keys.float(), atol=2**-6, rtol=2**-7)
    assert torch.equal(logits, ref_logits)
    query, weights = indexer.project_queries(hidden[:, rows], pos[:, rows])
    ref_query, ref_weights = reference_project_queries(indexer, hidden[:, rows], pos[:, rows])
    far = (query.float() - ref_query.float()).abs() > 2**-3 * ref_query.float().abs() + 1e-3
    assert far.float().mean() < 1e-3, "queries differ beyond one E4M3 step"
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-5)
    summary = reference_summaries(keys, logits, pos, pad, cfg.region_size)
    oracle = reference_select_regions(
        query,
        weights,
        summary,
        pos,
        pad,
        query_start,
        cfg.region_size,
        cfg.topk,
        torch.float64,
        query_chunk=128,
    )
    return selection.region_ids, oracle, (query, weights, summary, selection.region_count)


def test_indexer_selects_the_oracle_regions_from_hidden_states() -> None:
    torch.manual_seed(6)
    indexer = make_indexer(SMALL)
    pos_a, pad_a = document_positions([70, 3, 60], 140)
    pos_b, pad_b = document_positions([137], 140)
    pos, pad = torch.stack([pos_a, pos_b]), torch.stack([pad_a, pad_b])
    ids, oracle, (query, weights, summary, count) = run_indexer_and_oracle(
        indexer, pos, pad, 0, 140
    )
    assert ids.shape == (2, 2, 140, SMALL.topk + 1) and ids.dtype == torch.int32
    differing, beyond_ties = selections_differ_beyond_ties(
        ids, oracle, query, weights, summary, count
    )
    assert beyond_ties == []
    assert differing <= 2
    assert (ids[:, :, :, :-1] <= ids[:, :, :, 1:]).all(), "ids ascending"


def test_indexer_selection_does_not_depend_on_how_many_rows_are_projected_per_call() -> None:
    torch.manual_seed(8)
    indexer = make_indexer(SMALL)
    pos_a, pad_a = document_positions([70, 3, 60], 140)
    pos_b, pad_b = document_positions([137], 140)
    pos, pad = torch.stack([pos_a, pos_b]), torch.stack([pad_a, pad_b])
    hidden = torch.randn(2, 140, SMALL.hidden_size).to(torch.bfloat16)
    keys, logits = indexer.project_keys(hidden, pos)
    m = region_metadata(pos, pad, 0, 140, SMALL.region_size, SMALL.topk, tile_size=16)
    results = []
    for rows in (1, 7, 40, 4096):
        indexer.selection_options = {"project_rows": rows, "region_chunk": 5}
        results.append(indexer(hidden, pos, keys, logits, pos, pad, metadata=m).region_ids)
    assert all(torch.equal(r, results[-1]) for r in results)
    indexer.selection_options = {"project_rows": 0}
    with pytest.raises(ValueError, match="project_rows must be an int >= 1; got 0"):
        indexer(hidden, pos, keys, logits, pos, pad, metadata=m)


def test_stage_marks_name_every_stage_of_the_walk_in_order() -> None:
    torch.manual_seed(9)
    indexer = make_indexer(SMALL)
    pos, pad = document_positions([130], 140)
    hidden = torch.randn(1, 140, SMALL.hidden_size).to(torch.bfloat16)
    keys, logits = indexer.project_keys(hidden, pos[None])
    marks: list[str] = []
    indexer.selection_options = {"score_budget_bytes": 1}
    args = (hidden, pos[None], keys, logits, pos[None], pad[None])
    marked = indexer._forward(*args, 0, None, marks.append).region_ids
    indexer.selection_options = {}
    plain = indexer(*args).region_ids
    assert torch.equal(marked, plain)
    assert marks[0] == "summaries" and marks[-1] == "merge"
    walk = marks[1:]
    assert walk.count("merge") > 1, "one merged tile per metadata tile with a 1-byte budget"
    assert set(walk) == {"project_queries", "score", "topk", "merge"}


@pytest.mark.parametrize("shards", [2, 5], ids=lambda n: f"cp{n}")
def test_indexer_shard_equals_the_slice_of_the_unsharded_selection(shards: int) -> None:
    torch.manual_seed(7)
    indexer = make_indexer(SMALL, layer_idx=0)
    total = 120
    pos, pad = document_positions([45, 70], total)
    pos, pad = pos[None], pad[None]
    hidden = torch.randn(1, total, SMALL.hidden_size).to(torch.bfloat16)
    keys, logits = indexer.project_keys(hidden, pos)
    full = indexer(hidden, pos, keys, logits, pos, pad).region_ids
    local = total // shards
    for rank in range(shards):
        rows = slice(rank * local, (rank + 1) * local)
        shard = indexer(
            hidden[:, rows], pos[:, rows], keys, logits, pos, pad, query_start=rank * local
        )
        assert torch.equal(shard.region_ids, full[:, :, rows])


def test_an_fp32_indexer_scores_e4m3_queries_widened_to_bf16() -> None:
    torch.manual_seed(8)
    indexer = make_indexer(SMALL).to(torch.float32)
    pos, pad = document_positions([90], 96)
    pos, pad = pos[None], pad[None]
    hidden = torch.randn(1, 96, SMALL.hidden_size)
    query, _ = indexer.project_queries(hidden, pos)
    assert query.dtype == torch.bfloat16
    assert torch.equal(round_to_e4m3(query.float()), query.float())
    keys, logits = indexer.project_keys(hidden, pos)
    ids = indexer(hidden, pos, keys, logits, pos, pad).region_ids
    assert ids.shape == (1, SMALL.num_provider_groups, 96, SMALL.topk + 1)


def test_dense_prefix_needs_no_keys_and_scores_nothing() -> None:
    indexer = make_indexer(SMALL)
    pos, pad = document_positions([16, 9], 25)  # history <= 3 == topk everywhere
    hidden = torch.randn(1, 25, SMALL.hidden_size).to(torch.bfloat16)
    m = region_metadata(pos[None], pad[None], 0, 25, SMALL.region_size, SMALL.topk)
    assert m.score_tiles == ()
    selection = indexer(hidden, pos[None], None, None, pos[None], pad[None], metadata=m)
    # Written out: documents of 16 and 9 tokens, regions of 4 -> global regions 0-3 and 4-6; a query
    # keeps every region of its document up to its own; unused slots hold region_count (7).
    assert m.region_count == 7
    want = torch.full((25, SMALL.topk + 1), 7, dtype=torch.int32)
    for q in range(25):
        first, local = (0, q) if q < 16 else (4, q - 16)
        regions = list(range(first, first + local // SMALL.region_size + 1))
        want[q, : len(regions)] = torch.tensor(regions, dtype=torch.int32)
    assert torch.equal(selection.region_ids, want.expand(1, 2, 25, SMALL.topk + 1))


def test_indexer_is_frozen_and_selects_without_autograd() -> None:
    indexer = make_indexer(SMALL)
    assert not any(p.requires_grad for p in indexer.parameters())
    pos, pad = document_positions([40], 40)
    hidden = torch.randn(1, 40, SMALL.hidden_size, requires_grad=True)
    keys, logits = indexer.project_keys(hidden.detach().bfloat16(), pos[None])
    assert not keys.requires_grad and not logits.requires_grad
    selection = indexer(hidden.detach().bfloat16(), pos[None], keys, logits, pos[None], pad[None])
    assert not selection.region_ids.requires_grad


def test_indexer_rejects_missing_keys_and_foreign_metadata() -> None:
    indexer = make_indexer(SMALL)
    pos, pad = document_positions([40], 40)
    hidden = torch.randn(1, 40, SMALL.hidden_size).to(torch.bfloat16)
    with pytest.raises(ValueError, match="keys and compression_logits are required"):
        indexer(hidden, pos[None], None, None, pos[None], pad[None])
    other = region_metadata(pos[None], pad[None], 0, 40, SMALL.region_size, SMALL.topk + 1)
    keys, logits = indexer.project_keys(hidden, pos[None])
    with pytest.raises(ValueError, match="metadata must describe"):
        indexer(hidden, pos[None], keys, logits, pos[None], pad[None], metadata=other)
    with pytest.raises(TypeError, match="positions must be int64"):
        indexer.project_keys(hidden, pos[None].int())
    with pytest.raises(ValueError, match="hidden must be"):
        indexer.project_keys(hidden[..., :5], pos[None])
    with pytest.raises(ValueError, match="keys must be"):
        indexer(hidden, pos[None], keys[:, :39], logits, pos[None], pad[None])
    with pytest.raises(TypeError, match=r"indexer's dtype \(torch.bfloat16\); got torch.float32"):
        indexer.project_keys(hidden.float(), pos[None])
    with torch.autocast("cpu", torch.bfloat16):  # autocast casts the projection's inputs itself
        keys32, _ = indexer.project_keys(hidden.float(), pos[None])
    assert keys32.shape == keys.shape


@pytest.mark.gpu
def test_indexer_at_32k_tokens_matches_the_oracle_on_cuda() -> None:
    torch.manual_seed(0)
    cfg = Step5SparseConfig(hidden_size=1024)
    indexer = make_indexer(cfg, device="cuda")
    total = 32768
    pos, pad = document_positions([5000, 20000, 7000], total)
    pos, pad = pos[None].cuda(), pad[None].cuda()
    ids, oracle, (query, weights, summary, count) = run_indexer_and_oracle(
        indexer, pos, pad, 0, total
    )
    differing, beyond_ties = selections_differ_beyond_ties(
        ids, oracle, query, weights, summary, count
    )
    assert beyond_ties == []
    assert differing <= ids.shape[1] * ids.shape[2] // 1000


@pytest.mark.parametrize(("batch", "tokens"), [(1, 0), (0, 5)], ids=["B1-S0", "B0-S5"])
def test_project_keys_of_an_empty_batch_or_sequence_keeps_the_shape(
    batch: int, tokens: int
) -> None:
    indexer = make_indexer(SMALL)
    hidden = torch.randn(batch, tokens, SMALL.hidden_size).to(torch.bfloat16)
    positions = torch.zeros(batch, tokens, dtype=torch.int64)
    keys, logits = indexer.project_keys(hidden, positions)
    for t in (keys, logits):
        assert t.shape == (batch, tokens, SMALL.proxy_dim)
        assert t.dtype == torch.bfloat16
    heads = torch.randn(batch, tokens, 3, SMALL.proxy_dim)  # middle dims broadcast as well
    assert indexer.rotary(heads, positions).shape == heads.shape
