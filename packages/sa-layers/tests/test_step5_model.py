"""Step-5 attention (SWA, CSA, dense), decoder layer and model against plain references (CPU)."""

import copy

import model_checks as checks
import pytest
import torch
import torch.distributed as dist

from sa_cp import ContextParallelLayout
from sa_cp.testing import run_on_ranks
from sa_kernels.backend import triton_interpret
from sa_layers import (
    Step5Attention,
    Step5Batch,
    Step5Config,
    Step5DecoderLayer,
    Step5Model,
    testing,
)
from sa_layers.moe import Step5MoE
from sa_layers.testing import randomise_norms
from sa_layers.testing import tiny_step5_config as tiny_config
from sa_layers.testing import tiny_step5_model as tiny_model

SEQUENCE = 48
# queries at document position >= (TOPK + 1) * REGION = 12 are sparse
REGION, TOPK = tiny_config().sparse_config.region_size, tiny_config().sparse_config.topk
WINDOW = tiny_config().sliding_window


def token_ids(batch: int = 2, length: int = SEQUENCE, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))


def packed_positions(documents: list[list[int]], length: int = SEQUENCE):
    """Per row: back-to-back documents of the given lengths, then padding up to `length`."""
    return testing.packed_positions(documents, length)


# Row 0: a long document (sparse queries), then a short one. Row 1: two documents, a padding tail.
DOCUMENTS = [[30, 18], [21, 16]]


def hidden_states(batch: int = 2, length: int = SEQUENCE, seed: int = 2) -> torch.Tensor:
    return torch.randn(batch, length, 32, generator=torch.Generator().manual_seed(seed))


# -- the reference, written out in float64 ----------------------------------------------------------


def documents_and_regions(positions: torch.Tensor, padding: torch.Tensor, region: int):
    """Document and region (numbered per row, restarting at every document) of every token."""
    docs = torch.full_like(positions, -1)
    regions = torch.full_like(positions, -1)
    for b in range(positions.shape[0]):
        doc = reg = -1
        for t in range(positions.shape[1]):
            if padding[b, t]:
                continue
            p = int(positions[b, t])
            doc += p == 0
            reg += p % region == 0
            docs[b, t], regions[b, t] = doc, reg
    return docs, regions


def reference_mask(layer: Step5Attention, positions, padding, region_ids=None) -> torch.Tensor:
    """bool [B, G, S, S]: the keys each query of each KV group attends to."""
    b, s = positions.shape
    groups = layer.config.num_attention_groups
    docs, regions = documents_and_regions(
        positions, padding, layer.config.sparse_config.region_size
    )
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    same = (docs[:, :, None] == docs[:, None, :]) & (docs >= 0)[:, :, None] & (k <= q)
    if layer.layer_type == "swa":
        return (same & (q - k < layer.config.sliding_window))[:, None].expand(b, groups, s, s)
    if layer.layer_type == "dense":
        return same[:, None].expand(b, groups, s, s)
    chosen = (regions[:, None, None, :, None] == region_ids[:, :, :, None, :].long()).any(-1)
    return chosen & same[:, None] & (regions >= 0)[:, None, None, :]


def reference_attention(layer: Step5Attention, hidden, positions, padding, region_ids=None):
    """The layer in float64: QKV, per-head norms, NeoX partial RoPE, masked softmax, gate, o_proj."""
    cfg = layer.config
    heads, groups, dim = cfg.num_attention_heads, cfg.num_attention_groups, cfg.head_dim
    hpg = heads // groups
    b, s, _ = hidden.shape
    x = hidden.double()
    qkv = (x @ layer.qkv_proj.weight.double().T).view(b, s, groups, hpg + 2, dim)

    def norm(t, w):
        return checks.rms_norm64(t, w, cfg.rms_norm_eps)

    theta, rotary = layer.rotary_key
    half = rotary // 2
    angle = positions.double()[..., None] * theta ** (-torch.arange(0, rotary, 2).double() / rotary)
    cos, sin = angle.cos()[:, :, None], angle.sin()[:, :, None]

    def rope(t):
        t1, t2 = t[..., :half], t[..., half:rotary]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin, t[..., rotary:]], dim=-1)

    q = rope(norm(qkv[..., :hpg, :].reshape(b, s, heads, dim), layer.q_norm.weight))
    k = rope(norm(qkv[..., hpg, :], layer.k_norm.weight)).repeat_interleave(hpg, dim=2)
    v = qkv[..., hpg + 1, :].repeat_interleave(hpg, dim=2)
    mask = reference_mask(layer, positions, padding, region_ids).repeat_interleave(hpg, dim=1)
    out = checks.masked_attention64(q, k, v, mask)
    gate = torch.sigmoid(x @ layer.g_proj.weight.double().T)[..., None]
    return (out * gate).flatten(-2) @ layer.o_proj.weight.double().T


