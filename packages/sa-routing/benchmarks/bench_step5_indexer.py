"""Step-5 indexer forward and region_metadata on the GPU.

Indexer forward = project_keys + summaries + per-tile query projection + scoring + running top-k, at the
reference geometry (hidden 4096, proxy_dim 256, 16 heads in 4 groups, region 8, topk 512) on one
document of S tokens (the worst case for scoring); metadata is built once outside the timed region, as a
model does. The baseline is the scoring FLOPs alone at 300 TFLOP/s: `2 · G·H · D · Σ_q (p_q // 8)`
over sparse queries; target ratio ≤ 1.3. Per-stage breakdown (CUDA events recorded at the stage marks of
the real forward, summed over tiles): project_keys, summaries, project_queries, score (scoring kernel and
causal masking; its TFLOP/s counts the scored rectangles), topk (`stable_topk`), merge (current region
appended, ids written; the composite method also sorts). For context the ratio is also printed without the
two projection stages (dense GEMMs: the query projection has as many FLOPs as the scoring at 64k);
the target counts them. `--profile` prints the top kernels of `torch.profiler` for one 128k forward and the number of
kernel launches. Peak extra memory = peak allocated during the forward minus what was
allocated before it, minus the output. region_metadata: 128k tokens, 8 documents, ms and host syncs
(counted with torch.cuda.set_sync_debug_mode), target ≤ 5 ms and ≤ 1 sync.

    python packages/sa-routing/benchmarks/bench_step5_indexer.py [--quick] [--profile] [--json PATH]
"""

import argparse
import itertools
import json
import statistics
import time
import warnings
from collections import defaultdict

import torch

