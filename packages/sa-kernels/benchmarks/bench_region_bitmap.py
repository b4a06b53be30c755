"""pack_region_bitmap on the GPU vs copy bandwidth and the PyTorch reference, same run.

Bytes count the ids read once and the bitmap written once. `vs_copy` = achieved GB/s over the device-to-device
copy bandwidth measured in this run.

    python packages/sa-kernels/benchmarks/bench_region_bitmap.py [--quick] [--sweep] [--json PATH]

`--sweep` times every config in `triton_kernels.SWEEP_CONFIGS` (the default and its closest rivals: scan step and
tail sizes, 16- or 8-byte aligned reads, rows per program) on the target shape, reports and skips any that fails
or writes other bits than the reference, and prints the rest fastest first (the default lives in
`region_bitmap/triton_kernels.py`).
"""

import argparse
import json

import torch
from baselines import copy_bandwidth_gbps
from triton.testing import do_bench

from sa_kernels import pack_region_bitmap
from sa_kernels.region_bitmap import reference, triton_kernels


def sorted_ids(shape, regions: int) -> torch.Tensor:
    """Sorted selections: `slots − 1` distinct random regions per row plus one repeat, some padding rows."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.rand(*shape[:-1], regions, device="cuda", generator=gen)
    ids = keys.topk(shape[-1] - 1, dim=-1).indices.to(torch.int32)
    ids = torch.cat([ids, ids[..., :1]], -1)
    ids[..., ::7, -4:] = regions  # padding with the sentinel on every 7th query
    return ids.sort(-1).values


def _bench_shape(
    batch: int, groups: int, queries: int, slots: int, regions: int, copy_gbps: float
) -> dict:
    ids = sorted_ids((batch, groups, queries, slots), regions)
    words = (regions + 31) // 32
    out = torch.empty(batch, groups, queries, words, dtype=torch.int32, device="cuda")
    ms = do_bench(lambda: pack_region_bitmap(ids, regions, out=out), warmup=25, rep=100)
    ref_ms = do_bench(lambda: reference.pack_region_bitmap(ids, regions), warmup=3, rep=10)
    nbytes = ids.numel() * 4 + out.numel() * 4
    gbps = nbytes / ms / 1e6
    row = {
        "name": "pack_region_bitmap",
        "shape": f"B{batch} G{groups} Q{queries} slots{slots} R{regions}",
        "ms": round(ms, 4),
        "gbps": round(gbps, 1),
        "vs_copy": round(gbps / copy_gbps, 3),
        "copy_gbps": round(copy_gbps, 1),
        "reference_ms": round(ref_ms, 3),
        "vs_reference": round(ref_ms / ms, 1),
    }
    print(
        f"{row['name']:<20} {row['shape']:<36} {ms:>8.4f} ms {gbps:>7.0f} GB/s  {row['vs_copy']:>5.2f}x copy"
        f"  reference {ref_ms:.3f} ms ({row['vs_reference']:.0f}x)",
        flush=True,
    )
    return row


def _sweep(
    batch: int, groups: int, queries: int, slots: int, regions: int, copy_gbps: float
) -> list:
    ids = sorted_ids((batch, groups, queries, slots), regions)
    words = (regions + 31) // 32
    expected = reference.pack_region_bitmap(ids, regions)
    nbytes = ids.numel() * 4 + expected.numel() * 4
    rows = []
    for cfg in triton_kernels.SWEEP_CONFIGS:
        out = torch.full((batch, groups, queries, words), -1, dtype=torch.int32, device="cuda")
        # A config that fails to compile or writes other bits is reported and left out, so one GPU call still
        # times the rest.
        try:
            triton_kernels.pack_region_bitmap(ids, regions, out, _config=cfg)
        except Exception as error:
            print(f"  sweep {cfg}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        if not torch.equal(out, expected):
            print(f"  sweep {cfg}: WRONG BITS (differs from the reference)", flush=True)
            continue
        ms = do_bench(
            lambda cfg=cfg, out=out: triton_kernels.pack_region_bitmap(
                ids, regions, out, _config=cfg
            ),
            warmup=10,
            rep=50,
        )
        gbps = nbytes / ms / 1e6
        rows.append(
            {
                "name": "pack_region_bitmap sweep",
                "shape": f"B{batch} G{groups} Q{queries} slots{slots} R{regions}",
                "config": cfg,
                "ms": round(ms, 4),
                "gbps": round(gbps, 1),
                "vs_copy": round(gbps / copy_gbps, 3),
            }
        )
        print(
            f"  sweep {cfg}: {ms:.4f} ms {gbps:.0f} GB/s {gbps / copy_gbps:.2f}x copy", flush=True
        )
    if not rows:
        return rows
    print("fastest first:")
    for rank, row in enumerate(sorted(rows, key=lambda r: r["ms"])):
        default = " (default)" if row["config"] == triton_kernels.DEFAULT_CONFIG else ""
        print(
            f"  {rank + 1:>2}. {row['ms']:.4f} ms {row['vs_copy']:.2f}x copy  {row['config']}{default}"
        )
    best = min(rows, key=lambda r: r["ms"])
    print(
        f"best config: {best['config']} {best['ms']:.4f} ms ({best['vs_copy']:.2f}x copy)",
        flush=True,
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="only the G=4, Q=16384, 513 slots, 16384 regions shape"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time every launch config on the target shape"
    )
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    # (batch, groups, queries, slots, regions)
    shapes = [(1, 4, 16384, 513, 16384)]
    if not args.quick:
        shapes += [(1, 4, 4096, 513, 4096), (2, 4, 8192, 129, 65536)]
    copy_gbps = copy_bandwidth_gbps(1 << 30)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s ({torch.cuda.get_device_name()})")
    rows = []
    for shape in shapes:
        rows.append(_bench_shape(*shape, copy_gbps))
    if args.sweep:
        rows += _sweep(*shapes[0], copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
