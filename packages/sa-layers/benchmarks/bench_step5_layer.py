"""One Step-5 CSA layer, one SWA layer and a 4-layer Step-5 model, fwd+bwd on the GPU, each against a
baseline measured in the same run.

Attention geometry of `Step5Config`'s defaults (64 query heads, 4 KV groups, head_dim 192, window
512; indexer 4 groups × 4 heads × 256, region 8, top-k 512) in bf16, one document per row, random
hidden states. Rows:

    csa layer      Step5Attention ("csa", hidden 4096) fwd+bwd, indexer and region mask included, vs
                   the same weights with plain causal SDPA (K/V expanded to every head, no math
                   fallback); peak memory of both. Three kinds of routes (`--routes`): those of the
                   layer's own randomly initialised indexer, and `sa_kernels.synthetic`'s scattered
                   (`csa_selection`) and clustered (`clustered_csa_selection`) ones, which replace
                   the indexer's selection after it ran (its cost stays in the layer) and whose
                   block mask the layer builds as for its own; "auto" picks the backend each time
    route prep     the indexer's selection and its block mask alone (share of the CSA layer)
    swa attention  the SWA layer's attention fwd+bwd on one document (the batch's window-only
                   Flex mask) and on PACKED_DOCUMENTS packed documents (window and document mask)
                   vs FlexAttention with its own sliding-window block mask, the same compiled
                   kernel and kernel options (`flex_kernel_options`)
    swa layer      the whole SWA layer fwd+bwd with either mask
    model          a 4-layer Step5Model (SWA, SWA, SWA, CSA; hidden 2048, vocab 32 000) fwd+bwd
                   tokens/s vs the same model with the CSA layer replaced by dense causal SDPA;
                   peak memory of both (activation checkpointing on both where one runs out of
                   memory without it, said in the shape)

Times are the median of `--reps` calls after one warm-up call (which compiles Flex), CUDA events
around each call: the calls last milliseconds to seconds, so a handful keeps the whole run within a
few minutes on an H200. `--smoke` runs every path at a tiny size on the CPU (Flex eager) to
check the code, not to measure. Writes record rows (`tools/bench_records.py`) with `--json PATH`.

    python packages/sa-layers/benchmarks/bench_step5_layer.py [--quick] [--lengths N ...] [--reps R]
        [--routes indexer scattered clustered] [--smoke] [--json PATH]
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import time

import torch
from _timing import gib, log, median_ms, peak_gib, record_row, share_of_layer, tokens_per_s
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from sa_kernels.sparse_region_attention import auto_backend
from sa_kernels.synthetic import clustered_csa_selection, csa_selection, region_layout
from sa_layers import Step5Attention, Step5Batch, Step5Config, Step5Model
from sa_layers.step5 import attention as step5_attention
from sa_layers.step5.attention import _flex
from sa_routing import Step5SparseConfig

CSA_GOALS = {32768: 1.0, 65536: 2.5, 131072: 5.0}
# the CSA layer's routes: its own indexer's, or sa_kernels.synthetic's (the indexer still runs)
ROUTE_NAMES = {
    "indexer": "the indexer's routes",
    "scattered": "synthetic scattered routes",
    "clustered": "synthetic clustered routes",
}
SWA_LENGTH = 65536
PACKED_DOCUMENTS = 4  # documents of the packed SWA row
MODEL_LENGTHS = (65536, 131072)
# every fused SDPA backend, never the math one (it would build [S, S] scores)
FUSED_SDPA = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
]


@dataclasses.dataclass(frozen=True)
class Setup:
    """Sizes of one run: the GPU reference geometry, or the tiny CPU smoke one."""

    device: str
    layer_hidden: int
    model_hidden: int
    vocab: int
    attention: dict
    sparse: dict
    reps: int

    def config(self, layer_types: tuple[str, ...], hidden: int, **fields) -> Step5Config:
        return Step5Config(
            vocab_size=self.vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 11 // 4,
            num_hidden_layers=len(layer_types),
            layer_types=layer_types,
            sparse_config=Step5SparseConfig(hidden_size=hidden, **self.sparse),
            **self.attention,
            **fields,
        )

    def geometry(self, hidden: int) -> str:
        a = {"num_attention_heads": 64, "num_attention_groups": 4, "head_dim": 192} | self.attention
        s = {"region_size": 8, "topk": 512} | self.sparse
        return (
            f"hidden {hidden}, Hq {a['num_attention_heads']} / G {a['num_attention_groups']}, "
            f"D {a['head_dim']}, region {s['region_size']}, top-k {s['topk']}, bf16"
            + (" (CPU smoke)" if self.device == "cpu" else "")
        )


GPU = Setup("cuda", 4096, 2048, 32000, {}, {}, reps=3)
SMOKE = Setup(
    "cpu",
    64,
    64,
    128,
    {"num_attention_heads": 8, "num_attention_groups": 2, "head_dim": 32, "sliding_window": 16},
    {
        "proxy_dim": 32,
        "index_heads": 4,
        "num_provider_groups": 2,
        "rope_dim": 8,
        "region_size": 4,
        "topk": 4,
    },
    reps=1,
)


# -- measuring --------------------------------------------------------------------------------------


def time_ms(fn, setup: Setup) -> float:
    """Median milliseconds of `setup.reps` calls after one warm-up call."""
    return median_ms(fn, reps=setup.reps, device=setup.device)


# -- the layers -------------------------------------------------------------------------------------


def init_normal(module: nn.Module, std: float = 0.02) -> nn.Module:
    """Normal(0, std) projections (the indexer's included), as the model's initialisation."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
    return module


def use_causal_sdpa(attn: Step5Attention) -> Step5Attention:
    """Make a "dense" layer attend by plain causal SDPA (one document, no padding, one rank): K/V
    expanded to every query head, a fused backend only."""
    hpg = attn.config.heads_per_group

    def causal_attention(query, key, value, batch):
        k, v = (t.repeat_interleave(hpg, dim=2).transpose(1, 2) for t in (key, value))
        with sdpa_kernel(FUSED_SDPA) if query.is_cuda else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2), k, v, is_causal=True, scale=attn.scale
            )
        return out.transpose(1, 2)

    attn.causal_attention = causal_attention
    return attn


