"""Full QSA indexer forward on CUDA: the Triton path against the chunked FP64 PyTorch oracle on the same GPU.

    python packages/sa-routing/benchmarks/bench_qsa_indexer.py [--quick] [--json PATH]

Rows: one per (path, length): hidden 2560, default indexer geometry (4 heads × 128, budget 2048, c 4),
BF16, batch 1. The fast path is `QSAIndexer.forward` (on CUDA: Triton FP32 block scores with the causal
mask in the kernel, then `sa_kernels.stable_topk`); the oracle projects all queries and keys, then runs
`select_qsa_token_ids_reference` (FP64 scores, full stable sort). "ms" is the median forward time
(`triton.testing.do_bench` for the fast path; the oracle, seconds per call, is timed over two calls after
a warm-up at the smallest length). "TFLOP/s" counts the causal scoring work only (Σ over sparse rows of
visible blocks × heads × dim × 2). "temp MiB" is peak memory during the forward beyond inputs, weights
and the output. "same rows" is the fraction of rows whose routes equal the oracle's; "beyond ties"
counts, among up to 200 differing rows, those that differ by more than near-ties (a block whose exact
score is within 1e-5 relative of the k-th best); the forward projects queries chunk by chunk, so a row
can also differ where cuBLAS rounds a chunk's BF16 projection differently from the oracle's one GEMM.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton.testing

from sa_routing import QSAIndexer, QSAIndexerConfig, rotary_table
from sa_routing.qsa.selection.reference import (
    rows_differing_beyond_near_ties,
    select_qsa_token_ids_reference,
)


def _scoring_flops(rows: int, config: QSAIndexerConfig) -> float:
    c, kept = config.indexer_compress_ratio, config.indexer_budget // config.indexer_compress_ratio
    visible = (torch.arange(rows, dtype=torch.float64) + 1) // c
    sparse = visible[visible > kept]
    return float(sparse.sum()) * config.indexer_n_heads * config.indexer_head_dim * 2


def _peak_temp_mib(fn, out_bytes: int) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - base - out_bytes) / 2**20


def _time_once_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _beyond_near_ties(indexer: QSAIndexer, hidden, freqs, routes, expected, limit=200) -> int:
    """Differing rows (up to `limit`, evenly spaced) that differ by more than near-ties."""
    config = indexer.config
    differing = (routes != expected).any(dim=-1)[0].nonzero().flatten()
    if differing.numel() > limit:
        differing = differing[torch.linspace(0, differing.numel() - 1, limit).long()]
    queries = indexer.index_queries(hidden, freqs)
    keys = indexer.compressed_keys(hidden, freqs)
    bad = 0
    for i in differing.tolist():
        bad += len(
            rows_differing_beyond_near_ties(
                queries[:, i : i + 1],
                keys,
                routes[:, i : i + 1],
                expected[:, i : i + 1],
                token_budget=config.indexer_budget,
                compress_ratio=config.indexer_compress_ratio,
                query_position_offset=i,
            )
        )
    return bad


def _measure(indexer: QSAIndexer, oracle, length: int) -> list[dict]:
    config = indexer.config
    hidden = torch.randn(1, length, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    freqs = rotary_table(torch.arange(length)[None], 64).cuda()
    out_bytes = length * config.route_width * 4
    fast_routes = indexer(hidden, freqs)
    oracle_routes = oracle(hidden, freqs)
    same = (fast_routes == oracle_routes).all(dim=-1).float().mean().item()
    beyond = _beyond_near_ties(indexer, hidden, freqs, fast_routes, oracle_routes)
    del fast_routes, oracle_routes
    fast_ms = triton.testing.do_bench(lambda: indexer(hidden, freqs), warmup=50, rep=300)
    oracle_ms = _time_once_ms(lambda: oracle(hidden, freqs), calls=2 if length <= 32768 else 1)
    fast_mib = _peak_temp_mib(lambda: indexer(hidden, freqs), out_bytes)
    oracle_mib = _peak_temp_mib(lambda: oracle(hidden, freqs), out_bytes)
    flops = _scoring_flops(length, config)
    rows = []
    for name, ms, mib in (
        ("qsa_indexer_triton", fast_ms, fast_mib),
        ("qsa_indexer_oracle", oracle_ms, oracle_mib),
    ):
        rows.append(
            {
                "name": name,
                "shape": f"B1-S{length}-hidden{config.hidden_size}-H4x128-budget2048-c4-bf16",
                "ms": round(ms, 3),
                "tflops": round(flops / ms / 1e9, 2),
                "temp_mib": round(mib, 1),
                "ratio_vs_oracle": round(oracle_ms / ms, 2),
                "same_rows": same,
                "beyond_near_ties": beyond,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="8k and 32k tokens instead of 32k and 128k"
    )
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    lengths = (8192, 32768) if args.quick else (32768, 131072)

    config = QSAIndexerConfig(hidden_size=2560)
    torch.manual_seed(0)
    indexer = QSAIndexer(config)
    indexer.init_weights(0.02)
    indexer = indexer.to("cuda", torch.bfloat16)
    budget, c = config.indexer_budget, config.indexer_compress_ratio

    def oracle(hidden, freqs):
        queries, keys = indexer.index_queries(hidden, freqs), indexer.compressed_keys(hidden, freqs)
        return select_qsa_token_ids_reference(
            queries, keys, None, token_budget=budget, compress_ratio=c
        )

    rows_out = []
    warm = torch.randn(1, 4096, 2560, device="cuda", dtype=torch.bfloat16)
    warm_freqs = rotary_table(torch.arange(4096)[None], 64).cuda()
    indexer(warm, warm_freqs), oracle(warm, warm_freqs)
    for length in lengths:
        rows_out.extend(_measure(indexer, oracle, length))

    print(
        f"{'name':<20} {'shape':<46} {'ms':>10} {'TFLOP/s':>8} {'temp MiB':>9} {'speedup':>8} "
        f"{'same rows':>9} {'beyond ties':>11}"
    )
    for row in rows_out:
        print(
            f"{row['name']:<20} {row['shape']:<46} {row['ms']:>10.3f} {row['tflops']:>8.2f} "
            f"{row['temp_mib']:>9.1f} {row['ratio_vs_oracle']:>7.2f}x {row['same_rows']:>9.5f} "
            f"{row['beyond_near_ties']:>11d}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows_out, handle, indent=2)


if __name__ == "__main__":
    main()
