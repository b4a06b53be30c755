"""sparse_gqa_attention fwd and fwd+bwd on the GPU: every backend against dense causal SDPA and a
block-aligned FlexAttention mask with the same key count, all in one run.

Two geometries (Hq 64 / Hkv 4 / D 128 with 4096 selected keys, routes per KV group; Hq 24 / Hkv 2 /
D 256 with 2048 + tail, one route shared by the groups) and two route structures: clustered
(128-token key tiles shared by each 128-query tile, the own tile causally cut) and scattered (random
8- or 4-token blocks plus the tail, QSA-like). Rows per geometry and length:

    dense-causal-sdpa   F.scaled_dot_product_attention(is_causal=True), K/V expanded to Hq
    block-flex          compiled flex_attention over the clustered routes' 128×128 tiles with a
                        causal mask_mod (the issue's baseline: block-aligned, same key count, no
                        per-token bitmap)
    <kind>-flex         our route BlockMask through sparse_gqa_attention (clustered routes: whole
                        tiles plus exact causal cuts, so the arithmetic causal mask_mod)
    clustered-flex-bitmap  the clustered routes less one pair: the bitmap mask_mod on the same tiles
    clustered-fa4       FlashAttention-4 block sparsity over the same tiles (when flash-attn-4 runs)
    <kind>-gather       the Triton gather kernels
    <kind>-auto         backend="auto" (the chosen backend is printed)

TFLOP/s count the selected (query head, key) pairs: 4·D flops each forward, 14·D forward+backward
(dense causal SDPA: S(S+1)/2 pairs per head). `vs_dense` = dense ms / ms (> 1: faster than dense);
`vs_block` = TFLOP/s / block-flex TFLOP/s (the issue's ≥ 0.8 target for clustered routes).
`--sweep` times Flex on the clustered per-group D 128 routes under candidate `kernel_options`
(passed through `sparse_gqa._attention`'s `flex_options`, the public call's internal twin) and
prints the fastest.
`--sweep-gather` times the gather kernels' launch candidates (`SWEEP_FORWARD_CONFIGS`,
`SWEEP_BACKWARD_CONFIGS`) on the scattered routes, forward and backward apart, each checked against the
default launch first.

    python packages/sa-kernels/benchmarks/bench_sparse_gqa.py [--quick] [--long] [--sweep]
        [--flex-scattered] [--sweep-gather] [--lengths N ...] [--kinds clustered|scattered ...]
        [--backends flex|fa4|gather|auto ...] [--json PATH]
"""

import argparse
import functools
import time

import sparse_attention_bench as common
import torch

from sa_kernels.sparse_gqa import (
    _attention,
    auto_backend,
    build_route_block_mask,
    flex_kernel_options,
)
from sa_kernels.sparse_gqa.block_mask import TILE
from sa_kernels.sparse_gqa.fa4 import fa4_unavailable_reason
from sa_kernels.sparse_gqa.flex import compiled_flex
from sa_kernels.sparse_gqa.triton_kernels import (
    SWEEP_BACKWARD_CONFIGS,
    SWEEP_FORWARD_CONFIGS,
    default_config,
    gather_attention_backward,
    gather_attention_forward,
)
from sa_kernels.synthetic import clustered_routes, scattered_routes

KINDS = ("clustered", "scattered")
GEOMETRIES = [
    # name, query heads, kv heads, head dim, routes per group, scattered block, selected keys
    ("H64/4-D128", 64, 4, 128, True, 8, 4096),
    ("H24/2-D256", 24, 2, 256, False, 4, 2048),
]
SWEEP_OPTIONS = [
    None,  # flex_kernel_options' default
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64,
     "BLOCK_N2": 64, "num_stages": 2, "num_warps": 8},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64,
     "BLOCK_N2": 32, "num_stages": 3, "num_warps": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128,
     "BLOCK_N2": 64, "num_stages": 2, "num_warps": 8},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64,
     "BLOCK_N2": 64, "num_stages": 2, "num_warps": 8},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64,
     "BLOCK_N2": 32, "num_stages": 2, "num_warps": 4},
]  # fmt: skip


