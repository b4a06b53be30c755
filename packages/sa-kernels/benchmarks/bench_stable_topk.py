"""stable_topk on the GPU: the Triton radix-select kernel vs the PyTorch two-top-k path, same run.

Rows are FP32 score rows of the routing shapes: QSA chunks (32768 blocks per row at 128k tokens, 8192
at 32k, keep 512) and Step-5 tiles (16384 regions at 128k, keep 512), plus shorter rows. Baselines in the same run: the
PyTorch path of `stable_topk` (`backend="reference"`), a plain `torch.topk` (values only, not
deterministic on ties), a row copy (bandwidth floor: the kernel reads each score once) and, where
the public call runs a Gluon kernel (SM90, `gluon_kernel_applies`), the Triton kernel itself. The
"triton" column is the public call with backend="triton" (Gluon where it applies); with `--sweep`,
rows the Gluon kernels take are also timed at their launch options (warps per row, programs per SM).
`--sweep` also times, per shape, warp counts × prefilter widths × prefilter chunks (`LaunchConfig`) and
software-pipelined prefilter loads around the default, checks each against the PyTorch path, and
prints the best.

    python packages/sa-kernels/benchmarks/bench_stable_topk.py [--sweep] [--json PATH]
"""

import argparse
import json

import torch
from triton.testing import do_bench

from sa_kernels import stable_topk
from sa_kernels.stable_topk import gluon_kernel_applies
from sa_kernels.stable_topk.triton_kernels import (
    LaunchConfig,
    _prefilter_maxima,
    default_config,
    stable_topk_rows,
)

SHAPES = [
    (2048, 32768, 512),
    (2048, 16384, 512),
    (4096, 8192, 512),
    (4096, 6000, 512),
    (4096, 4096, 512),
    (8192, 2048, 64),
]


def _label(config: LaunchConfig, block: int, k: int) -> str:
    """The launch as it runs: the prefilter's maxima where it applies, else 0."""
    maxima = _prefilter_maxima(config, block, k)
    chunk = f"-chunk{max(maxima, config.prefilter_chunk)}" if maxima else ""
    stages = f"-stages{config.prefilter_stages}" if maxima and config.prefilter_stages > 1 else ""
    rows = f"-rows{config.rows_per_program}" if maxima and config.rows_per_program > 1 else ""
    return (
        f"tile{config.output_tile}-warps{config.num_warps}-prefilter{maxima}{chunk}{stages}{rows}"
    )


def bench_shape(rows: int, n: int, k: int, sweep: bool) -> dict:
    scores = torch.randn(rows, n, device="cuda")
    got = stable_topk(scores, k, backend="triton")
    assert torch.equal(got, stable_topk(scores, k, backend="reference")), (rows, n, k)
    triton_ms = do_bench(lambda: stable_topk(scores, k, backend="triton"), rep=100)
    torch_ms = do_bench(lambda: stable_topk(scores, k, backend="reference"), rep=100)
    topk_ms = do_bench(lambda: torch.topk(scores, k, dim=-1, sorted=False), rep=100)
    copy_ms = do_bench(scores.clone, rep=100)
    # the Triton kernel itself, where `stable_topk` runs a Gluon one (SM90)
    triton_kernel = stable_topk_rows(scores, k)
    assert torch.equal(triton_kernel, got), (rows, n, k)
    triton_kernel_ms = do_bench(lambda: stable_topk_rows(scores, k), rep=100)
    row = {
        "rows": rows,
        "n": n,
        "k": k,
        "triton_ms": triton_ms,
        "torch_path_ms": torch_ms,
        "torch_topk_ms": topk_ms,
        "copy_ms": copy_ms,
        "gluon_runs": gluon_kernel_applies(scores, k),
        "triton_kernel_ms": triton_kernel_ms,
        "speedup_vs_torch_path": torch_ms / triton_ms,
        "gbps": rows * n * 4 / triton_ms / 1e6,
    }
    if sweep:
        block = max(16, 1 << (n - 1).bit_length())
        expected = stable_topk(scores, k, backend="reference")
        timings = {}
        tile = 2048 if block > 2048 else 0
        configs = [
            LaunchConfig(warps, tile, prefilter, chunk, prefilter_stages=1)
            for warps in (4, 8, 16)
            for prefilter, chunk in (
                (0, 2048),
                (1024, 2048),
                (1024, 4096),
                (2048, 2048),
                (2048, 4096),
                (1024, 8192),  # one chunk at 8192 entries: the whole row in registers
            )
        ]
        # the prefilter's chunk loads software-pipelined (the default: 4 warps, 1024, 3 stages)
        configs += [
            LaunchConfig(warps, tile, 1024, chunk, prefilter_stages=stages)
            for warps in (4, 8)
            for chunk in (1024, 2048)
            for stages in (2, 3)
        ]
        # several rows per program, each phase vectorised over them
        configs += [
            LaunchConfig(warps, tile, 1024, rows_per_program=rows)
            for warps in (4, 8)
            for rows in (2, 4)
        ]
        for config in configs:
            if _label(config, block, k) in timings:  # the prefilter does not apply here
                continue
            assert torch.equal(stable_topk_rows(scores, k, _config=config), expected), config
            timings[_label(config, block, k)] = do_bench(
                lambda c=config: stable_topk_rows(scores, k, _config=c), rep=50
            )
        if gluon_kernel_applies(scores, k):
            from sa_kernels.stable_topk import gluon_kernels

            for name, options in (
                ("gluon-prefilter-warps8", {"prefilter_warps": 8}),
                ("gluon-programs-per-sm4", {"programs_per_sm": 4}),
                ("gluon-programs-per-sm8", {"programs_per_sm": 8}),
                ("gluon-whole-row-warps8", {"whole_row_warps": 8}),
            ):
                got = gluon_kernels.stable_topk_rows(scores, k, **options)
                assert torch.equal(got, expected), name
                timings[name] = do_bench(
                    lambda o=options: gluon_kernels.stable_topk_rows(scores, k, **o), rep=50
                )
        row.update(
            sweep_ms=timings,
            default=_label(default_config(block, k), block, k),
            best=min(timings, key=timings.get),
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time every warp count per shape")
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    rows_out = []
    for rows, n, k in SHAPES:
        row = bench_shape(rows, n, k, args.sweep)
        rows_out.append(row)
        print(
            f"[{rows}, {n}] k {k}: triton {row['triton_ms']:.3f} ms ({row['gbps']:.0f} GB/s), "
            f"torch path {row['torch_path_ms']:.3f} ({row['speedup_vs_torch_path']:.2f}x), "
            f"torch.topk {row['torch_topk_ms']:.3f}, copy {row['copy_ms']:.3f}, "
            f"Triton kernel {row['triton_kernel_ms']:.3f}"
            + (" (the public call ran Gluon)" if row["gluon_runs"] else "")
            + (
                f"\n  sweep {row['sweep_ms']}\n  best {row['best']} (default {row['default']})"
                if args.sweep
                else ""
            ),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