def capture_selections(model_or_layer) -> list:
    seen: list = []
    for indexer in (
        model_or_layer.indexers()
        if isinstance(model_or_layer, Step5Model)
        else [model_or_layer.indexer]
    ):
        indexer.register_forward_hook(lambda _m, _i, out: seen.append(out.region_ids))
    return seen


def layer_of(kind: str, **overrides) -> tuple[Step5Attention, Step5Config]:
    """Layer 3 of a model whose layers are all `kind` (RoPE θ 1000, a quarter of each head rotated)."""
    config = tiny_config(layer_types=(kind,) * 4, **overrides)
    torch.manual_seed(0)
    layer = Step5Attention(config, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    randomise_norms(layer)
    return layer, config


# -- each layer type against the reference ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "backend"),
    [
        ("swa", "reference"),
        ("dense", "reference"),
        ("csa", "reference"),
        pytest.param(
            "csa",
            "gather",
            marks=pytest.mark.skipif(
                not triton_interpret(), reason="the gather kernels need TRITON_INTERPRET=1 on CPU"
            ),
        ),
    ],
    ids=["swa", "dense", "csa", "csa-gather"],
)
def test_layer_output_and_gradients_equal_the_float64_reference(kind, backend):
    """Output, input gradient and every parameter's gradient (the reference reads the layer's
    weights, so its backward reaches them too; the indexer's are outside both)."""
    layer, config = layer_of(kind, attn_backend=backend)
    seen = capture_selections(layer) if kind == "csa" else []
    positions, padding = packed_positions(DOCUMENTS)
    batch = Step5Batch.create(config, token_ids(), positions, padding)
    x = hidden_states().requires_grad_(True)
    out, _ = layer(x, batch)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weight).sum().backward()
    params = {n: p for n, p in layer.named_parameters() if not n.startswith("indexer.")}
    grads = {n: p.grad.clone() for n, p in params.items()}
    layer.zero_grad(set_to_none=True)
    ids = seen[0] if seen else None
    x64 = hidden_states().double().requires_grad_(True)
    expected = reference_attention(layer, x64, positions, padding, ids)
    (expected * weight.double()).sum().backward()
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    assert len(params) >= 5
    for name, p in params.items():
        scale = p.grad.abs().max()
        assert scale > 0, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert out[1, 37:].abs().max() == 0  # padding tail


def test_csa_selection_is_every_region_for_dense_prefix_queries_and_topk_plus_current_past_it():
    layer, config = layer_of("csa")
    seen = capture_selections(layer)
    positions, padding = packed_positions(DOCUMENTS)
    batch = Step5Batch.create(config, token_ids(), positions, padding)
    layer(hidden_states(), batch)
    (ids,) = seen
    docs, regions = documents_and_regions(positions, padding, REGION)
    sparse = batch.sparse_metadata.sparse_queries
    assert sparse.any() and (~sparse & ~padding).any()
    for b in range(2):
        for q in range(SEQUENCE):
            if padding[b, q]:
                assert (ids[b, :, q] == batch.sparse_metadata.region_count).all()
                continue
            history = regions[b, : q + 1][docs[b, : q + 1] == docs[b, q]].unique().tolist()
            for g in range(2):
                chosen = [
                    r for r in ids[b, g, q].tolist() if r < batch.sparse_metadata.region_count
                ]
                if positions[b, q] < (TOPK + 1) * REGION:
                    assert chosen == history
                else:
                    assert len(chosen) == TOPK + 1 and chosen[-1] == regions[b, q]
                    assert set(chosen) <= set(history)
    # the two KV groups route differently somewhere
    assert not torch.equal(ids[:, 0], ids[:, 1])


