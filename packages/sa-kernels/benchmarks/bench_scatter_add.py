"""The FP32 scatter-add rate that bounds the gather backward of `sparse_gqa_attention`.

The gather backward adds, for every selected (query, KV group, key), a dK row and a dV row of FP32
atomics into the key's accumulators. This benchmark issues exactly that traffic and nothing else:
programs (query, group) walk random routes (ascending ids, like canonical routes) and add a register
tile to the selected rows of a [groups, keys, 2·head_dim] FP32 buffer, with the gather kernel's
layout and step width. Rows in the same run, same routes:

    atomic-add      tl.atomic_add (relaxed; red.global.add.v4.f32 on sm_90): the backward's adds
    store           plain scattered stores of the same rows (racy, timing only): the write ceiling
    gather-load     loads of the same rows (bf16, like K/V reads): the forward's gather ceiling

Figures: adds/s (FP32 elements) and the implied floor of the backward's atomics at the sparse-GQA
benchmark's D 128 geometry (32k queries, 4 KV groups, 4096 keys per query: 129 G adds).

    python packages/sa-kernels/benchmarks/bench_scatter_add.py [--quick] [--json PATH]
"""

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

MODES = ("atomic-add", "store", "gather-load")


@triton.jit
def _scatter_rows_kernel(
    routes_ptr,
    dst_ptr,
    src_ptr,
    out_ptr,
    queries,
    keys,
    width,
    MODE: tl.constexpr,  # 0 atomic add, 1 store, 2 load
    ROW: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    q = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)
    offs_r = tl.arange(0, ROW)
    route = routes_ptr + (group * queries + q) * width
    tile = (q + offs_w[:, None] * ROW + offs_r[None, :]).to(tl.float32)  # not constant-folded
    total = tl.zeros([BLOCK_W, ROW], tl.float32)
    for start in range(0, width, BLOCK_W):
        in_row = start + offs_w < width
        ids = tl.load(route + start + offs_w, mask=in_row, other=0).to(tl.int64)
        rows = (group * keys + ids)[:, None] * ROW + offs_r[None, :]
        mask = in_row[:, None]
        if MODE == 0:
            tl.atomic_add(dst_ptr + rows, tile, mask=mask, sem="relaxed")
        elif MODE == 1:
            tl.store(dst_ptr + rows, tile, mask=mask)
        else:
            total += tl.load(src_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    if MODE == 2:  # keep the loads alive
        tl.store(out_ptr + q * ROW + offs_r, tl.sum(total, axis=0))


def random_routes(groups: int, queries: int, keys: int, width: int, device) -> torch.Tensor:
    """int32 [groups, queries, width]: each row `width` distinct random ids in [0, keys), ascending."""
    out = torch.empty(groups, queries, width, dtype=torch.int32, device=device)
    for g in range(groups):
        for q0 in range(0, queries, 4096):
            q1 = min(queries, q0 + 4096)
            scores = torch.rand(q1 - q0, keys, device=device)
            out[g, q0:q1] = scores.topk(width, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    return out


def scatter_rows(routes: torch.Tensor, keys: int, row: int, mode: str, dst=None, src=None):
    """Run one mode over `routes` [groups, queries, width]; returns the FP32 buffer (or loads' sums)."""
    groups, queries, width = routes.shape
    device = routes.device
    if dst is None:
        dst = torch.zeros(groups * keys * row, dtype=torch.float32, device=device)
    if src is None:
        src = torch.ones(groups * keys * row, dtype=torch.bfloat16, device=device)
    out = torch.zeros(queries * row, dtype=torch.float32, device=device)
    _scatter_rows_kernel[(queries, groups)](
        routes,
        dst,
        src,
        out,
        queries,
        keys,
        width,
        MODE=MODES.index(mode),
        ROW=row,
        BLOCK_W=32,
        num_warps=4,
    )
    return dst if mode != "gather-load" else out


def bench_length(length: int, groups: int = 4, width: int = 4096, head_dim: int = 128) -> list:
    """Every mode over the same random routes of `length` queries and keys."""
    row = 2 * head_dim  # a dK row and a dV row per selected key
    routes = random_routes(groups, length, length, width, "cuda")
    dst = torch.zeros(groups * length * row, dtype=torch.float32, device="cuda")
    src = torch.ones(groups * length * row, dtype=torch.bfloat16, device="cuda")
    elements = groups * length * width * row
    results = []
    for mode in MODES:
        ms = do_bench(lambda m=mode: scatter_rows(routes, length, row, m, dst, src), rep=200)
        rate = elements / ms / 1e9  # T elements / s
        result = {
            "mode": mode,
            "queries": length,
            "keys": length,
            "groups": groups,
            "width": width,
            "row": row,
            "ms": round(ms, 3),
            "t_elements_per_s": round(rate, 3),
        }
        if mode == "atomic-add":
            # the D 128 sparse-GQA geometry at 32k: 3843 distinct keys per query on average
            result["floor_ms_at_bench_32k"] = round(32768 * 4 * 3843 * row / rate / 1e9, 1)
        results.append(result)
        print(json.dumps(result), flush=True)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8192 queries and keys")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_scatter_add: needs a CUDA device")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    results = []
    for length in [8192] if args.quick else [32768, 131072]:
        results += bench_length(length)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