def fwd_bwd(module: nn.Module, hidden: torch.Tensor, batch: Step5Batch, grad: torch.Tensor):
    def step():
        module.zero_grad(set_to_none=True)
        hidden.grad = None
        module(hidden, batch)[0].backward(grad)

    return step


def layer_inputs(setup: Setup, config: Step5Config, length: int):
    ids = torch.zeros(1, length, dtype=torch.long, device=setup.device)
    batch = Step5Batch.create(config, ids)
    hidden = torch.randn(
        1,
        length,
        config.hidden_size,
        device=setup.device,
        dtype=torch.bfloat16,
        requires_grad=True,
    )
    return batch, hidden, torch.randn_like(hidden)


def synthetic_selection(kind: str, batch: Step5Batch, config: Step5Config, length: int, seed=0):
    """`sa_kernels.synthetic`'s region ids for the one-document row: "scattered" (`csa_selection`,
    independent random regions per query) or "clustered" (`clustered_csa_selection`, whole
    128-key tiles shared by each 128-query tile)."""
    metadata = batch.sparse_metadata
    sparse = config.sparse_config
    device = metadata.region_sources.device
    sources, owners, firsts = region_layout([[length]], length, sparse.region_size, device)
    if not torch.equal(sources, metadata.region_sources):
        raise RuntimeError("synthetic_selection: the batch's regions are not one document's")
    gen = torch.Generator(device=device).manual_seed(seed)
    args = (owners, firsts, metadata.region_count)
    kw = {"groups": config.num_attention_groups, "topk": sparse.topk, "generator": gen}
    if kind == "scattered":
        return csa_selection(*args, **kw)
    # runs of one 128-key tile (fewer where the smoke run's top-k cannot hold two)
    run = min(128 // sparse.region_size, sparse.topk // 2)
    return clustered_csa_selection(*args, run=run, **kw)


@contextlib.contextmanager
def attending_over(region_ids: torch.Tensor | None):
    """Within the block, CSA layers still run their indexer but attend over `region_ids` (its
    block mask built from them, as for the indexer's own selection); None changes nothing."""
    real = step5_attention.region_routes
    if region_ids is not None:
        step5_attention.region_routes = lambda selection, *args: real(
            dataclasses.replace(selection, region_ids=region_ids), *args
        )
    try:
        yield
    finally:
        step5_attention.region_routes = real


def chosen_backend(layer: Step5Attention, hidden, batch: Step5Batch, length: int) -> str:
    """The backend the layer's sparse attention runs on its current routes ("auto's choice" when
    the config says "auto")."""
    if layer.backend != "auto":
        return layer.backend
    with torch.no_grad():
        routes = layer.select_routes(hidden, batch, length)
    if routes.block_mask is None:
        return "reference (auto's choice)"
    head_dim = layer.config.head_dim
    choice = auto_backend(routes.block_mask, hidden.device, dtype=hidden.dtype, head_dim=head_dim)
    return f"{choice} (auto's choice)"


def csa_rows(setup: Setup, length: int, routes: tuple[str, ...]) -> list[dict]:
    torch.manual_seed(0)
    hidden_size = setup.layer_hidden
    config = setup.config(("csa",), hidden_size)
    sparse = init_normal(Step5Attention(config, 0, torch.bfloat16, setup.device))
    dense = Step5Attention(setup.config(("dense",), hidden_size), 0, torch.bfloat16, setup.device)
    dense.load_state_dict(
        {k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")}
    )
    use_causal_sdpa(dense)
    batch, hidden, grad = layer_inputs(setup, config, length)
    t_dense = time_ms(fwd_bwd(dense, hidden, batch, grad), setup)
    m_dense = peak_gib(fwd_bwd(dense, hidden, batch, grad), setup.device)
    shape = f"1 × {length} tokens, {setup.geometry(hidden_size)}"
    goal = CSA_GOALS.get(length) if setup.device == "cuda" else None
    rows = []
    for kind in routes:
        ids = None if kind == "indexer" else synthetic_selection(kind, batch, config, length)
        with attending_over(ids):
            backend = chosen_backend(sparse, hidden, batch, length)
            t_sparse = time_ms(fwd_bwd(sparse, hidden, batch, grad), setup)
            m_sparse = peak_gib(fwd_bwd(sparse, hidden, batch, grad), setup.device)
        ratio = t_dense / t_sparse
        rows.append(
            record_row(
                what=f"Step-5 CSA layer fwd+bwd, {ROUTE_NAMES[kind]}, {backend} (indexer and "
                "region mask included)",
                shape=shape,
                time_ms=t_sparse,
                baseline="same layer with dense causal SDPA",
                baseline_ms=t_dense,
                throughput=f"peak {gib(m_sparse)} vs dense {gib(m_dense)}",
                goal=None if goal is None else f"≥ {goal}× dense",
                status=None if goal is None else ("met" if ratio >= goal else "not met"),
            )
        )
        if kind == "indexer":

            def route_prep():
                with torch.no_grad():
                    sparse.select_routes(hidden, batch, length)

            t_prep = time_ms(route_prep, setup)
            rows.append(
                record_row(
                    what="Step-5 CSA route preparation (indexer selection + region mask)",
                    shape=shape,
                    time_ms=t_prep,
                    baseline="the CSA layer fwd+bwd on the indexer's routes",
                    baseline_ms=t_sparse,
                    throughput=share_of_layer(t_prep, t_sparse),
                )
            )
    return rows


def swa_rows(setup: Setup, length: int) -> list[dict]:
    torch.manual_seed(0)
    config = setup.config(("swa",), setup.layer_hidden)
    layer = init_normal(Step5Attention(config, 0, torch.bfloat16, setup.device))
    batch, hidden, grad = layer_inputs(setup, config, length)
    window = config.sliding_window

    def sliding_window(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    build = torch.compile(create_block_mask) if setup.device == "cuda" else create_block_mask
    own = build(sliding_window, None, None, length, length, device=setup.device)
    with torch.no_grad():
        q, k, v = (t.detach().requires_grad_(True) for t in layer.project(hidden, batch))
    out_grad = torch.randn_like(q)
    # FlexAttention has no CPU backward: the smoke run takes its Flex paths forward only
    backward = setup.device == "cuda"

    def attention(fn, flex: bool):
        def step():
            for t in (q, k, v):
                t.grad = None
            if flex and not backward:
                fn(q.detach(), k.detach(), v.detach())
            else:
                fn(q, k, v).backward(out_grad)

        return step

    def flex_layer():
        if backward:
            fwd_bwd(layer, hidden, own_batch, grad)()
        else:
            with torch.no_grad():
                layer(hidden, own_batch)

    own_batch = dataclasses.replace(batch, flex_masks={"swa": own})
    ours = attention(
        lambda q, k, v: layer.window_attention(q, k, v, batch), flex=bool(batch.flex_masks)
    )
    flex = attention(lambda q, k, v: _flex(q, k, v, own, layer.scale, batch.capability), flex=True)
    # the same row packed with PACKED_DOCUMENTS documents: the window-and-document mask_mod
    ids = torch.zeros(1, length, dtype=torch.long, device=setup.device)
    per_document = length // PACKED_DOCUMENTS
    positions = (torch.arange(length, device=setup.device) % per_document)[None]
    packed_batch = Step5Batch.create(config, ids, positions)
    packed = attention(
        lambda q, k, v: layer.window_attention(q, k, v, packed_batch),
        flex=bool(packed_batch.flex_masks),
    )
    t_ours, t_flex, t_packed = time_ms(ours, setup), time_ms(flex, setup), time_ms(packed, setup)
    t_layer = time_ms(fwd_bwd(layer, hidden, batch, grad), setup)
    t_layer_flex = time_ms(flex_layer, setup)
    shape = f"1 × {length} tokens, window {window}, {setup.geometry(setup.layer_hidden)}"
    if not backward:
        shape += ", Flex forward only"
    ratio = t_flex / t_ours
    goal = setup.device == "cuda" and length == SWA_LENGTH
    return [
        record_row(
            what="Step-5 SWA attention fwd+bwd, one document (window mask)",
            shape=shape,
            time_ms=t_ours,
            baseline="FlexAttention, its own sliding-window block mask",
            baseline_ms=t_flex,
            goal="≥ 0.9× Flex's sliding window" if goal else None,
            status=("met" if ratio >= 0.9 else "not met") if goal else None,
        ),
        record_row(
            what=f"Step-5 SWA attention fwd+bwd, {PACKED_DOCUMENTS} packed documents "
            "(window and document mask)",
            shape=shape,
            time_ms=t_packed,
            baseline="FlexAttention, its own sliding-window block mask (one document)",
            baseline_ms=t_flex,
        ),
        record_row(
            what="Step-5 SWA layer fwd+bwd",
            shape=shape,
            time_ms=t_layer,
            baseline="same layer on Flex's own sliding-window block mask",
            baseline_ms=t_layer_flex,
        ),
    ]


# -- the model --------------------------------------------------------------------------------------


def model_step(setup: Setup, kind: str, length: int, checkpointing: bool):
    """A fwd+bwd step of the 4-layer model: "csa" (SWA, SWA, SWA, CSA) or "dense" (the last layer a
    dense-SDPA attention with the same weights)."""
    hidden = setup.model_hidden
    torch.manual_seed(0)
    if kind == "csa":
        model = Step5Model(
            setup.config(("swa", "swa", "swa", "csa"), hidden), torch.bfloat16, setup.device
        )
    else:
        # an all-SWA config, so that the batch builds no region metadata; then layer 3 attends densely
        model = Step5Model(setup.config(("swa",) * 4, hidden), torch.bfloat16, setup.device)
        dense = Step5Attention(
            setup.config(("swa", "swa", "swa", "dense"), hidden), 3, torch.bfloat16, setup.device
        )
        dense.load_state_dict(model.layers[3].self_attn.state_dict())
        model.layers[3].self_attn = use_causal_sdpa(dense)
    if checkpointing:
        model.enable_activation_checkpointing()
    ids = torch.randint(0, setup.vocab, (1, length), device=setup.device)

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    return model, step


def measure_model(setup: Setup, kind: str, length: int, checkpointing: bool):
    """(median ms, peak GiB) of the model's fwd+bwd step; the model is freed on return."""
    _, step = model_step(setup, kind, length, checkpointing)
    return time_ms(step, setup), peak_gib(step, setup.device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_rows(setup: Setup, length: int) -> list[dict]:
    for checkpointing in (False, True):
        times, peaks = {}, {}
        try:
            for kind in ("csa", "dense"):
                times[kind], peaks[kind] = measure_model(setup, kind, length, checkpointing)
                free_memory()
            break
        except torch.cuda.OutOfMemoryError:
            if checkpointing:
                raise
        free_memory()  # outside the handler: the failed call's frames are gone
    ckpt = ", activation checkpointing" if checkpointing else ""
    row = record_row(
        what="4-layer Step5Model fwd+bwd (SWA, SWA, SWA, CSA)",
        shape=f"1 × {length} tokens, vocab {setup.vocab}, {setup.geometry(setup.model_hidden)}{ckpt}",
        time_ms=times["csa"],
        baseline="same model, the CSA layer dense causal SDPA",
        baseline_ms=times["dense"],
        throughput=(
            f"{tokens_per_s(length, times['csa'], times['dense'])}; "
            f"peak {gib(peaks['csa'])} vs {gib(peaks['dense'])}"
        ),
    )
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32k and 64k only")
    parser.add_argument("--lengths", type=int, nargs="+", help="CSA layer and model lengths")
    parser.add_argument(
        "--routes",
        nargs="+",
        choices=tuple(ROUTE_NAMES),
        default=tuple(ROUTE_NAMES),
        help="the CSA layer's routes (default: all)",
    )
    parser.add_argument("--reps", type=int, help="timed calls per measurement (default 3)")
    parser.add_argument(
        "--smoke", action="store_true", help="every path at a tiny size on the CPU, uncompiled"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.smoke:
        setup = SMOKE
        # Flex runs eagerly on the CPU (its unfused path): no compiler, forward only
        step5_attention.compiled_flex = lambda: flex_attention
        lengths, swa_length, model_lengths = [256], 256, [256]
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (or --smoke for the CPU code-path check)")
        setup = GPU
        lengths = args.lengths or ([32768, 65536] if args.quick else [32768, 65536, 131072])
        swa_length = SWA_LENGTH
        model_lengths = [n for n in lengths if n >= min(MODEL_LENGTHS)]
    if args.reps is not None:
        setup = dataclasses.replace(setup, reps=args.reps)
    started = time.perf_counter()
    rows = []

    def emit(new: list[dict], label: str) -> None:
        for r in new:
            print(json.dumps(r), flush=True)
        rows.extend(new)
        log(label, started)

    for length in lengths:
        emit(csa_rows(setup, length, tuple(args.routes)), f"CSA layer at {length}")
    emit(swa_rows(setup, swa_length), f"SWA layer at {swa_length}")
    for length in model_lengths:
        emit(model_rows(setup, length), f"model at {length}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
