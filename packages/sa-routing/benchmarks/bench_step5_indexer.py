"""Step-5 indexer forward and region_metadata on the GPU.

Indexer forward = project_keys + summaries + per-tile query projection + scoring + running top-k, at the
reference geometry (hidden 4096, proxy_dim 256, 16 heads in 4 groups, region 8, topk 512) on one
document of S tokens (the worst case for scoring); metadata is built once outside the timed region, as a
model does. The baseline is the scoring FLOPs alone at 300 TFLOP/s: `2 · G·H · D · Σ_q (p_q // 8)`
over sparse queries; target ratio ≤ 1.3. "project+score" times the query projection and `indexer_score_tile`
calls of the same tile walk, without summaries and top-k. Peak extra memory = peak allocated during the forward minus what was
allocated before it, minus the output. region_metadata: 128k tokens, 8 documents, ms and host syncs
(counted with torch.cuda.set_sync_debug_mode), target ≤ 5 ms and ≤ 1 sync.

    python packages/sa-routing/benchmarks/bench_step5_indexer.py [--quick] [--json PATH]
"""

import argparse
import json
import time
import warnings

import torch

from sa_kernels import indexer_score_tile
from sa_routing import Step5SparseConfig, Step5SparseIndexer, region_metadata
from sa_routing.step5.indexer import region_summaries
from sa_routing.step5.selection import _merge_tiles

PEAK_TFLOPS = 300.0
DEVICE = "cuda"


def do_bench(fn, warmup: int, rep: int) -> float:
    """Median ms: `triton.testing.do_bench` on CUDA; a plain timer for the CPU smoke run."""
    if DEVICE == "cuda":
        from triton.testing import do_bench as triton_bench

        return triton_bench(fn, warmup=warmup, rep=rep)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def count_syncs(fn) -> int:
    if DEVICE != "cuda":
        return -1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def bench_metadata(rows: list[dict], total: int) -> None:
    lengths = [total // 8 + 97 * (i - 4) for i in range(8)]
    lengths[-1] += total - sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    pad = torch.zeros_like(pos, dtype=torch.bool)
    run = lambda: region_metadata(pos, pad, 0, total, 8, 512, window=512)
    run()
    syncs = count_syncs(run)
    ms = do_bench(run, warmup=10, rep=50)
    row = {
        "name": "region_metadata",
        "shape": f"S={total} docs=8",
        "ms": round(ms, 4),
        "host_syncs": syncs,
        "target_ms": 5.0,
    }
    rows.append(row)
    print(
        f"{row['name']:<34} {row['shape']:<22} {ms:>9.3f} ms  host syncs {syncs}  (target <= 5 ms, <= 1 sync)",
        flush=True,
    )


def bench_indexer(rows: list[dict], total: int, options: list[dict]) -> None:
    cfg = Step5SparseConfig()
    torch.manual_seed(0)
    indexer = Step5SparseIndexer(cfg, 3, torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1))
    hidden = torch.randn(1, total, cfg.hidden_size, device=DEVICE).to(torch.bfloat16)
    pos = torch.arange(total, device=DEVICE)[None]
    pad = torch.zeros_like(pos, dtype=torch.bool)
    meta = region_metadata(pos, pad, 0, total, cfg.region_size, cfg.topk)
    hist = (pos[0] // cfg.region_size)[meta.sparse_queries[0]]
    flops = 2 * cfg.index_heads * cfg.proxy_dim * float(hist.sum())
    ideal_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
    shape = f"S={total} G4 H4 D256 topk512"

    keys, logits = indexer.project_keys(hidden, pos)
    summary = region_summaries(keys, logits, meta)

    def scores_only(budget: int, chunk: int) -> None:
        for b, q0, q1, r0, r1 in _merge_tiles(meta.score_tiles, 4, chunk, budget):
            q, w = indexer.project_queries(hidden[:, q0:q1], pos[:, q0:q1])
            for c0 in range(r0, r1, chunk):
                indexer_score_tile(q, w, summary[b : b + 1, c0 : min(c0 + chunk, r1)], 0, q1 - q0)

    for opt in options:
        indexer.selection_options = dict(opt)

        def forward() -> torch.Tensor:
            k, z = indexer.project_keys(hidden, pos)
            return indexer(hidden, pos, k, z, pos, pad, metadata=meta).region_ids

        out = forward()
        extra, syncs = -1, count_syncs(forward)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = forward()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()
        del out
        ms = do_bench(forward, warmup=5, rep=40)
        score_ms = do_bench(
            lambda o=opt: scores_only(o["score_budget_bytes"], o["region_chunk"]), warmup=5, rep=40
        )
        label = (
            f"{opt['method']} chunk={opt['region_chunk']} budget={opt['score_budget_bytes'] >> 20}M"
        )
        row = {
            "name": "indexer forward",
            "options": label,
            "shape": shape,
            "ms": round(ms, 3),
            "tflops": round(flops / ms / 1e9, 1),
            "scores_only_ms": round(score_ms, 3),
            "ideal_ms_at_300": round(ideal_ms, 3),
            "ratio_vs_ideal": round(ms / ideal_ms, 3),
            "peak_extra_gib": round(extra / 2**30, 3),
            "host_syncs": syncs,
        }
        rows.append(row)
        print(
            f"{'indexer forward':<16} {label:<34} {shape:<28} {ms:>9.3f} ms {row['tflops']:>6.1f} TFLOP/s"
            f"  {row['ratio_vs_ideal']:>5.2f}x ideal ({ideal_ms:.2f} ms)  project+score {score_ms:.3f} ms"
            f"  peak extra {row['peak_extra_gib']:.2f} GiB  host syncs {syncs}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128k only, default selection options")
    parser.add_argument("--json", help="write the rows as JSON to this path")
    parser.add_argument(
        "--cpu-smoke", type=int, metavar="S", help="run once on CPU at S tokens (checks the script)"
    )
    args = parser.parse_args()
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
        rows: list[dict] = []
        bench_metadata(rows, args.cpu_smoke)
        bench_indexer(
            rows,
            args.cpu_smoke,
            [{"method": "threshold", "region_chunk": 256, "score_budget_bytes": 1 << 22}],
        )
        return
    import triton

    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
        flush=True,
    )
    rows = []
    bench_metadata(rows, 131072)
    default = {"method": "threshold", "region_chunk": 16384, "score_budget_bytes": 1 << 30}
    options = [default]
    if not args.quick:
        options += [
            {"method": "composite", "region_chunk": 16384, "score_budget_bytes": 1 << 30},
            {"method": "threshold", "region_chunk": 16384, "score_budget_bytes": 256 << 20},
        ]
    for total in [131072] if args.quick else [65536, 131072]:
        bench_indexer(rows, total, options if total == 131072 else [default])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
