"""clamped_swiglu fwd and fwd+bwd on the GPU vs copy bandwidth and torch.compile of the reference, same run.

Bytes count each tensor once: forward reads gate and up and writes out (3 tensors); backward reads gate, up and
dout and writes d_gate and d_up (5 tensors). `vs_copy` = achieved GB/s over the device-to-device copy bandwidth
measured in this run; `vs_compile` = torch.compile(reference forward, autograd backward) ms / ms.

    python packages/sa-kernels/benchmarks/bench_clamped_swiglu.py [--quick] [--sweep] [--json PATH]

`--sweep` times the forward and backward kernels (no autograd) for every launch config on the first shape, checks
that each gives the default's bits, and prints the best (the default lives in `clamped_swiglu/triton_kernels.py`).
"""

import argparse
import json

import torch
from baselines import copy_bandwidth_gbps
from triton.testing import do_bench

from sa_kernels import clamped_swiglu
from sa_kernels.clamped_swiglu import reference, triton_kernels

LIMIT = 7.0


def _bench_shape(shape, compiled, copy_gbps: float) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = (
        (torch.randn(shape, device="cuda", generator=gen) * 4).to(torch.bfloat16).requires_grad_()
    )
    up = (torch.randn(shape, device="cuda", generator=gen) * 4).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    results = {}
    for label, fn in (("ours", lambda g, u: clamped_swiglu(g, u, LIMIT)), ("compile", compiled)):
        fwd = do_bench(lambda fn=fn: fn(gate, up), warmup=25, rep=100)
        both = do_bench(
            lambda fn=fn: fn(gate, up).backward(grad), warmup=25, rep=100, grad_to_none=[gate, up]
        )
        results[label] = (fwd, both)
    n = gate.numel()
    for i, (name, tensors) in enumerate((("clamped_swiglu fwd", 3), ("clamped_swiglu fwd+bwd", 8))):
        ms, cms = results["ours"][i], results["compile"][i]
        gbps = 2 * n * tensors / ms / 1e6
        row = {
            "name": name,
            "shape": f"{shape} bfloat16",
            "ms": round(ms, 4),
            "gbps": round(gbps, 1),
            "vs_copy": round(gbps / copy_gbps, 3),
            "compile_ms": round(cms, 4),
            "vs_compile": round(cms / ms, 3),
            "copy_gbps": round(copy_gbps, 1),
        }
        rows.append(row)
        print(
            f"{name:<24} {row['shape']:<24} {ms:>8.3f} ms {gbps:>7.0f} GB/s  {row['vs_copy']:>5.2f}x copy"
            f"  {row['vs_compile']:>5.2f}x compile ({cms:.3f} ms)",
            flush=True,
        )
    return rows


def _sweep(shape, copy_gbps: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    gate = (torch.randn(shape, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    up = (torch.randn(shape, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    grad = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    fwd, bwd = triton_kernels.clamped_swiglu_forward, triton_kernels.clamped_swiglu_backward
    base = fwd(gate, up, LIMIT)
    base_grads = bwd(grad, gate, up, LIMIT)
    n = gate.numel()
    rows = []
    for cfg in triton_kernels.SWEEP_CONFIGS:
        same = torch.equal(fwd(gate, up, LIMIT, _config=cfg), base) and all(
            torch.equal(a, b)
            for a, b in zip(bwd(grad, gate, up, LIMIT, _config=cfg), base_grads, strict=True)
        )
        if not same:
            raise AssertionError(f"sweep config {cfg} changed the output bits")
        f_ms = do_bench(lambda cfg=cfg: fwd(gate, up, LIMIT, _config=cfg), warmup=10, rep=50)
        b_ms = do_bench(lambda cfg=cfg: bwd(grad, gate, up, LIMIT, _config=cfg), warmup=10, rep=50)
        row = {
            "name": "clamped_swiglu sweep",
            "shape": f"{shape} bfloat16",
            "config": cfg,
            "fwd_ms": round(f_ms, 4),
            "bwd_ms": round(b_ms, 4),
            "ms": round(f_ms + b_ms, 4),
            "fwd_vs_copy": round(2 * n * 3 / f_ms / 1e6 / copy_gbps, 3),
            "bwd_vs_copy": round(2 * n * 5 / b_ms / 1e6 / copy_gbps, 3),
        }
        rows.append(row)
        print(
            f"  sweep {cfg}: fwd {f_ms:.4f} ms ({row['fwd_vs_copy']:.3f}x copy)"
            f"  bwd {b_ms:.4f} ms ({row['bwd_vs_copy']:.3f}x copy)",
            flush=True,
        )
    best_f = min(rows, key=lambda r: r["fwd_ms"])
    best_b = min(rows, key=lambda r: r["bwd_ms"])
    best = min(rows, key=lambda r: r["ms"])
    print(f"best fwd: {best_f['config']} {best_f['fwd_ms']:.4f} ms", flush=True)
    print(f"best bwd: {best_b['config']} {best_b['bwd_ms']:.4f} ms", flush=True)
    print(f"best fwd+bwd: {best['config']} {best['ms']:.4f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="only the [65536, 4096] BF16 target shape"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time every launch config on the first shape"
    )
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    shapes = [(65536, 4096)] if args.quick else [(65536, 4096), (16384, 11008)]
    copy_gbps = copy_bandwidth_gbps(1 << 30)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s ({torch.cuda.get_device_name()})")
    rows = []
    compiled = torch.compile(lambda g, u: reference.clamped_swiglu_forward(g, u, LIMIT))
    for shape in shapes:
        rows += _bench_shape(shape, compiled, copy_gbps)
    if args.sweep:
        rows += _sweep(shapes[0], copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