def test_swa_output_of_a_query_moves_only_with_tokens_in_its_window_and_document():
    layer, config = layer_of("swa")
    positions, padding = packed_positions([[30, 18]])
    batch = Step5Batch.create(config, token_ids(1), positions, padding)
    x = hidden_states(1)
    base, _ = layer(x, batch)
    docs, _ = documents_and_regions(positions, padding, REGION)
    for t in (0, 5, 22, 29, 30, 31, 40):
        moved = x.clone()
        moved[0, t] += 1.0
        changed = (layer(moved, batch)[0] - base).abs().amax(-1)[0] > 0
        q = torch.arange(SEQUENCE)
        expected = (docs[0] == docs[0, t]) & (q >= t) & (q - t < WINDOW)
        assert torch.equal(changed, expected), t


def test_model_logits_and_gradients_equal_a_plain_float64_model():
    """SWA, CSA, SWA, CSA over packed documents with a padding tail (clamped and unclamped MLPs):
    logits on valid tokens and every non-indexer parameter's gradient equal the model written out
    in float64 (`reference_attention` over the CSA layers' selections)."""
    model = tiny_model(layer_types=("swa", "csa", "swa", "csa"))
    seen = capture_selections(model)
    positions, padding = packed_positions(DOCUMENTS)
    ids = token_ids()

    def reference():
        assert len(seen) == 2
        chosen = iter(seen)
        return checks.language_model64(
            model,
            ids,
            lambda attn, x: reference_attention(
                attn, x, positions, padding, next(chosen) if attn.indexer is not None else None
            ),
        )

    checks.assert_model_equals_float64(
        model, lambda: model(ids, positions, padding).logits, reference, ~padding[..., None]
    )


def test_padding_rows_equal_their_unpadded_prefix_for_every_layer_type():
    for kind in ("swa", "csa", "dense"):
        model = tiny_model(layer_types=(kind,) * 4)
        ids = token_ids()
        padding = torch.zeros(2, SEQUENCE, dtype=torch.bool)
        padding[1, 29:] = True
        full = model(ids, padding_mask=padding).logits
        alone = model(ids[1:, :29]).logits
        torch.testing.assert_close(full[1, :29], alone[0], rtol=1e-5, atol=1e-5)


def test_packed_documents_equal_each_document_alone():
    model = tiny_model()
    ids = token_ids(1)
    positions, padding = packed_positions([[30, 18]])
    packed = model(ids, positions, padding).logits
    first = model(ids[:, :30]).logits
    second = model(ids[:, 30:]).logits
    torch.testing.assert_close(packed[:, :30], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 30:], second, rtol=1e-5, atol=1e-5)


def test_window_attention_on_one_rank_equals_a_window_as_large_as_the_sequence_when_dense():
    swa, config = layer_of("swa", sliding_window=SEQUENCE)
    dense = Step5Attention(tiny_config(layer_types=("dense",) * 4, sliding_window=SEQUENCE), 3)
    dense.load_state_dict(swa.state_dict())
    positions, padding = packed_positions(DOCUMENTS)
    batch = Step5Batch.create(config, token_ids(), positions, padding)
    x = hidden_states()
    torch.testing.assert_close(swa(x, batch)[0], dense(x, batch)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("world", "window"), [(1, 6), (2, 6), (4, 6), (4, 24)])
def test_plain_flex_mask_mods_equal_the_document_ones_on_every_shard(world, window):
    """One document per row, no padding: the arithmetic window / causal mask_mods equal the
    document ones on every rank, for a halo inside the previous shard (window 6), an all-gathered
    one (window 24 over 8-row shards) and rank 0's rows before the sequence."""
    from sa_layers.step5.layout import mask_mods

    config = tiny_config(layer_types=("swa", "swa", "swa", "dense"), sliding_window=window)
    total, local = 32, 32 // world
    documents = torch.zeros(2, total, dtype=torch.int64)
    for rank in range(world):
        start, halo = rank * local, window - 1
        swa_start = start if world == 1 else start - halo if halo <= local else max(0, start - halo)
        rows = torch.arange(swa_start, start + local)
        swa_documents = torch.where(rows >= 0, 0, -1).expand(2, -1)
        args = (config, documents, swa_documents, start, local, swa_start, False)
        plain, packed = mask_mods(*args, True), mask_mods(*args, False)
        assert plain.keys() == packed.keys() == {"swa", "dense"}
        for name in plain:
            (fast, keys), (slow, keys_too) = plain[name], packed[name]
            assert keys == keys_too
            b, q, kv = torch.meshgrid(
                torch.arange(2), torch.arange(local), torch.arange(keys), indexing="ij"
            )
            got, want = fast(b, 0, q, kv), slow(b, 0, q, kv)
            assert torch.equal(got, want), (name, rank)
            assert want.any() and not want.all()