from sa_routing import Step5SparseConfig, Step5SparseIndexer, region_metadata
from sa_routing.step5.selection import _merge_tiles, score_call_bytes

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
    """`region_metadata` with the default backend (Triton kernels on CUDA) and, as the baseline of
    the same run, its PyTorch path."""
    lengths = [total // 8 + 97 * (i - 4) for i in range(8)]
    lengths[-1] += total - sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    pad = torch.zeros_like(pos, dtype=torch.bool)
    for backend in ("auto", "reference"):
        run = lambda b=backend: region_metadata(pos, pad, 0, total, 8, 512, window=512, backend=b)
        run()
        syncs = count_syncs(run)
        ms = do_bench(run, warmup=10, rep=50)
        row = {
            "name": "region_metadata" if backend == "auto" else "region_metadata (PyTorch ops)",
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


class _Clock:
    """A CUDA event on the GPU, a host timestamp on the CPU smoke run."""

    def __init__(self) -> None:
        if DEVICE == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_until(self, later: "_Clock") -> float:
        if DEVICE == "cuda":
            return self.event.elapsed_time(later.event)
        return (later.t - self.t) * 1e3


STAGES = ("project_keys", "summaries", "project_queries", "score", "topk", "merge")


def stage_breakdown(forward_marked, runs: int = 3) -> dict[str, float]:
    """Median over `runs` of each stage's ms in one forward (time between consecutive marks)."""
    per_run: list[dict[str, float]] = []
    for _ in range(runs):
        clocks: list[tuple[str, _Clock]] = [("start", _Clock())]

        def mark(name: str, clocks: list = clocks) -> None:
            clocks.append((name, _Clock()))

        forward_marked(mark)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for (_, before), (name, after) in itertools.pairwise(clocks):
            totals[name] += before.ms_until(after)
        per_run.append(totals)
    return {k: statistics.median(r.get(k, 0.0) for r in per_run) for k in STAGES}


def print_profile(forward) -> None:
    """Top kernels of one forward by GPU time, and the number of kernel launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    rows = []
    launches = 0
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        if dev > 0 and not e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
            rows.append((dev, e.count, e.key))
            launches += e.count
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"profile: {launches} kernel launches, {total / 1e3:.2f} ms of kernel time", flush=True)
    for dev, count, key in rows[:15]:
        print(
            f"  {dev / 1e3:>9.3f} ms {100 * dev / total:5.1f}%  x{count:<6} {key[:110]}", flush=True
        )


def bench_indexer(rows: list[dict], total: int, options: list[dict], profile: bool = False) -> None:
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
    per_pair = 2 * cfg.index_heads * cfg.proxy_dim
    flops = per_pair * float(hist.sum())
    if flops == 0:
        raise SystemExit(
            f"bench_step5_indexer: S={total} holds no sparse query (every query sees at most "
            f"topk={cfg.topk} earlier regions of {cfg.region_size} tokens); use more than "
            f"{cfg.topk * cfg.region_size} tokens"
        )
    ideal_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
    shape = f"S={total} G4 H4 D256 topk512"

    for opt in options:
        indexer.selection_options = dict(opt)
        groups = cfg.num_provider_groups
        call_bytes = score_call_bytes(opt["method"], DEVICE, opt["region_chunk"], cfg.topk)
        merged = _merge_tiles(meta.score_tiles, groups, opt["score_budget_bytes"], call_bytes)
        rect_flops = per_pair * float(sum((q1 - q0) * (r1 - r0) for _, q0, q1, r0, r1 in merged))

        def forward() -> torch.Tensor:
            k, z = indexer.project_keys(hidden, pos)
            return indexer(hidden, pos, k, z, pos, pad, metadata=meta).region_ids

        def forward_marked(mark) -> None:
            k, z = indexer.project_keys(hidden, pos)
            mark("project_keys")
            indexer._forward(hidden, pos, k, z, pos, pad, 0, meta, mark)

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
        stages = stage_breakdown(forward_marked)
        label = " ".join(f"{k}={v}" for k, v in opt.items() if k != "method")
        label = f"{opt['method']} {label}".replace("score_budget_bytes", "budget")
        row = {
            "name": "indexer forward",
            "options": label,
            "shape": shape,
            "ms": round(ms, 3),
            "tflops": round(flops / ms / 1e9, 1),
            "ideal_ms_at_300": round(ideal_ms, 3),
            "ratio_vs_ideal": round(ms / ideal_ms, 3),
            "peak_extra_gib": round(extra / 2**30, 3),
            "host_syncs": syncs,
            "merged_tiles": len(merged),
            "scored_rectangle_vs_causal": round(rect_flops / flops, 4),
            "stage_ms": {k: round(v, 3) for k, v in stages.items()},
            "score_stage_tflops": round(rect_flops / max(stages["score"], 1e-9) / 1e9, 1),
        }
        # context, not the target: the forward without its projection stages (dense GEMMs, as
        # many FLOPs as the scoring at 64k), their times taken from the marked run
        projections = stages["project_keys"] + stages["project_queries"]
        row["ratio_without_projections"] = round((ms - projections) / ideal_ms, 3)
        rows.append(row)
        print(
            f"{'indexer forward':<16} {label:<60} {shape:<28} {ms:>9.3f} ms {row['tflops']:>6.1f} TFLOP/s"
            f"  {row['ratio_vs_ideal']:>5.2f}x ideal ({ideal_ms:.2f} ms)"
            f"  peak extra {row['peak_extra_gib']:.2f} GiB  host syncs {syncs}",
            flush=True,
        )
        print(
            "    stages ms: "
            + "  ".join(f"{k} {v:.2f}" for k, v in stages.items())
            + f"  (sum {sum(stages.values()):.2f})  | {len(merged)} merged tiles, scored rectangles"
            f" {rect_flops / flops:.3f}x causal FLOPs, score stage {row['score_stage_tflops']} TFLOP/s"
            f" | without the projection stages {row['ratio_without_projections']:.2f}x ideal",
            flush=True,
        )
    if profile and DEVICE == "cuda":
        indexer.selection_options = dict(options[0])
        print_profile(forward)


def sweep_score_kernel(rows: list[dict]) -> None:
    """`indexer_score_tile`'s kernel under its sweep configs on two tile shapes of the 128k walk (its
    first merged tile and its last, widest one), next to its fixed default config."""
    from triton.testing import do_bench as triton_bench

    from sa_kernels.indexer_score import triton_kernels as tk

    g, h, d = 4, 4, 256
    for n_q, regions in [(8440, 1567), (768, 16383)]:
        query = torch.randn(1, n_q, g, h, d, device=DEVICE).to(torch.float8_e4m3fn).bfloat16()
        weights = torch.randn(1, n_q, g, h, device=DEVICE)
        summary = torch.randn(1, regions, d, device=DEVICE).to(torch.float8_e4m3fn).bfloat16()
        print(f"score kernel sweep (default config: {tk.default_config(query, summary)})")
        out = torch.empty(1, g, n_q, regions, device=DEVICE)
        flops = 2.0 * n_q * g * h * d * regions
        reference = None
        for cfg in [None, *tk.SWEEP_CONFIGS]:

            def call(cfg=cfg, query=query, weights=weights, summary=summary, out=out) -> None:
                tk.indexer_score_tile(query, weights, summary, 0, query.shape[1], out, _config=cfg)

            try:
                out.fill_(float("nan"))
                call()
                if reference is None:
                    reference = out.clone()
                close = bool(torch.allclose(out, reference, rtol=1e-5, atol=1e-5))
                ms = triton_bench(call, warmup=5, rep=30)
            except Exception as exc:  # a config that does not fit (shared memory, registers)
                print(f"  q={n_q} r={regions} {cfg} failed: {type(exc).__name__}")
                continue
            tflops = flops / ms / 1e9
            label = "default" if cfg is None else cfg
            rows.append(
                {
                    "name": "score kernel sweep",
                    "shape": f"q={n_q} regions={regions}",
                    "config": label,
                    "ms": round(ms, 4),
                    "tflops": round(tflops, 1),
                    "close_to_default": close,
                }
            )
            print(
                f"  q={n_q:<5} regions={regions:<6} {label}  {ms:8.4f} ms  {tflops:6.1f} TFLOP/s"
                f"  {'close' if close else 'FAR'} from the default's scores",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128k only, default selection options")
    parser.add_argument("--json", help="write the rows as JSON to this path")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print the top kernels of torch.profiler for one 128k forward (default options)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time the scoring kernel under explicit configs on tiles of the 128k walk",
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="sequence lengths (default 65536 131072)"
    )
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
            [
                {"method": "threshold", "region_chunk": 256, "score_budget_bytes": 1 << 22},
                {"method": "composite", "region_chunk": 256, "score_budget_bytes": 1 << 22},
            ],
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
            {**default, "score_budget_bytes": 2 << 30},
            {**default, "project_rows": 4096},
            {**default, "method": "composite"},
        ]
    lengths = args.lengths or ([131072] if args.quick else [65536, 131072])

    def save() -> None:  # after every section, so that a timeout keeps what was measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    save()
    for total in lengths:
        longest = total == max(lengths)
        bench_indexer(rows, total, options if longest else [default], args.profile and longest)
        save()
    if args.sweep:
        sweep_score_kernel(rows)
        save()


if __name__ == "__main__":
    main()