def _block_aligned_mask(route_mask):
    """The route mask's tiles (full off the diagonal, the diagonal partial) with a mask_mod that is
    causal inside the tiles the block lists name (one tile-table lookup: exact also where Flex
    evaluates the mask_mod outside the block lists, as eager flex_attention on CPU does)."""
    from torch.nn.attention.flex_attention import BlockMask

    flex = route_mask.flex
    tiles = flex.to_dense().bool()  # [batch, heads, query_tiles, kv_tiles]
    heads = tiles.shape[1]

    def causal_in_tiles(b, h, q_idx, kv_idx):
        head = h if heads > 1 else h * 0
        return tiles[b, head, q_idx // TILE, kv_idx // TILE] & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(
        flex.kv_num_blocks,
        flex.kv_indices,
        flex.full_kv_num_blocks,
        flex.full_kv_indices,
        BLOCK_SIZE=TILE,
        mask_mod=causal_in_tiles,
        seq_lengths=flex.seq_lengths,
    )


def _block_flex(q, k, v, *, mask, options):
    extra = {} if options is None else {"kernel_options": options}
    out = compiled_flex()(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=mask,
        enable_gqa=True,
        **extra,
    )
    return out.transpose(1, 2)


def _attend(q, k, v, *, ids, backend, block_mask, options=None):
    return _attention(q, k, v, ids, backend=backend, block_mask=block_mask, flex_options=options)


def _routes(kind, route_heads, length, block, keys, gen):
    if kind == "clustered":
        return clustered_routes(
            1,
            route_heads,
            length,
            length,
            tiles_per_query=keys // TILE,
            generator=gen,
            device="cuda",
        )
    return scattered_routes(
        1,
        route_heads,
        length,
        length,
        block=block,
        blocks_per_query=keys // block,
        generator=gen,
        device="cuda",
    )


def _bitmap_flex(table, shape, ids, inputs, grad, pairs, dim):
    """The clustered routes less one pair (the last query's own key): one partial tile stops being an
    exact causal cut, so every partial tile takes the bitmap mask_mod. Measures that path on routes
    the causal mask_mod would otherwise serve."""
    ids = ids.clone()
    ids[..., -1, :] = torch.where(ids[..., -1, :] == ids.shape[-2] - 1, -1, ids[..., -1, :])
    mask = build_route_block_mask(ids, inputs[1].shape[1], inputs[0].shape[2], build_flex=True)
    assert mask.statistics.causal_offset is None
    fn = functools.partial(_attend, ids=ids, backend="flex", block_mask=mask)
    result = common.attempt(f"clustered-flex-bitmap {shape}", common.bench, fn, inputs, grad)
    if result is not None:
        table.add("clustered-flex-bitmap", shape, *result, pairs, dim, {"mask_mod": "bitmap"})