# -- the decoder layer: FP32 residual ---------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["mlp", "moe"])
def test_decoder_layer_adds_bf16_branches_to_an_fp32_residual(moe):
    config = tiny_config(
        moe_layers=(1,) if moe else (),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    torch.manual_seed(0)
    layer = Step5DecoderLayer(config, 1, torch.bfloat16)
    randomise_norms(layer)
    assert isinstance(layer.mlp, Step5MoE) == moe
    assert layer.input_layernorm.weight.dtype == torch.float32
    batch = Step5Batch.create(config, token_ids())
    # 1000 + x: below BF16 resolution at 1000, so a BF16 residual would lose x entirely
    residual = 1000.0 + hidden_states()
    out, _ = layer(residual, batch)
    normed = layer.input_layernorm(residual)
    assert out.dtype == torch.float32 and normed.dtype == torch.bfloat16
    middle = residual + layer.self_attn(normed, batch)[0]
    expected = middle + layer.mlp(layer.post_attention_layernorm(middle))
    assert torch.equal(out, expected)
    assert (out - residual).abs().max() < 100  # the residual's own digits survive


def test_bf16_model_keeps_fp32_norms_router_and_indexer_weights_and_runs():
    model = copy.deepcopy(tiny_model(moe_layers=(0,), num_experts=4, moe_intermediate_size=16)).to(
        torch.bfloat16
    )
    assert model.norm.weight.dtype == torch.float32 and model.norm.output_dtype == torch.bfloat16
    indexer = model.indexers()[0]
    assert indexer.w_proj.weight.dtype == indexer.q_norm.weight.dtype == torch.float32
    assert indexer.q_proj.weight.dtype == torch.bfloat16
    assert model.layers[0].mlp.router.weight.dtype == torch.float32
    out = model(token_ids(), labels=token_ids(seed=3))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)


# -- replay under activation checkpointing ---------------------------------------------------------


def train_step(mode: str, reuse: bool = True):
    model = tiny_model(
        reuse_routes_on_recompute=reuse,
        layer_types=("swa", "csa", "swa", "csa"),
        moe_layers=(2,),
        num_experts=4,
        moe_intermediate_size=16,
    )
    positions, padding = packed_positions(DOCUMENTS)
    return checks.checkpointed_step(
        model, mode, lambda m: m(token_ids(), positions, padding, labels=token_ids(seed=7)).loss
    )


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_replays_routes_indexer_runs_once_per_layer_and_grads_are_bitwise_equal(mode):
    ref_loss, ref_grads, ref_calls = train_step("none")
    loss, grads, calls = train_step(mode)
    assert ref_calls == calls == 2  # two CSA layers, one indexer call each
    assert torch.equal(loss, ref_loss)
    assert len(grads) == len(ref_grads)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_the_indexer_selection_is_the_gather_backends_canonical_routes_without_a_copy():
    """What the replay records per CSA layer, the selection and its block mask, holds one
    [B, G, L, topk + 1] id tensor: the selection is already canonical for the region kernels."""
    from sa_kernels.sparse_region_attention import build_region_block_mask

    model = tiny_model(layer_types=("swa", "csa", "swa", "csa"))
    selections = []
    for indexer in model.indexers():
        indexer.register_forward_hook(lambda _m, _i, out: selections.append(out))
    positions, padding = packed_positions(DOCUMENTS)
    model(token_ids(), positions, padding)
    assert len(selections) == 2
    for selection in selections:
        ids = selection.region_ids
        sources = torch.zeros(ids.shape[0], selection.region_count, 1, dtype=torch.int32)
        mask = build_region_block_mask(ids, sources, ids.shape[2], 8, build_flex=False)
        assert mask.routes is ids


