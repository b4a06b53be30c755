"""One QSA layer and a 4-layer QSA model, fwd+bwd on the GPU, against the same with dense attention.

Reference geometry (hidden 2560, Hq 24 / Hkv 2, D 256, indexer 4 × 128, budget 2048, ratio 4) in
bf16, random hidden states, routes from the layer's own (randomly initialised) indexer. Rows:

    layer            QSAAttention fwd+bwd, indexer and route mask included, vs the same weights with
                     `layer_types=("dense",)` (plain causal SDPA); peak memory of both
    route prep       the indexer and `build_route_block_mask` alone (share of the layer)
    model            a 4-layer QSAModel (vocab 4096, so that the LM head does not dominate) fwd+bwd
                     tokens/s vs the all-dense model

Times are the median of 5 calls after one warm-up call (which compiles Flex), CUDA events around
each call (`_timing.py`).
Writes record rows (`tools/bench_records.py`) with `--json PATH`, rewritten after every row.

    python packages/sa-layers/benchmarks/bench_qsa_layer.py [--quick] [--lengths N ...] [--json PATH]
"""

import argparse
import json

import torch
from _timing import gib, median_ms, peak_gib, record_row, share_of_layer, tokens_per_s

from sa_layers import QSAAttention, QSABatch, QSAConfig, QSAModel
from sa_layers.routes import token_routes

GOALS = {32768: 1.0, 65536: 2.5, 131072: 5.0}


VOCAB = 4096


def config(layer_type: str, layers: int = 1) -> QSAConfig:
    return QSAConfig(vocab_size=VOCAB, num_hidden_layers=layers, layer_types=(layer_type,) * layers)


def batch_of(cfg: QSAConfig, length: int) -> QSABatch:
    ids = torch.zeros(1, length, dtype=torch.long, device="cuda")
    return QSABatch.create(
        ids,
        rotary_dim=cfg.rotary_dim,
        rope_theta=cfg.rope_theta,
        compress_ratio=cfg.indexer_compress_ratio,
    )


def layer_rows(length: int) -> list[dict]:
    torch.manual_seed(0)
    sparse = QSAAttention(config("qsa"), 0).cuda().to(torch.bfloat16)
    sparse.indexer.init_weights(0.02)
    dense = QSAAttention(config("dense"), 0).cuda().to(torch.bfloat16)
    dense.load_state_dict(
        {k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer")}
    )
    batch = batch_of(sparse.config, length)
    hidden = torch.randn(1, length, 2560, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(hidden)

    def step(layer):
        return lambda: layer(hidden, batch)[0].backward(grad)

    def route_prep():
        with torch.no_grad():
            ids = sparse.indexer(hidden, batch.freqs, cp_context=batch.cp)
            token_routes(ids, length, 24, "auto")

    t_sparse = median_ms(step(sparse), reps=5, device="cuda")
    t_dense = median_ms(step(dense), reps=5, device="cuda")
    t_prep = median_ms(route_prep, reps=5, device="cuda")
    m_sparse, m_dense = peak_gib(step(sparse)), peak_gib(step(dense))
    shape = f"1 × {length} tokens, hidden 2560, Hq 24 / Hkv 2, D 256, bf16"
    ratio = t_dense / t_sparse
    goal = GOALS.get(length)
    rows = [
        record_row(
            what="QSA layer fwd+bwd (indexer and route mask included)",
            shape=shape,
            time_ms=t_sparse,
            baseline="same layer with dense causal SDPA",
            baseline_ms=t_dense,
            throughput=f"peak {gib(m_sparse)} vs dense {gib(m_dense)}",
            goal=None if goal is None else f"≥ {goal}× dense; peak ≤ dense",
            status=None
            if goal is None
            else ("met" if ratio >= goal and m_sparse <= m_dense else "not met"),
        ),
        record_row(
            what="QSA route preparation (indexer + route mask)",
            shape=shape,
            time_ms=t_prep,
            baseline="the QSA layer fwd+bwd",
            baseline_ms=t_sparse,
            throughput=share_of_layer(t_prep, t_sparse),
            goal="≤ 10 % of the layer" if length == 65536 else None,
            status=("met" if t_prep <= 0.1 * t_sparse else "not met") if length == 65536 else None,
        ),
    ]
    for r in rows:
        print(json.dumps(r))
    return rows


def model_rows(length: int) -> list[dict]:
    times, peaks = {}, {}
    for kind in ("qsa", "dense"):
        torch.manual_seed(0)
        model = QSAModel(config(kind, layers=4)).cuda().to(torch.bfloat16)
        ids = torch.randint(0, VOCAB, (1, length), device="cuda")

        def step(model=model, ids=ids):
            model(ids, labels=ids).loss.backward()

        times[kind] = median_ms(step, reps=5, device="cuda")
        peaks[kind] = peak_gib(step)
        del model
        torch.cuda.empty_cache()
    row = record_row(
        what="4-layer QSAModel fwd+bwd",
        shape=f"1 × {length} tokens, vocab {VOCAB}, bf16",
        time_ms=times["qsa"],
        baseline="same model, every layer dense causal SDPA",
        baseline_ms=times["dense"],
        throughput=(
            f"{tokens_per_s(length, times['qsa'], times['dense'])}; "
            f"peak {peaks['qsa']:.1f} vs {peaks['dense']:.1f} GiB"
        ),
    )
    print(json.dumps(row))
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32k and 64k only")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--json")
    args = parser.parse_args()
    lengths = args.lengths or ([32768, 65536] if args.quick else [32768, 65536, 131072])
    rows: list[dict] = []
    jobs = [(layer_rows, n) for n in lengths] + [(model_rows, n) for n in lengths if n >= 65536]
    for fn, length in jobs:
        rows += fn(length)
        if args.json:  # after every row: a later failure keeps what was measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
