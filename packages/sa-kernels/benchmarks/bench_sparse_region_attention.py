"""sparse_region_attention fwd and fwd+bwd on the GPU at the Step-5 CSA geometry, against dense
causal SDPA, all in one run.

Geometry: 64 query heads / 4 KV groups / head_dim 192 (SEMANTICS §1.1), region_size 8, topk 512
historical regions plus the current one per (group, query) (§1.2), BF16. Two selection structures
(`sa_kernels.synthetic.csa_selection`, one selection per KV group):

    csa         one document over the whole sequence: rows past 512 regions select 512 random
                earlier regions plus their own (scattered), earlier rows every region up to theirs
    short-docs  documents of topk · region_size = 4096 tokens: every row dense-equivalent (all
                regions of its document up to its own: causal blocks along the diagonal)

Rows per length:

    dense-causal-sdpa   F.scaled_dot_product_attention(is_causal=True) over the whole sequence,
                        K/V expanded to the 64 heads (flash/cuDNN kernels)
    <kind>-gather       the Triton gather kernels
    <kind>-flex         compiled flex_attention over the region BlockMask (bitmap mask_mod)
    <kind>-auto         backend="auto" (the chosen backend is printed)

TFLOP/s count the visible (query head, key) pairs: 4·D flops each forward, 14·D forward+backward
(dense causal SDPA: S(S+1)/2 pairs per head). `vs_dense` = dense ms / ms (> 1: faster than
dense). Each row's extra fields give the selection's occupancy (selected pairs / area of the
128×128 tiles they touch), its mean visible keys per (group, query) and the mask build time.
`--sweep-gather` times the gather kernels' launch candidates (`SWEEP_FORWARD_CONFIGS`,
`SWEEP_BACKWARD_CONFIGS`) on the csa selection, forward and backward apart, each checked against
the default launch first. `--breakdown` profiles the gather kernels' default launches on the csa
selection of the first length (rows `breakdown`): each kernel's ms and the bytes of gathered rows
it reads (K and V rows of the visible keys for the forward and the dQ kernel; Q and dO rows of
every (group, query, selected region) selection for the key-major dK/dV), as TB/s: at these
geometries the kernels are bound by how fast the L2 cache serves those rows.

    python packages/sa-kernels/benchmarks/bench_sparse_region_attention.py [--quick]
        [--lengths N ...] [--kinds csa|short-docs ...] [--backends gather|flex|auto ...]
        [--sweep-gather [fwd|bwd|both]] [--breakdown] [--json PATH]
"""

import argparse
import functools
import time

import sparse_attention_bench as common
import torch

from sa_kernels.sparse_region_attention import (
    auto_backend,
    build_region_block_mask,
    sparse_region_attention,
)
from sa_kernels.sparse_region_attention.reference import region_key_rows
from sa_kernels.sparse_region_attention.triton_kernels import (
    SWEEP_BACKWARD_CONFIGS,
    SWEEP_FORWARD_CONFIGS,
    default_config,
    region_attention_backward,
    region_attention_forward,
)
from sa_kernels.synthetic import csa_selection, region_layout
from sa_kernels.testing import kernel_device_ms

KINDS = ("csa", "short-docs")
HEADS, GROUPS, HEAD_DIM, REGION_SIZE, TOPK = 64, 4, 192, 8, 512
BACKENDS = ("gather", "flex", "auto")