def test_without_route_reuse_the_recompute_runs_the_indexer_again():
    _, _, calls = train_step("full", reuse=False)
    assert calls == 4


def test_compiled_model_forward_and_backward_equal_eager():
    """torch.compile (aot_eager: Dynamo and AOTAutograd, no Inductor) over packed, padded rows
    through SWA, dense and CSA layers, the indexer's loss on: region selection and sparse
    attention run outside the graph; every gradient equals eager's."""
    model = tiny_model(layer_types=("swa", "dense", "swa", "csa"))
    model.set_indexer_training("sparse")
    positions, padding = packed_positions(DOCUMENTS)
    labels = token_ids(seed=7)
    checks.assert_compiled_equals_eager(
        model, lambda run: run(token_ids(), positions, padding, labels=labels)
    )


# -- context parallelism on gloo ranks -------------------------------------------------------------


def _sharded(rank, world_size, model, ids, positions, padding, labels):
    local = ids.shape[1] // world_size
    rows = slice(rank * local, (rank + 1) * local)
    seen = capture_selections(model)
    out = model(
        ids[:, rows],
        positions[:, rows],
        padding[:, rows],
        labels[:, rows],
        cp_group=dist.group.WORLD,
    )
    return checks.shard_result(model, out, seen[0])


@pytest.mark.parametrize(
    ("world_size", "window"),
    [(2, WINDOW), (4, WINDOW), (4, 16)],
    ids=["2ranks-halo", "4ranks-halo", "4ranks-window-past-a-shard"],
)
def test_context_parallel_shards_equal_the_single_rank_model(world_size, window):
    model = tiny_model(sliding_window=window, layer_types=("swa", "dense", "swa", "csa"))
    ids, labels = token_ids(), token_ids(seed=8)
    positions, padding = packed_positions(DOCUMENTS)
    seen = capture_selections(model)
    expected = model(ids, positions, padding, labels)
    expected.loss.backward()
    ref_grads = [p.grad for p in model.parameters() if p.requires_grad]
    fresh = tiny_model(sliding_window=window, layer_types=("swa", "dense", "swa", "csa"))
    results = run_on_ranks(world_size, _sharded, fresh, ids, positions, padding, labels)
    checks.assert_shards_equal_single_rank(results, expected, ref_grads, seen[0], route_dim=2)


# -- training and checkpoints ------------------------------------------------------------------------


def test_tiny_model_trains_and_its_state_dict_round_trips_exactly():
    model = tiny_model(moe_layers=(1,), num_experts=4, moe_intermediate_size=16)
    assert model.config.layer_types == ("swa", "swa", "swa", "csa")
    assert any(k.endswith("indexer.q_proj.weight") for k in model.state_dict())
    checks.assert_learns_and_round_trips(
        model,
        token_ids(2, SEQUENCE, seed=9),
        lambda: tiny_model(seed=123, moe_layers=(1,), num_experts=4, moe_intermediate_size=16),
    )


# -- errors at the boundary ------------------------------------------------------------------------


