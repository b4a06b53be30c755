"""sparse_gqa_attention fwd+bwd on the GPU: gather and Flex backends vs dense causal SDPA, same run.

Two geometries (Hq 64 / Hkv 4 / D 128 with 4096 selected keys, routes per KV group; Hq 24 / Hkv 2 /
D 256 with 2051, one route shared by the groups) and two route structures: clustered (128-token key
tiles shared by each 128-query tile) and scattered (random 8- or 4-token blocks, QSA-like). TFLOP/s
count the selected (query head, key) pairs: 4·D flops each forward, 14·D forward+backward; dense
causal SDPA counts S(S+1)/2 pairs per head. `vs_dense` = dense ms / ms (> 1: faster than dense).

    python packages/sa-kernels/benchmarks/bench_sparse_gqa.py [--quick] [--lengths 32768 131072]
        [--backends gather flex] [--flex-scattered] [--json PATH]
"""

import argparse
import functools
import json
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sa_kernels.sparse_gqa import build_route_block_mask, sparse_gqa_attention
from sa_kernels.sparse_gqa.synthetic_routes import clustered_routes, scattered_routes

GEOMETRIES = [
    # name, query heads, kv heads, head dim, routes per group, scattered block, selected keys
    ("H64/4-D128", 64, 4, 128, True, 8, 4096),
    ("H24/2-D256", 24, 2, 256, False, 4, 2048),
]


def _bench_fwd_bwd(fn, inputs, grad):
    def fwd_bwd():
        fn(*inputs).backward(grad)

    fwd = do_bench(lambda: fn(*inputs), warmup=10, rep=50)
    both = do_bench(fwd_bwd, warmup=10, rep=100, grad_to_none=list(inputs))
    return fwd, both


def _row(rows, name, shape, fwd_ms, ms, pairs, head_dim, dense_ms, extra=None):
    row = {
        "name": name,
        "shape": shape,
        "fwd_ms": round(fwd_ms, 3),
        "ms": round(ms, 3),
        "fwd_tflops": round(4 * pairs * head_dim / fwd_ms / 1e9, 1),
        "tflops": round(14 * pairs * head_dim / ms / 1e9, 1),
        "vs_dense": round(dense_ms / ms, 3) if dense_ms else 1.0,
    }
    row.update(extra or {})
    rows.append(row)
    print(
        f"{row['name']:<28} {row['shape']:<26} fwd {row['fwd_ms']:>9.3f} ms {row['fwd_tflops']:>6.1f} TF/s"
        f" | fwd+bwd {row['ms']:>9.3f} ms {row['tflops']:>6.1f} TF/s | x{row['vs_dense']:.2f} vs dense"
        + (f" | {extra}" if extra else ""),
        flush=True,
    )


def _bench_routes(rows, kind, shape, ids, inputs, grad, dense_ms, backends, flex_scattered):
    q, k, _ = inputs
    length, hq, dim = k.shape[1], q.shape[2], q.shape[3]
    route_heads = 1 if ids.dim() == 3 else ids.shape[1]
    torch.cuda.synchronize()
    start = time.perf_counter()
    mask = build_route_block_mask(ids, length, hq)
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - start) * 1e3
    routes_ms = do_bench(
        lambda: build_route_block_mask(ids, length, hq, build_flex=False), warmup=2, rep=20
    )
    selected = int(mask.counts.sum())
    pairs = selected * (hq // route_heads)
    info = {
        "occupancy": round(mask.occupancy, 3),
        "mean_keys": round(selected / (route_heads * length), 1),
        "mask_build_ms": round(build_ms, 1),
        "routes_only_ms": round(routes_ms, 2),
    }
    backends = [b for b in backends if b == "gather" or kind == "clustered" or flex_scattered]
    for backend in backends:
        fn = functools.partial(_attend, ids=ids, backend=backend, block_mask=mask)
        try:
            fwd, ms = _bench_fwd_bwd(fn, inputs, grad)
        except Exception as err:  # keep measuring the other rows; the failure is reported
            print(f"{kind}-{backend} {shape}: FAILED {type(err).__name__}: {err}", flush=True)
            continue
        _row(rows, f"{kind}-{backend}", shape, fwd, ms, pairs, dim, dense_ms, info)
        info = None


def _attend(q, k, v, *, ids, backend, block_mask):
    return sparse_gqa_attention(q, k, v, ids, backend=backend, block_mask=block_mask)


def run(lengths, backends, flex_scattered, rows):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for length in lengths:
        for name, hq, hkv, dim, per_group, block, keys in GEOMETRIES:
            shape = f"S{length}-{name}"
            make = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)
            q, k, v = make(1, length, hq, dim), make(1, length, hkv, dim), make(1, length, hkv, dim)
            grad = make(1, length, hq, dim)
            # Dense causal SDPA baseline: K/V expanded to the query heads (flash/cuDNN kernels).
            qd = q.transpose(1, 2).contiguous().requires_grad_()
            kd = k.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous().requires_grad_()
            vd = v.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous().requires_grad_()
            sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)
            fwd, dense_ms = _bench_fwd_bwd(sdpa, (qd, kd, vd), grad.transpose(1, 2).contiguous())
            _row(
                rows,
                "dense-causal-sdpa",
                shape,
                fwd,
                dense_ms,
                hq * length * (length + 1) // 2,
                dim,
                None,
            )
            del qd, kd, vd
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            route_heads = hkv if per_group else 1
            for kind in ("clustered", "scattered"):
                if kind == "clustered":
                    ids = clustered_routes(
                        1,
                        route_heads,
                        length,
                        length,
                        tiles_per_query=keys // 128,
                        generator=gen,
                        device="cuda",
                    )
                else:
                    ids = scattered_routes(
                        1,
                        route_heads,
                        length,
                        length,
                        block=block,
                        blocks_per_query=keys // block,
                        generator=gen,
                        device="cuda",
                    )
                ids = ids if per_group else ids[:, 0]
                _bench_routes(
                    rows, kind, shape, ids, (q, k, v), grad, dense_ms, backends, flex_scattered
                )
                del ids
            del q, k, v, grad
            torch.cuda.empty_cache()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8192 keys only")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768])
    parser.add_argument(
        "--flex-scattered", action="store_true", help="also time Flex on scattered routes"
    )
    parser.add_argument(
        "--backends", nargs="+", default=["gather", "flex"], choices=["gather", "flex"]
    )
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_sparse_gqa: needs a CUDA device")
    import triton

    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
        flush=True,
    )
    rows = []
    try:
        run([8192] if args.quick else args.lengths, args.backends, args.flex_scattered, rows)
    finally:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
