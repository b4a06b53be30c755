"""Sparse MLA speed on one GPU: the Triton path, and FlashMLA + cuDNN (public wrapper vs raw kernels).

    python packages/sa-mla/benchmarks/bench_sparse_mla.py [--quick] [--sweep] [--json PATH]

Shape (issue 6): S 4096 queries, 64k keys, H 128, D 576, top-k 2048 random valid ids (--quick: S 1024).
Forward FLOPs = 2*S*H*topk*(d_qk + d_v); backward = 2.5x that. The fused rows compare the public
`cudnn_sparse_attention` with the raw `flash_mla_sparse_fwd` / cuDNN DSA backward on the same inputs;
the Triton rows compare with the raw fused kernels when they are present.
"""

import argparse
import datetime
import json

import torch
import triton
from triton.testing import do_bench

from sa_mla import cudnn_sparse_attention, is_cudnn_sparse_attention_available, sparse_mla_triton
from sa_mla.sparse_mla.canonical import canonical_topk
from sa_mla.sparse_mla.triton_backward import sparse_mla_backward
from sa_mla.sparse_mla.triton_forward import hopper_forward_applies, sparse_mla_forward
from sa_mla.sparse_mla.triton_launch import LaunchConfig, forward_configs

LOG = []


def record(name, shape, ms, flops, baseline_ms=None):
    row = dict(name=name, shape=shape, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
    row["ratio_vs_baseline"] = round(baseline_ms / ms, 3) if baseline_ms else None
    LOG.append(row)
    ratio = f"{row['ratio_vs_baseline']:.3f}" if baseline_ms else "-"
    print(
        f"{name:<44} {shape:<34} {ms:9.3f} ms {row['tflops']:8.1f} TFLOP/s  ratio {ratio}",
        flush=True,
    )


def inputs(tokens, keys, heads, dim, topk, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(keys, 1, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    # topk distinct-ish valid ids per row (random, unsorted), as an indexer would emit them.
    ids = torch.randint(0, keys, (tokens, 1, topk), device="cuda", dtype=torch.int32, generator=gen)
    sink = torch.randn(heads, device="cuda", generator=gen)
    dout = torch.randn(tokens, heads, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, kv, ids, sink, dout


def bench_triton(q, kv, ids, sink, dout, shape, flops, baseline):
    scale = q.shape[-1] ** -0.5
    # The forward's two kernels alone: on Hopper the public path runs the Gluon one.
    kv2, ids2 = kv[:, 0].contiguous(), ids[:, 0].contiguous()
    portable = forward_configs(q.shape[1])[0]
    portable_ms = do_bench(lambda: sparse_mla_forward(q, kv2, ids2, scale, None, sink, portable))
    record("triton fwd kernel: portable", shape, portable_ms, flops)
    if hopper_forward_applies(q, kv2):
        ms = do_bench(lambda: sparse_mla_forward(q, kv2, ids2, scale, None, sink))
        record("triton fwd kernel: Gluon Hopper (vs portable)", shape, ms, flops, portable_ms)
    record(
        "triton fwd",
        shape,
        do_bench(lambda: sparse_mla_triton(q, kv, ids, scale, attn_sink=sink)),
        flops,
        baseline.get("fwd"),
    )
    qg, kvg, sg = (t.detach().requires_grad_() for t in (q, kv, sink))
    out = sparse_mla_triton(qg, kvg, ids, scale, attn_sink=sg)
    ms = do_bench(lambda: torch.autograd.grad(out, [qg, kvg, sg], dout, retain_graph=True))
    record("triton bwd (autograd: kernels+dsink)", shape, ms, 2.5 * flops, baseline.get("bwd"))


def sweep_triton(q, kv, ids, sink, dout, shape, flops):
    """Time each Triton kernel alone under a few launch configs (the defaults come first)."""
    scale = q.shape[-1] ** -0.5
    kv2 = kv[:, 0].contiguous()
    ids2 = ids[:, 0].contiguous()
    out, lse = sparse_mla_forward(q, kv2, ids2, scale, None, sink)
    lse_total = torch.logaddexp(lse, sink[None])
    # Spill-free 32-head forward blocks (179/202 registers per ptxas) measured slower on the H200
    # (137/188 against the 64-head default's 234 TFLOP/s, both with chained score dots), so
    # the sweep keeps the 64-head neighbours of the defaults.
    # (64 × 64 slots with 3 stages no longer fits shared memory: 296 KiB with the ids loaded ahead.)
    fwd = [
        (64, 64, 8, 2),
        (64, 32, 8, 2),
        (64, 32, 8, 3),
        (64, 32, 8, 4),
    ]
    # The backward's two kernels are swept one at a time, the other at its default. (dq at 64 × 64
    # with 2 stages needs 288 KiB of shared memory.)
    dq = [(64, 64, 8, 1), (64, 32, 8, 2)]
    # dkv: heads, slots, warps, stages, dims, slot range, register cap (the default first).
    dkv = [
        (128, 64, 8, 2, 64, 512, 64),
        (128, 64, 8, 1, 64, 512, 64),
        (128, 64, 8, 1, 64),
        (128, 64, 8, 1, 128, 512),
    ]
    backward = lambda *configs: sparse_mla_backward(
        q, kv2, ids2, scale, None, dout, out, lse_total, *configs
    )
    runs = [
        ("fwd", c, 1.0, lambda c: sparse_mla_forward(q, kv2, ids2, scale, None, sink, c))
        for c in fwd
    ]
    runs += [("bwd dq", c, 2.5, lambda c: backward(c, None)) for c in dq]
    runs += [("bwd dkv", c, 2.5, lambda c: backward(None, c)) for c in dkv]
    for label, cfg, factor, fn in runs:
        config = LaunchConfig(*cfg)
        name = f"  sweep {label} {cfg[0]}x{cfg[1]} w{cfg[2]} s{cfg[3]}" + "".join(
            f" {tag}{value}" for tag, value in zip(("d", "r", "cap"), cfg[4:], strict=False)
        )
        try:
            record(name, shape, do_bench(lambda fn=fn, config=config: fn(config)), factor * flops)
        except Exception as error:  # a config may not fit the SM's shared memory; report and go on
            print(f"{name}: {type(error).__name__}: {str(error)[:120]}", flush=True)


def bench_fused(q, kv, ids, sink, dout, shape, flops):
    """Public wrapper vs raw kernels on identical canonical inputs; returns the raw timings."""
    import cudnn
    import flash_mla

    scale = q.shape[-1] ** -0.5
    canon, lengths = canonical_topk(ids[:, 0], kv.shape[0], None, 512)
    raw_fwd = lambda: flash_mla.flash_mla_sparse_fwd(
        q, kv, canon[:, None], scale, 512, sink, lengths
    )
    raw_fwd_ms = do_bench(raw_fwd)
    record("raw flash_mla_sparse_fwd", shape, raw_fwd_ms, flops)
    ms = do_bench(lambda: cudnn_sparse_attention(q, kv, ids, scale, attn_sink=sink))
    record("cudnn_sparse_attention fwd (compacts ids)", shape, ms, flops, raw_fwd_ms)
    ms = do_bench(
        lambda: cudnn_sparse_attention(q, kv, canon[:, None], scale, lengths, attn_sink=sink)
    )
    record("cudnn_sparse_attention fwd (topk_length)", shape, ms, flops, raw_fwd_ms)

    out, _, lse = raw_fwd()
    wrapper = cudnn.DSA.sparse_attention_backward_wrapper
    kv2 = kv[:, 0].contiguous()
    raw_bwd = lambda: wrapper(
        q, kv2, out, dout, lse, sink, canon, softmax_scale=scale, topk_length=lengths
    )
    raw_bwd_ms = do_bench(raw_bwd)
    record("raw cuDNN DSA sparse_attention_backward", shape, raw_bwd_ms, 2.5 * flops)
    qg, kvg, sg = (t.detach().requires_grad_() for t in (q, kv, sink))
    for label, hint in (("all_rows_nonempty", dict(all_rows_nonempty=True)), ("row search", {})):
        res = cudnn_sparse_attention(qg, kvg, canon[:, None], scale, lengths, attn_sink=sg, **hint)
        ms = do_bench(
            lambda res=res: torch.autograd.grad(res, [qg, kvg, sg], dout, retain_graph=True)
        )
        record(f"cudnn_sparse_attention bwd ({label})", shape, ms, 2.5 * flops, raw_bwd_ms)
    return {"fwd": raw_fwd_ms, "bwd": raw_bwd_ms}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S 1024 instead of 4096")
    parser.add_argument(
        "--sweep", action="store_true", help="also time a few Triton launch configs"
    )
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args()
    tokens, keys, heads, dim, topk = (1024 if args.quick else 4096), 65536, 128, 576, 2048
    shape = f"S{tokens} Tkv{keys} H{heads} D{dim} k{topk}"
    flops = 2 * tokens * heads * topk * (dim + 512)
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  {torch.cuda.get_device_name()}  "
        f"torch {torch.__version__}  triton {triton.__version__}  fused available: {is_cudnn_sparse_attention_available()}"
    )
    q, kv, ids, sink, dout = inputs(tokens, keys, heads, dim, topk)
    ms = do_bench(lambda: canonical_topk(ids[:, 0], keys, None, 512))
    print(
        f"{'canonical_topk (compaction, no topk_length)':<44} {shape:<34} {ms:9.3f} ms", flush=True
    )
    LOG.append(dict(name="canonical_topk", shape=shape, ms=round(ms, 4)))
    baseline = {}
    if is_cudnn_sparse_attention_available():
        baseline = bench_fused(q, kv, ids, sink, dout, shape, flops)
    bench_triton(q, kv, ids, sink, dout, shape, flops, baseline)
    if args.sweep:
        sweep_triton(q, kv, ids, sink, dout, shape, flops)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(LOG, f, indent=1)


if __name__ == "__main__":
    main()