def _positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(input_ids=torch.zeros(2, 8)), TypeError, "input_ids must be an integer tensor"),
        (
            dict(positions=torch.zeros(2, 8, dtype=torch.int32)),
            TypeError,
            "positions must be a torch.int64 tensor",
        ),
        (
            dict(positions=torch.zeros(2, 7, dtype=torch.int64)),
            ValueError,
            "positions must have input_ids' shape",
        ),
        (
            dict(positions=_positions([[0, 1, 2, -3, 4, 5, 6, 7]] * 2)),
            ValueError,
            "positions of valid tokens must be >= 0",
        ),
        (
            dict(positions=_positions([[1, 2, 3, 4, 5, 6, 7, 8]] * 2)),
            ValueError,
            "positions must start every document at 0",
        ),
        (dict(positions=_positions([[0, 1, 2, 4, 5, 6, 7, 8]] * 2)), ValueError, "count up by one"),
        (
            dict(padding_mask=torch.zeros(2, 8, dtype=torch.long)),
            TypeError,
            "padding_mask must be a torch.bool tensor",
        ),
        (
            dict(padding_mask=torch.tensor([[True] + [False] * 7] * 2)),
            ValueError,
            "padding_mask must mark padding only after the valid tokens",
        ),
        (
            dict(labels=torch.zeros(2, 7, dtype=torch.long)),
            ValueError,
            "labels must be an integer tensor shaped like input_ids",
        ),
        (
            dict(cp_group=ContextParallelLayout(0, 2, 12, 6)),
            ValueError,
            "cp_group.local_length \\(6\\) must be the tokens per row",
        ),
        (
            dict(cp_group="ranks"),
            TypeError,
            "cp_group must be None, a torch.distributed ProcessGroup",
        ),
    ],
    ids=[
        "float-ids",
        "int32-positions",
        "positions-shape",
        "negative-position",
        "document-not-at-0",
        "position-gap",
        "int-padding",
        "padding-first",
        "labels-shape",
        "cp-length",
        "cp-type",
    ],
)
def test_bad_batches_raise_naming_the_argument(kwargs, error, match):
    model = tiny_model()
    kwargs = {"input_ids": torch.zeros(2, 8, dtype=torch.long), **kwargs}
    with pytest.raises(error, match=match):
        model(**kwargs)


def test_a_cp_shard_that_is_not_a_multiple_of_the_region_size_is_rejected():
    model = tiny_model()
    cp = ContextParallelLayout(0, 2, 14, 7)  # planned without a process group
    with pytest.raises(
        ValueError,
        match=r"local length \(7\) must be a multiple of sparse_config.region_size \(4\)",
    ):
        model(torch.zeros(1, 7, dtype=torch.long), cp_group=cp)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            dict(num_attention_heads=5),
            "num_attention_heads \\(5\\) must be a multiple of num_attention_groups",
        ),
        (dict(layer_types=("swa", "qsa", "swa", "csa")), "layer_types must be one of"),
        (dict(layer_types=("swa",)), "layer_types must hold num_hidden_layers=4"),
        (dict(attn_backend="magic"), "attn_backend must be one of"),
        (dict(partial_rotary_factor=0.3125), "partial_rotary_factor of layer 0"),
        (dict(rope_theta=(1.0, 2.0)), "rope_theta must hold num_hidden_layers=4"),
        (dict(swiglu_limits="big"), "swiglu_limits must be a float or a sequence"),
        (dict(moe_layers=(4,)), "moe_layers must be distinct layer indices in \\[0, 4\\)"),
        (
            dict(moe_layers=(1,), num_experts_per_tok=9),
            "num_experts_per_tok \\(9\\) must be <= num_experts",
        ),
        (
            dict(hidden_size=64),
            "sparse_config.hidden_size \\(32\\) must equal hidden_size \\(64\\)",
        ),
        (
            dict(num_attention_groups=4),
            "sparse_config.num_provider_groups \\(2\\) must equal num_attention_groups \\(4\\)",
        ),
        (dict(sliding_window=0), "sliding_window must be a positive int"),
        (dict(sparse=dict(rope_theta=(1.0, 2.0))), "per-layer sparse_config.rope_theta must hold"),
    ],
    ids=[
        "heads",
        "layer-type",
        "layer-count",
        "backend",
        "rotary",
        "theta-count",
        "limits",
        "moe-index",
        "moe-topk",
        "sparse-width",
        "sparse-groups",
        "window",
        "sparse-theta",
    ],
)
def test_bad_configs_raise_at_construction_naming_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_default_layer_pattern_is_csa_on_every_fourth_layer():
    config = tiny_config(
        num_hidden_layers=8, rope_theta=1e4, partial_rotary_factor=0.5, swiglu_limits=0.0
    )
    assert config.layer_types == ("swa", "swa", "swa", "csa") * 2
    assert config.csa_layers == (3, 7)


def test_setup_cp_attention_takes_a_mesh_group_and_refuses_a_batch_of_another_group():
    layer, config = layer_of("swa")

    class Mesh:  # a 1-D DeviceMesh's interface
        def get_group(self):
            return "cp-group"

    layer.setup_cp_attention(Mesh())
    assert layer.cp_group == "cp-group"
    with pytest.raises(ValueError, match="another context-parallel group"):
        layer(hidden_states(), Step5Batch.create(config, token_ids()))
