"""QSA attention, decoder layer and model against plain references (CPU; Triton interpreted)."""

import copy
import itertools

import model_checks as checks
import pytest
import torch
import torch.distributed as dist

from sa_cp import ContextParallelLayout
from sa_cp.testing import run_on_ranks
from sa_kernels.backend import triton_interpret
from sa_layers import QSAAttention, QSABatch, QSAConfig
from sa_layers.testing import tiny_qsa_config as tiny_config
from sa_layers.testing import tiny_qsa_model as tiny_model
from sa_routing import QSAContextParallel, apply_qsa_rope

SEQUENCE = 40


def token_ids(batch: int = 2, length: int = SEQUENCE, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))


def layout(config: QSAConfig, ids: torch.Tensor, **kwargs) -> QSABatch:
    return QSABatch.create(
        ids,
        rotary_dim=config.rotary_dim,
        rope_theta=config.rope_theta,
        compress_ratio=config.indexer_compress_ratio,
        **kwargs,
    )


def reference_attention(layer: QSAAttention, hidden: torch.Tensor, batch: QSABatch, ids=None):
    """Float64 gated attention written out: dense softmax over the route sets (or causal-in-document
    when `ids` is None), padding queries zero."""
    cfg = layer.config
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, s, _ = hidden.shape
    x = hidden.double()
    qg = (x @ layer.q_proj.weight.double().T).view(b, s, h, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]

    def norm(t, w):
        return checks.rms_norm64(t, w, cfg.rms_norm_eps)

    freqs = batch.freqs.double().expand(b, -1, -1)
    q = apply_qsa_rope(norm(q, layer.q_norm.weight), freqs)
    k = apply_qsa_rope(
        norm((x @ layer.k_proj.weight.double().T).view(b, s, kv, d), layer.k_norm.weight), freqs
    )
    v = (x @ layer.v_proj.weight.double().T).view(b, s, kv, d)
    k, v = (t.repeat_interleave(h // kv, dim=2) for t in (k, v))
    docs = batch.key_documents
    if ids is None:
        idx = torch.arange(s)
        mask = (docs[:, :, None] == docs[:, None, :]) & (idx[:, None] >= idx[None, :])
        mask &= (docs >= 0)[:, :, None]
    else:
        mask = torch.zeros(b, s, s, dtype=torch.bool)
        for bi in range(b):
            for row in range(s):
                valid = ids[bi, row][ids[bi, row] >= 0].long()
                mask[bi, row, valid] = True
    out = checks.masked_attention64(q, k, v, mask[:, None])
    return (torch.sigmoid(gate) * out).flatten(-2) @ layer.o_proj.weight.double().T


def capture_routes(layer: QSAAttention) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    layer.indexer.register_forward_hook(lambda _m, _i, out: seen.append(out))
    return seen


# -- the layer against its reference ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "gather"])
def test_qsa_layer_equals_dense_attention_over_the_routes_its_indexer_chose(backend):
    model = tiny_model(attn_backend=backend)
    layer = model.layers[0].self_attn
    seen = capture_routes(layer)
    hidden = torch.randn(2, SEQUENCE, 32, generator=torch.Generator().manual_seed(2))
    batch = layout(model.config, token_ids())
    out, _ = layer(hidden, batch)
    (ids,) = seen
    sparse_rows = (ids[:, 9:] >= 0).sum(-1) < torch.arange(9, SEQUENCE) + 1
    assert sparse_rows.all()  # rows past the dense prefix really drop keys
    torch.testing.assert_close(
        out.double(), reference_attention(layer, hidden, batch, ids), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("layer_types", [("qsa", "qsa"), ("qsa", "dense")], ids=["qsa", "mixed"])
def test_model_logits_and_gradients_equal_a_plain_float64_model(layer_types):
    """A right-padded batch: logits on valid tokens and every non-indexer parameter's gradient
    equal the model written out in float64 (`reference_attention` over the routes the indexers
    chose, causal within documents for dense layers)."""
    model = tiny_model(layer_types=layer_types)
    routes: list[torch.Tensor] = []
    for layer in model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.register_forward_hook(lambda _m, _i, out: routes.append(out))
    mask = torch.ones(2, SEQUENCE, dtype=torch.long)
    mask[1, 29:] = 0
    ids = token_ids()
    batch = layout(model.config, ids, attention_mask=mask)

    def reference():
        assert len(routes) == layer_types.count("qsa")
        chosen = iter(routes)
        return checks.language_model64(
            model,
            ids,
            lambda attn, x: reference_attention(
                attn, x, batch, next(chosen) if attn.indexer is not None else None
            ),
        )

    checks.assert_model_equals_float64(
        model, lambda: model(ids, attention_mask=mask).logits, reference, mask.bool()[..., None]
    )


def test_qsa_layer_equals_dense_causal_attention_up_to_budget_plus_ratio_minus_one_tokens():
    config = tiny_config()
    length = config.indexer_budget + config.indexer_compress_ratio - 1  # 9: every row is dense
    model = tiny_model()
    qsa = model.layers[0].self_attn
    dense = QSAAttention(tiny_config(layer_types=("dense", "dense")), 0)
    dense.load_state_dict(
        {k: v for k, v in qsa.state_dict().items() if not k.startswith("indexer")}
    )
    hidden = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(3))
    batch = layout(config, token_ids(length=length))
    outs, grads = [], []
    for layer in (qsa, dense):
        x = hidden.clone().requires_grad_(True)
        out, _ = layer(x, batch)
        out.square().sum().backward()
        outs.append(out)
        params = [(n, p) for n, p in layer.named_parameters() if not n.startswith("indexer.")]
        grads.append([("input", x.grad), *((n, p.grad) for n, p in params)])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert [n for n, _ in grads[0]] == [n for n, _ in grads[1]] and len(grads[0]) >= 7
    for (name, a), (_, b) in zip(*grads, strict=True):  # FP32 sums in another order
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=name)
    torch.testing.assert_close(
        outs[1].double(), reference_attention(dense, hidden, batch), rtol=1e-5, atol=1e-6
    )


def test_right_padding_rows_equal_their_unpadded_sequence_and_padding_outputs_zero():
    model = tiny_model()
    layer = model.layers[0].self_attn
    hidden = torch.randn(2, SEQUENCE, 32, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, SEQUENCE, dtype=torch.long)
    mask[1, 27:] = 0
    out, _ = layer(hidden, layout(model.config, token_ids(), attention_mask=mask))
    alone, _ = layer(hidden[1:, :27], layout(model.config, token_ids(1, 27)))
    torch.testing.assert_close(out[1, :27], alone[0], rtol=1e-5, atol=1e-6)
    assert out[1, 27:].abs().max() == 0
    for kind in ("qsa", "dense"):
        m = tiny_model(layer_types=(kind, kind))
        full = m(token_ids(), attention_mask=mask).logits
        single = m(token_ids()[1:, :27]).logits
        torch.testing.assert_close(full[1, :27], single[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qsa", "dense"])
def test_packed_documents_equal_each_document_alone_and_routes_stay_in_their_document(kind):
    model = tiny_model(layer_types=(kind, kind))
    bounds = (0, 13, 30, SEQUENCE)
    ids = token_ids(1)
    seen = capture_routes(model.layers[0].self_attn) if kind == "qsa" else []
    embeds = model.embed_tokens(ids).detach().requires_grad_(True)
    batch = layout(model.config, ids, cu_seqlens=torch.tensor(bounds))
    packed, _ = model.layers[0](embeds, batch)
    weight = torch.randn(packed.shape, generator=torch.Generator().manual_seed(5))
    (packed * weight).sum().backward()
    for start, stop in itertools.pairwise(bounds):
        piece = embeds.detach()[:, start:stop].clone().requires_grad_(True)
        alone, _ = model.layers[0](piece, layout(model.config, ids[:, start:stop]))
        (alone * weight[:, start:stop]).sum().backward()
        torch.testing.assert_close(packed[:, start:stop], alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(embeds.grad[:, start:stop], piece.grad, rtol=1e-4, atol=2e-5)
        if seen:
            routes = seen[0][0, start:stop]
            valid = routes[routes >= 0]
            assert ((valid >= start) & (valid < stop)).all()


# -- replay under activation checkpointing ---------------------------------------------------------


def train_step(mode: str, reuse: bool = True):
    model = tiny_model(reuse_routes_on_recompute=reuse)
    return checks.checkpointed_step(
        model, mode, lambda m: m(token_ids(), labels=token_ids(seed=7)).loss
    )


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_replays_routes_indexer_runs_once_per_layer_and_grads_are_bitwise_equal(mode):
    ref_loss, ref_grads, ref_calls = train_step("none")
    loss, grads, calls = train_step(mode)
    assert ref_calls == calls == 2  # two QSA layers, one indexer call each
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


@pytest.mark.skipif(
    not triton_interpret(), reason="the gather kernels need TRITON_INTERPRET=1 on CPU"
)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_replays_the_route_block_mask_with_the_routes(mode, monkeypatch):
    """On the gather backend each routed layer builds its `RouteBlockMask` once per step: the
    recompute replays ids and mask together (no rebuild, so no host read); grads bitwise equal."""
    from sa_layers import routes

    builds = []
    build = routes.build_route_block_mask
    monkeypatch.setattr(
        routes, "build_route_block_mask", lambda *a, **k: builds.append(1) or build(*a, **k)
    )

    def step(mode):
        builds.clear()
        model = tiny_model(attn_backend="gather")
        ids, labels = token_ids(1, 24), token_ids(1, 24, seed=7)
        result = checks.checkpointed_step(model, mode, lambda m: m(ids, labels=labels).loss)
        return result, len(builds)

    (ref_loss, ref_grads, _), ref_builds = step("none")
    (loss, grads, calls), mask_builds = step(mode)
    assert ref_builds == mask_builds == calls == 2  # two QSA layers
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_without_route_reuse_the_recompute_runs_the_indexer_again():
    _, _, calls = train_step("full", reuse=False)
    assert calls == 4


# -- the per-forward dense mask and torch.compile --------------------------------------------------


def test_dense_layers_read_the_mask_the_batch_built_once_and_plain_batches_need_none(monkeypatch):
    from sa_layers.qsa import attention
    from sa_layers.qsa import layout as layout_module

    model = tiny_model(layer_types=("dense", "dense"))
    mask = torch.ones(2, SEQUENCE, dtype=torch.long)
    mask[1, 29:] = 0
    expected = model(token_ids(), attention_mask=mask).logits
    builds = []
    build = layout_module.dense_visibility
    monkeypatch.setattr(layout_module, "dense_visibility", lambda *a: builds.append(1) or build(*a))
    monkeypatch.setattr(attention, "dense_visibility", layout_module.dense_visibility)
    out = model(token_ids(), attention_mask=mask).logits
    assert len(builds) == 1  # once per forward, not once per dense layer
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert layout(model.config, token_ids()).dense_mask is None  # plain causal: SDPA's causal path
    padded = layout(model.config, token_ids(), attention_mask=mask)
    visible = padded.dense_mask[:, 0]
    assert visible.shape == (2, SEQUENCE, SEQUENCE)
    assert torch.equal(visible[0], torch.ones(SEQUENCE, SEQUENCE).tril().bool())
    assert not visible[1, :29, 29:].any() and torch.equal(
        visible[1, 29:, 29:], torch.eye(11).bool()
    )
    # a routed model outside the dense warm-up lays out no dense mask
    assert model.attends_densely() and not tiny_model().attends_densely()


def test_compiled_model_forward_and_backward_equal_eager():
    """torch.compile (aot_eager: Dynamo and AOTAutograd, no Inductor) over a padded batch through a
    routed and a dense layer, the indexer's loss on: route selection and sparse attention run
    outside the graph, everything else inside; every gradient equals eager's."""
    model = tiny_model(layer_types=("qsa", "dense"))
    model.set_indexer_training("sparse")
    mask = torch.ones(2, SEQUENCE, dtype=torch.long)
    mask[1, 31:] = 0
    labels = token_ids(seed=7)
    checks.assert_compiled_equals_eager(
        model, lambda run: run(token_ids(), attention_mask=mask, labels=labels)
    )


# -- context parallelism on gloo ranks -------------------------------------------------------------


def _sharded(rank, world_size, model, ids, labels, bounds):
    local = ids.shape[1] // world_size
    cp = QSAContextParallel.create(local, group=dist.group.WORLD, cu_seqlens=bounds)
    rows = slice(rank * local, (rank + 1) * local)
    seen = capture_routes(model.layers[0].self_attn)
    out = model(ids[:, rows], labels=labels[:, rows], cp_context=cp)
    return checks.shard_result(model, out, seen[0])


@pytest.mark.parametrize(
    ("world_size", "packed"),
    [(2, False), (4, False), (2, True)],
    ids=["2ranks", "4ranks", "2ranks-packed"],
)
def test_context_parallel_shards_equal_the_single_rank_model(world_size, packed):
    model = tiny_model(layer_types=("qsa", "dense"))
    bounds = (0, 11, 26, SEQUENCE) if packed else None
    ids, labels = token_ids(1 if packed else 2), token_ids(1 if packed else 2, seed=8)
    seen = capture_routes(model.layers[0].self_attn)
    expected = model(ids, cu_seqlens=bounds, labels=labels)
    expected.loss.backward()
    ref_grads = [p.grad for p in model.parameters() if p.requires_grad]
    results = run_on_ranks(
        world_size, _sharded, tiny_model(layer_types=("qsa", "dense")), ids, labels, bounds
    )
    checks.assert_shards_equal_single_rank(results, expected, ref_grads, seen[0], route_dim=1)


# -- training and checkpoints ------------------------------------------------------------------------


def test_tiny_model_trains_and_its_state_dict_round_trips_exactly():
    model = tiny_model()
    assert any(k.endswith("indexer.qk_proj.weight") for k in model.state_dict())
    checks.assert_learns_and_round_trips(
        model, token_ids(4, 24, seed=9), lambda: tiny_model(seed=123)
    )


def test_bf16_model_keeps_fp32_norm_weights_and_runs():
    model = copy.deepcopy(tiny_model()).to(torch.bfloat16)
    assert model.norm.weight.dtype == torch.float32
    out = model(token_ids(), labels=token_ids(seed=3))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)


# -- errors at the boundary ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(input_ids=torch.zeros(2, 8)), TypeError, "input_ids must be an integer tensor"),
        (
            dict(attention_mask=torch.tensor([[0, 1] * 4] * 2)),
            ValueError,
            "attention_mask rows must be ones then zeros",
        ),
        (
            dict(input_ids=torch.zeros(1, 8, dtype=torch.long), cu_seqlens=(0, 5, 3)),
            ValueError,
            "strictly increasing",
        ),
        (
            dict(input_ids=torch.zeros(1, 8, dtype=torch.long), cu_seqlens=(0, 5)),
            ValueError,
            "must end at the sequence length 8",
        ),
        (
            dict(attention_mask=torch.ones(2, 8), cu_seqlens=(0, 8)),
            ValueError,
            "attention_mask and cu_seqlens exclude each other",
        ),
        (
            dict(attention_mask=torch.ones(2, 8), cp_context=QSAContextParallel.create(8)),
            ValueError,
            "attention_mask and cp_context exclude each other",
        ),
        (
            dict(
                input_ids=torch.zeros(1, 8, dtype=torch.long),
                cu_seqlens=(0, 8),
                cp_context=QSAContextParallel.create(8),
            ),
            ValueError,
            "cu_seqlens and cp_context exclude each other",
        ),
        (
            dict(labels=torch.zeros(2, 7, dtype=torch.long)),
            ValueError,
            "labels must be an integer tensor shaped like input_ids",
        ),
    ],
    ids=[
        "float-ids",
        "left-padded-mask",
        "decreasing-cu",
        "short-cu",
        "mask-and-cu",
        "mask-and-cp",
        "cu-and-cp",
        "labels-shape",
    ],
)
def test_bad_batches_raise_naming_the_argument(kwargs, error, match):
    model = tiny_model()
    kwargs = {"input_ids": torch.zeros(2, 8, dtype=torch.long), **kwargs}
    with pytest.raises(error, match=match):
        model(**kwargs)


def test_a_cp_shard_that_is_not_a_multiple_of_the_compress_ratio_is_rejected():
    model = tiny_model()
    cp = QSAContextParallel(ContextParallelLayout(rank=0, size=2, global_length=14, local_length=7))
    with pytest.raises(
        ValueError, match=r"local length \(7\) must be a multiple of the compress ratio \(2\)"
    ):
        model(torch.zeros(1, 7, dtype=torch.long), cp_context=cp)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            dict(num_attention_heads=5),
            "num_attention_heads \\(5\\) must be a multiple of num_key_value_heads",
        ),
        (
            dict(indexer_budget=9),
            "indexer_budget \\(9\\) must be divisible by indexer_compress_ratio",
        ),
        (dict(layer_types=("qsa", "swa")), "layer_types must be 'qsa' or 'dense'"),
        (dict(attn_backend="magic"), "attn_backend must be one of"),
        (dict(layer_types=("qsa",)), "layer_types must hold num_hidden_layers=2"),
        (dict(partial_rotary_factor=0.1), "rotary_dim"),
    ],
    ids=["heads", "budget", "layer-type", "backend", "layer-count", "rotary"],
)
def test_bad_configs_raise_at_construction_naming_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)
