"""indexer_score_tile on the GPU: TFLOP/s of the fused scoring kernel vs cuBLAS and the reference, same run.

FLOPs count `2·Q·G·H·R·D` (the q·s products). Each public call is timed eagerly (do_bench), as GPU time
alone (replayed from a CUDA graph) and as host time per call: at the issue's small tile the kernel
runs about as long as its host launch. Baselines: the same-size BF16 GEMM through torch.matmul
(`[G, Q·H, D] @ [D, R]`, no relu/weighting epilogue: a ceiling) and the PyTorch reference (einsum + relu + sum).

    python packages/sa-kernels/benchmarks/bench_indexer_score.py [--quick] [--sweep] [--json PATH]

Shapes: the issue's target tile (Q 128, G 4, H 4, D 256, R 16384) and a Step-5-like call (Q 2048 against the
same 16384 regions); without `--quick` also R 4096, R 65536 and G 1 × H 16 at D 128.
`--sweep` times SWEEP_CONFIGS of `indexer_score/triton_kernels.py` (the Gluon kernel, the resident kernel and
its closest rivals of an H200 sweep, the plain tiles kernel among them) on the two first shapes,
checks each against the reference and for bit identity with the public call's default (`default_config`:
GLUON_CONFIG on SM90, DEFAULT_CONFIG elsewhere), and prints the best per shape and the best over both
(geometric mean of the speed-up over that default): if another config wins, it should become the default.
"""

import argparse
import json
import math
import signal
import sys
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

from sa_kernels import indexer_score_tile, round_to_e4m3
from sa_kernels.indexer_score import reference, triton_kernels

TARGET = (1, 128, 4, 4, 256, 16384)
STEP5 = (1, 2048, 4, 4, 256, 16384)


def _shape_name(batch: int, queries: int, groups: int, heads: int, dim: int, regions: int) -> str:
    return f"B{batch} Q{queries} G{groups} H{heads} D{dim} R{regions}"


def _flops(batch: int, queries: int, groups: int, heads: int, dim: int, regions: int) -> int:
    return 2 * batch * queries * groups * heads * regions * dim


def _config_name(cfg: dict) -> str:
    if cfg.get("KERNEL") == "gluon":
        stages = "default stages" if cfg["STAGES"] is None else f"s{cfg['STAGES']}"
        return f"gluon (SM90, warp-specialised) {stages}"
    if cfg.get("KERNEL") == "resident":
        return (
            f"resident {cfg['BLOCK_M']}x{cfg['BLOCK_R']} w{cfg['num_warps']} s{cfg['num_stages']}"
            f" x{cfg.get('PER_SM', 1)}/SM"
        )
    return f"tiles {cfg['BLOCK_M']}x{cfg['BLOCK_R']}x{cfg['BLOCK_D']} w{cfg['num_warps']} s{cfg['num_stages']}"