def _selection(kind, length, gen):
    """(region_ids [1, G, S, topk + 1], region_sources [1, N, R]) on CUDA."""
    if kind == "csa":
        documents = [[length]]
    else:
        doc = TOPK * REGION_SIZE
        documents = [[doc] * (length // doc) + ([length % doc] if length % doc else [])]
    sources, owners, firsts = region_layout(documents, length, REGION_SIZE, device="cuda")
    ids = csa_selection(owners, firsts, sources.shape[1], groups=GROUPS, topk=TOPK, generator=gen)
    return ids, sources


def _visible_pairs(ids, sources, length):
    """Visible (group, query, key) pairs, counted in chunks of queries."""
    total = 0
    for start in range(0, ids.shape[2], 1024):
        stop = min(start + 1024, ids.shape[2])
        rows = torch.arange(start, stop, device=ids.device)
        total += int(region_key_rows(ids[:, :, start:stop], sources, length, rows)[1].sum())
    return total


def _attend(q, k, v, *, ids, sources, backend, block_mask):
    return sparse_region_attention(q, k, v, ids, sources, backend=backend, block_mask=block_mask)


def run_length(table, length, gen, kinds, backends, sweep_gather, breakdown=False):
    shape = f"S{length}-H{HEADS}/{GROUPS}-D{HEAD_DIM}-R{REGION_SIZE}-k{TOPK}"
    make = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = make(1, length, HEADS, HEAD_DIM)
    k, v = make(1, length, GROUPS, HEAD_DIM), make(1, length, GROUPS, HEAD_DIM)
    grad = make(1, length, HEADS, HEAD_DIM)
    table.dense = None
    common.dense_causal_sdpa(table, shape, q, k, v, grad.transpose(1, 2))
    torch.cuda.empty_cache()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for kind in kinds:
        ids, sources = _selection(kind, length, gen)
        torch.cuda.synchronize()
        start = time.perf_counter()
        mask = build_region_block_mask(ids, sources, length, HEADS, build_flex=True)
        torch.cuda.synchronize()
        pairs = _visible_pairs(ids, sources, length)
        info = {
            "occupancy": round(mask.occupancy, 3),
            "mean_keys": round(pairs / (GROUPS * length), 1),
            "mask_build_ms": round((time.perf_counter() - start) * 1e3, 1),
        }
        for backend in backends:
            fn = functools.partial(
                _attend, ids=ids, sources=sources, backend=backend, block_mask=mask
            )
            result = common.attempt(f"{kind}-{backend} {shape}", common.bench, fn, (q, k, v), grad)
            if result is None:
                continue
            extra = dict(info)
            if backend == "auto":
                extra["chose"] = auto_backend(mask, q.device, dtype=q.dtype, head_dim=HEAD_DIM)
            table.add(
                f"{kind}-{backend}", shape, *result, pairs * (HEADS // GROUPS), HEAD_DIM, extra
            )
        if sweep_gather and kind == "csa":
            _sweep_gather(table, shape, mask, sources, (q, k, v), grad, pairs, sweep_gather)
        if breakdown and kind == "csa":
            _breakdown(table, shape, mask, sources, (q, k, v), grad, pairs)
        del ids, sources, mask
        torch.cuda.empty_cache()


def _sweep_gather(table, shape, mask, sources, inputs, grad, pairs, which="both"):
    """Forward and backward launch candidates of the gather kernels, apart (ms of each kernel alone)."""
    q, k, v = (t.detach() for t in inputs)
    scale = HEAD_DIM**-0.5
    routes, counts = mask.routes, mask.counts
    out, lse = region_attention_forward(q, k, v, routes, counts, sources, 0, scale)
    grads = region_attention_backward(q, k, v, out, grad, lse, routes, counts, sources, 0, scale)

    def forward(config):
        return region_attention_forward(q, k, v, routes, counts, sources, 0, scale, _config=config)

    def backward(config):
        return region_attention_backward(
            q, k, v, out, grad, lse, routes, counts, sources, 0, scale, _config=config
        )

    directions = []
    for is_backward, configs, run, want in (
        (False, SWEEP_FORWARD_CONFIGS, forward, (out, lse)),
        (True, SWEEP_BACKWARD_CONFIGS, backward, grads),
    ):
        candidates = [(default_config(HEAD_DIM, is_backward), True), *((c, False) for c in configs)]
        directions.append((is_backward, candidates, run, want))
    common.sweep_launches(table, shape, which, directions, pairs * (HEADS // GROUPS), HEAD_DIM)


# Gathered rows each kernel reads: "keys" (K and V rows per visible key) or "selections" (Q and dO
# rows of the group's heads per (group, query, selected region) selection).
_KERNEL_READS = {
    "_region_fwd_kernel": ("forward", "keys"),
    "_region_bwd_kernel": ("backward, dQ", "keys"),
    "_region_dkdv_kernel": ("backward, key-major dK/dV", "selections"),
    "_invert_routes_kernel": ("backward, inverse routes", None),
}


def _breakdown(table, shape, mask, sources, inputs, grad, pairs):
    """Rows `breakdown`: each gather kernel's device ms (default launches) and the TB/s of the
    gathered rows it reads; other kernels (fills, casts, the cumsum) summed as "other"."""
    q, k, v = (t.detach() for t in inputs)
    scale = HEAD_DIM**-0.5
    routes, counts = mask.routes, mask.counts
    out, lse = region_attention_forward(q, k, v, routes, counts, sources, 0, scale)
    selections = int(counts.sum())
    row_bytes = HEAD_DIM * q.element_size()
    read = {
        "keys": pairs * 2 * row_bytes,
        "selections": selections * (HEADS // GROUPS) * 2 * row_bytes,
    }
    stages = {
        "forward": lambda: region_attention_forward(q, k, v, routes, counts, sources, 0, scale),
        "backward": lambda: region_attention_backward(
            q, k, v, out, grad, lse, routes, counts, sources, 0, scale
        ),
    }
    for stage, fn in stages.items():
        other = 0.0
        for kernel, ms in kernel_device_ms(fn, iters=5).items():
            known = next((name for name in _KERNEL_READS if name in kernel), None)
            if known is None:
                other += ms
                continue
            label, reads = _KERNEL_READS[known]
            row = {"name": "breakdown", "shape": shape, "kernel": label, "ms": round(ms, 3)}
            if reads:
                row["reads"] = reads
                row["read_gb"] = round(read[reads] / 1e9, 1)
                row["tb_per_s"] = round(read[reads] / ms / 1e9, 2)
            table.rows.append(row)
            print(f"breakdown {stage:<8} {label:<28} {ms:8.3f} ms {row.get('tb_per_s', '')} TB/s")
        if other > 0:
            label = f"{stage}, other"
            table.rows.append(
                {"name": "breakdown", "shape": shape, "kernel": label, "ms": round(other, 3)}
            )
            print(f"breakdown {stage:<8} {'other':<28} {other:8.3f} ms")
    table.dump()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8192 keys only")
    parser.add_argument(
        "--lengths", nargs="+", type=int, help="key counts (default 32768 65536; overrides --quick)"
    )
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    common.add_sweep_gather_argument(parser)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="profile the gather kernels on the csa selection of the first length",
    )
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    common.require_cuda("bench_sparse_region_attention")
    lengths = args.lengths or ([8192] if args.quick else [32768, 65536])
    table = common.Table(args.json, shape_width=24)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i, length in enumerate(lengths):
        breakdown = args.breakdown and i == 0
        run_length(table, length, gen, args.kinds, args.backends, args.sweep_gather, breakdown)
    return table.rows


if __name__ == "__main__":
    main()