def run_geometry(
    table, length, geometry, gen, flex_scattered, sweep, kinds=KINDS, only=None, sweep_gather=None
):
    name, hq, hkv, dim, per_group, block, keys = geometry
    shape = f"S{length}-{name}"
    make = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)
    q, k, v = make(1, length, hq, dim), make(1, length, hkv, dim), make(1, length, hkv, dim)
    grad = make(1, length, hq, dim)
    table.dense = table.block = None
    common.dense_causal_sdpa(table, shape, q, k, v, grad.transpose(1, 2).contiguous())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    route_heads = hkv if per_group else 1
    for kind in kinds:
        ids = _routes(kind, route_heads, length, block, keys, gen)
        ids = ids if per_group else ids[:, 0]
        with_flex = kind == "clustered" or flex_scattered
        torch.cuda.synchronize()
        start = time.perf_counter()
        mask = build_route_block_mask(ids, length, hq, build_flex=True if with_flex else None)
        torch.cuda.synchronize()
        info = {
            "occupancy": round(mask.occupancy, 3),
            "mean_keys": round(int(mask.counts.sum()) / (route_heads * length), 1),
            "mask_build_ms": round((time.perf_counter() - start) * 1e3, 1),
        }
        if mask.statistics is not None:
            info["mask_mod"] = "bitmap" if mask.statistics.causal_offset is None else "causal"
        pairs = int(mask.counts.sum()) * (hq // route_heads)
        if kind == "clustered" and only is None:
            _block_baseline(table, shape, (q, k, v), grad, mask, pairs, dim)
            _bitmap_flex(table, shape, ids, (q, k, v), grad, pairs, dim)
        backends = (["flex"] if with_flex else []) + ["gather", "auto"]
        if kind == "clustered" and fa4_unavailable_reason(q.device) is None:
            backends.insert(1, "fa4")
        for backend in backends if only is None else [b for b in backends if b in only]:
            fn = functools.partial(_attend, ids=ids, backend=backend, block_mask=mask)
            result = common.attempt(f"{kind}-{backend} {shape}", common.bench, fn, (q, k, v), grad)
            if result is not None:
                extra = dict(info or {})
                if backend == "auto":
                    extra["chose"] = auto_backend(mask, q.device, dtype=q.dtype, head_dim=dim)
                table.add(f"{kind}-{backend}", shape, *result, pairs, dim, extra or None)
                info = None
        if sweep and kind == "clustered" and dim <= 128:
            _sweep(table, shape, ids, mask, (q, k, v), grad, pairs, dim)
        if sweep_gather and kind == "scattered":
            _sweep_gather(table, shape, mask, (q, k, v), grad, pairs, dim, sweep_gather)
        del ids, mask
    torch.cuda.empty_cache()


def _block_baseline(table, shape, inputs, grad, route_mask, pairs, dim):
    """block-flex with torch's default kernel options; if those fail to compile, ours (reported)."""
    block_mask = _block_aligned_mask(route_mask)
    for options in (None, flex_kernel_options(dim, torch.bfloat16, "cuda")):
        fn = functools.partial(_block_flex, mask=block_mask, options=options)
        result = common.attempt(
            f"block-flex {shape} options={options}", common.bench, fn, inputs, grad
        )
        if result is not None:
            extra = {"kernel_options": "default" if options is None else "ours"}
            row = table.add("block-flex", shape, *result, pairs, dim, extra)
            table.block = (row["fwd_tflops"], row["tflops"])
            return
        if options is not None or dim > 128:
            return


def _sweep(table, shape, ids, mask, inputs, grad, pairs, dim):
    best = None
    for i, options in enumerate(SWEEP_OPTIONS):
        fn = functools.partial(_attend, ids=ids, backend="flex", block_mask=mask, options=options)
        result = common.attempt(f"sweep {i} {options}", common.bench, fn, inputs, grad)
        if result is None:
            continue
        row = table.add(f"sweep-flex-{i}", shape, *result, pairs, dim, {"options": options})
        if best is None or row["ms"] < best[1]["ms"]:
            best = (i, row)
    if best is not None:
        print(f"sweep best: config {best[0]} {SWEEP_OPTIONS[best[0]]} ({best[1]['ms']} ms)")


def _sweep_gather(table, shape, mask, inputs, grad, pairs, dim, which="both"):
    """Forward and backward launch candidates of the gather kernels, apart (ms of each kernel alone)."""
    q, k, v = (t.detach() for t in inputs)
    scale = dim**-0.5
    routes, counts = mask.routes, mask.counts
    out, lse = gather_attention_forward(q, k, v, routes, counts, scale)
    grads = gather_attention_backward(q, k, v, out, grad, lse, routes, counts, scale)

    def forward(config):
        return gather_attention_forward(q, k, v, routes, counts, scale, _config=config)

    def backward(config):
        return gather_attention_backward(
            q, k, v, out, grad, lse, routes, counts, scale, _config=config
        )

    directions = []
    for is_backward, configs, run, want in (
        (False, SWEEP_FORWARD_CONFIGS, forward, (out, lse)),
        (True, SWEEP_BACKWARD_CONFIGS, backward, grads),
    ):
        default = default_config(dim, is_backward)
        directions.append((is_backward, [(c, c == default) for c in configs], run, want))
    common.sweep_launches(table, shape, which, directions, pairs, dim)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8192 keys only")
    parser.add_argument("--long", action="store_true", help="also 131072 keys")
    parser.add_argument("--sweep", action="store_true", help="Flex kernel_options candidates")
    parser.add_argument(
        "--flex-scattered", action="store_true", help="also time Flex on scattered routes"
    )
    parser.add_argument("--geometries", nargs="+", default=[g[0] for g in GEOMETRIES])
    parser.add_argument(
        "--lengths", nargs="+", type=int, help="key counts (overrides --quick/--long)"
    )
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument(
        "--backends", nargs="+", help="only these sparse_gqa backends (skips the Flex baselines)"
    )
    common.add_sweep_gather_argument(parser)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    common.require_cuda("bench_sparse_gqa")
    # Each geometry, mask_mod and kernel_options compiles Flex once; keep them all compiled.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    lengths = args.lengths or ([8192] if args.quick else [32768] + ([131072] if args.long else []))
    table = common.Table(args.json)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for length in lengths:
        for geometry in GEOMETRIES:
            if geometry[0] in args.geometries:
                run_geometry(
                    table,
                    length,
                    geometry,
                    gen,
                    args.flex_scattered,
                    args.sweep,
                    kinds=args.kinds,
                    only=args.backends,
                    sweep_gather=args.sweep_gather,
                )


if __name__ == "__main__":
    main()