def _inputs(batch: int, queries: int, groups: int, heads: int, dim: int, regions: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    query = round_to_e4m3(
        torch.randn(batch, queries, groups, heads, dim, device="cuda", generator=gen).bfloat16()
    )
    weights = torch.randn(batch, queries, groups, heads, device="cuda", generator=gen)
    summary = round_to_e4m3(
        torch.randn(batch, regions, dim, device="cuda", generator=gen).bfloat16()
    )
    return query, weights, summary


def _host_us(call, calls: int = 200) -> float:
    """Host time per call, enqueueing back to back (the GPU may still be working at the end)."""
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _bench_shape(batch: int, queries: int, groups: int, heads: int, dim: int, regions: int) -> dict:
    query, weights, summary = _inputs(batch, queries, groups, heads, dim, regions)
    out = torch.empty(batch, groups, queries, regions, device="cuda")
    flops = _flops(batch, queries, groups, heads, dim, regions)
    call = lambda: indexer_score_tile(query, weights, summary, 0, queries, out=out)
    ms = do_bench(call, warmup=25, rep=100)
    # GPU time alone: a short call's eager time can be its host launch cost (tens of µs).
    graph_ms = do_bench_cudagraph(call, rep=100)
    host_us = _host_us(call)
    a = query.permute(0, 2, 1, 3, 4).reshape(batch * groups, queries * heads, dim)
    b = summary.transpose(1, 2).repeat_interleave(groups, 0)
    gemm_ms = do_bench(lambda: torch.matmul(a, b), warmup=25, rep=100)
    ref_ms = do_bench(
        lambda: reference.indexer_score_tile(query, weights, summary, 0, queries), warmup=2, rep=20
    )
    row = {
        "name": "indexer_score_tile",
        "shape": _shape_name(batch, queries, groups, heads, dim, regions),
        "ms": round(ms, 4),
        "tflops": round(flops / ms / 1e9, 1),
        "graph_ms": round(graph_ms, 4),
        "graph_tflops": round(flops / graph_ms / 1e9, 1),
        "host_us_per_call": round(host_us, 1),
        "gemm_ms": round(gemm_ms, 4),
        "gemm_tflops": round(flops / gemm_ms / 1e9, 1),
        "vs_gemm": round(gemm_ms / ms, 3),
        "reference_ms": round(ref_ms, 4),
        "vs_reference": round(ref_ms / ms, 2),
        "config": triton_kernels.default_config(query, summary),
    }
    print(
        f"{row['name']:<20} {row['shape']:<34} {ms:>8.4f} ms {row['tflops']:>6.1f} TFLOP/s"
        f" | CUDA graph {graph_ms:.4f} ms {row['graph_tflops']:>6.1f} TFLOP/s | host {host_us:.0f} us/call"
        f" | cuBLAS GEMM {row['gemm_tflops']:>6.1f} TFLOP/s ({row['vs_gemm']:.2f}x)"
        f" | reference {ref_ms:.3f} ms ({row['vs_reference']:.1f}x) | {_config_name(row['config'])}",
        flush=True,
    )
    return row


def _sweep(
    batch: int, queries: int, groups: int, heads: int, dim: int, regions: int, all_rows: list
) -> list:
    """Time every SWEEP_CONFIGS entry at one shape; returns its rows, also appended to `all_rows` as measured."""
    query, weights, summary = _inputs(batch, queries, groups, heads, dim, regions)
    expected = reference.indexer_score_tile(query, weights, summary, 0, queries)
    default_cfg = triton_kernels.default_config(query, summary)
    default = torch.empty_like(expected)
    triton_kernels.indexer_score_tile(query, weights, summary, 0, queries, default)
    flops = _flops(batch, queries, groups, heads, dim, regions)
    shape = _shape_name(batch, queries, groups, heads, dim, regions)
    rows = []
    for cfg in triton_kernels.SWEEP_CONFIGS:
        name = _config_name(cfg)
        out = torch.full_like(expected, float("nan"))
        run = lambda cfg=cfg, out=out: triton_kernels.indexer_score_tile(
            query, weights, summary, 0, queries, out, _config=cfg
        )
        try:
            run()
            torch.cuda.synchronize()
        except Exception as err:  # out of shared memory, or a feature this Triton cannot compile
            print(f"  sweep {shape} {name}: failed ({type(err).__name__}: {str(err)[:200]})")
            continue
        max_err = (out - expected).abs().max().item()
        ok = bool(torch.isclose(out, expected, atol=1e-3, rtol=1e-5).all())
        same_bits = torch.equal(out, default)
        ms = do_bench(run, warmup=10, rep=50)
        tflops = flops / ms / 1e9
        rows.append(
            {
                "name": "indexer_score_tile sweep",
                "shape": shape,
                "config": cfg,
                "ms": round(ms, 4),
                "tflops": round(tflops, 1),
                "matches_reference": ok,
                "max_abs_err": max_err,
                "same_bits_as_default": same_bits,
                "is_default": cfg == default_cfg,
            }
        )
        all_rows.append(rows[-1])
        print(
            f"  sweep {shape} {name:<40} {ms:>8.4f} ms {tflops:>6.1f} TFLOP/s"
            f" | vs reference {'ok' if ok else 'WRONG'} (max err {max_err:.2e})"
            f" | bits {'= default' if same_bits else '!= default'}",
            flush=True,
        )
    good = [r for r in rows if r["matches_reference"]]
    if good:
        best = min(good, key=lambda r: r["ms"])
        print(f"best config {shape}: {_config_name(best['config'])} {best['tflops']:.1f} TFLOP/s")
    return rows


def _best_overall(rows: list) -> None:
    """The config with the best geometric-mean speed-up over the default across the swept shapes."""
    by_shape: dict = {}
    base_by_shape: dict = {}
    for row in rows:
        by_shape.setdefault(row["shape"], {})[json.dumps(row["config"], sort_keys=True)] = row
        if row["is_default"]:
            base_by_shape[row["shape"]] = row
    scores = {}
    for key in {k for shape_rows in by_shape.values() for k in shape_rows}:
        ratios = []
        for shape, shape_rows in by_shape.items():
            row, base = shape_rows.get(key), base_by_shape.get(shape)
            if row is None or base is None or not row["matches_reference"]:
                break
            ratios.append(base["ms"] / row["ms"])
        else:
            scores[key] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    if scores:
        key = max(scores, key=scores.get)
        cfg = json.loads(key)
        print(f"best config over {len(by_shape)} shapes: {cfg} ({scores[key]:.3f}x the default)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="only the target and Step-5-like shapes"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time every launch config on those two shapes"
    )
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    # (batch, queries in the tile, groups, heads per group, dim, regions)
    shapes = [TARGET, STEP5]
    if not args.quick:
        shapes += [
            (1, 128, 4, 4, 256, 4096),
            (1, 128, 4, 4, 256, 65536),
            (2, 128, 1, 16, 128, 16384),
        ]
    rows = []
    # A run cut short by `timeout` (SIGTERM) still writes the rows measured so far.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        for shape in shapes:
            rows.append(_bench_shape(*shape))
        if args.sweep:
            swept = _sweep(*TARGET, rows) + _sweep(*STEP5, rows)
            _best_overall(swept)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
