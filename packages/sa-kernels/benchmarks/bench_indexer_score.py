"""indexer_score_tile on the GPU: TFLOP/s of the fused scoring kernel vs cuBLAS and the reference, same run.

FLOPs count `2·Q·G·H·R·D` (the q·s products). Baselines: the same-size BF16 GEMM through torch.matmul
(`[G, Q·H, D] @ [D, R]`, no relu/weighting epilogue: a ceiling) and the PyTorch reference (einsum + relu + sum).

    python packages/sa-kernels/benchmarks/bench_indexer_score.py [--quick] [--sweep] [--json PATH]

`--sweep` times every launch config of `indexer_score/triton_kernels.py` on the R = 16384 and R = 4096 target
shapes, checks each against the reference, and prints the best (it then becomes DEFAULT_CONFIG).
"""

import argparse
import json

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from sa_kernels import indexer_score_tile, round_to_e4m3
from sa_kernels.indexer_score import reference, triton_kernels


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


def _bench_shape(batch: int, queries: int, groups: int, heads: int, dim: int, regions: int) -> dict:
    query, weights, summary = _inputs(batch, queries, groups, heads, dim, regions)
    out = torch.empty(batch, groups, queries, regions, device="cuda")
    flops = 2 * batch * queries * groups * heads * regions * dim
    ms = do_bench(
        lambda: indexer_score_tile(query, weights, summary, 0, queries, out=out), warmup=25, rep=100
    )
    a = query.permute(0, 2, 1, 3, 4).reshape(batch * groups, queries * heads, dim)
    b = summary.transpose(1, 2).repeat_interleave(groups, 0)
    gemm_ms = do_bench(lambda: torch.matmul(a, b), warmup=25, rep=100)
    ref_ms = do_bench(
        lambda: reference.indexer_score_tile(query, weights, summary, 0, queries), warmup=5, rep=20
    )
    row = {
        "name": "indexer_score_tile",
        "shape": f"B{batch} Q{queries} G{groups} H{heads} D{dim} R{regions}",
        "ms": round(ms, 4),
        "tflops": round(flops / ms / 1e9, 1),
        "gemm_ms": round(gemm_ms, 4),
        "gemm_tflops": round(flops / gemm_ms / 1e9, 1),
        "vs_gemm": round(gemm_ms / ms, 3),
        "reference_ms": round(ref_ms, 4),
        "vs_reference": round(ref_ms / ms, 2),
        "config": triton_kernels.DEFAULT_CONFIG,
    }
    print(
        f"{row['name']:<20} {row['shape']:<34} {ms:>8.4f} ms {row['tflops']:>6.1f} TFLOP/s"
        f" | cuBLAS GEMM {row['gemm_tflops']:>6.1f} TFLOP/s ({row['vs_gemm']:.2f}x)"
        f" | reference {ref_ms:.3f} ms ({row['vs_reference']:.1f}x) | {row['config']}",
        flush=True,
    )
    return row


def _sweep(batch: int, queries: int, groups: int, heads: int, dim: int, regions: int) -> list:
    query, weights, summary = _inputs(batch, queries, groups, heads, dim, regions)
    expected = reference.indexer_score_tile(query, weights, summary, 0, queries)
    flops = 2 * batch * queries * groups * heads * regions * dim
    shape = f"B{batch} Q{queries} G{groups} H{heads} D{dim} R{regions}"
    rows = []
    for cfg in triton_kernels.SWEEP_CONFIGS:
        out = torch.full_like(expected, float("nan"))
        run = lambda cfg=cfg, out=out: triton_kernels.indexer_score_tile(
            query, weights, summary, 0, queries, out, _config=cfg
        )
        try:
            run()
        except OutOfResources as err:
            print(f"  sweep {shape} {cfg}: out of resources ({err})", flush=True)
            continue
        torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-5)
        ms = do_bench(run, warmup=10, rep=50)
        tflops = flops / ms / 1e9
        rows.append(
            {
                "name": "indexer_score_tile sweep",
                "shape": shape,
                "config": cfg,
                "ms": round(ms, 4),
                "tflops": round(tflops, 1),
            }
        )
        print(f"  sweep {shape} {cfg}: {ms:.4f} ms {tflops:.1f} TFLOP/s", flush=True)
    best = min(rows, key=lambda r: r["ms"])
    print(f"best config {shape}: {best['config']} {best['tflops']:.1f} TFLOP/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the Q=128, R=16384 target shape")
    parser.add_argument(
        "--sweep", action="store_true", help="also time every launch config on the target shapes"
    )
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    # (batch, queries in the tile, groups, heads per group, dim, regions)
    shapes = [(1, 128, 4, 4, 256, 16384)]
    if not args.quick:
        shapes += [
            (1, 128, 4, 4, 256, 4096),
            (1, 128, 4, 4, 256, 65536),
            (2, 128, 1, 16, 128, 16384),
        ]
    rows = []
    for shape in shapes:
        rows.append(_bench_shape(*shape))
    if args.sweep:
        rows += _sweep(1, 128, 4, 4, 256, 16384)
        rows += _sweep(1, 128, 4, 4, 256, 4096)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
