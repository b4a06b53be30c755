"""rms_norm (and layer_norm_e2, rms_norm_rope_e4m3) on the GPU: fused Triton kernels vs copy bandwidth and torch.compile, same run.

Bytes count each tensor read or written once: forward reads x and writes y; backward reads x and dy and writes
dx (weight, rstd and the dweight partials are < 0.1 % at 4096 channels). `vs_copy` = achieved GB/s over the
device-to-device copy bandwidth measured in this run; `vs_compile` = torch.compile(reference) ms / ms.

    python packages/sa-kernels/benchmarks/bench_rms_norm.py [--quick] [--json PATH]
"""

import argparse
import json

import torch
from baselines import copy_bandwidth_gbps
from triton.testing import do_bench

from sa_kernels import grouped_rms_norm, layer_norm_e2, rms_norm, rms_norm_rope_e4m3, round_to_e4m3
from sa_kernels.layer_norm import reference as layer_norm_reference
from sa_kernels.norm_rope_e4m3 import rotate_half_split_
from sa_kernels.rms_norm import reference

EPS = 1e-5


def _fwd_bwd_ms(fn, x, w, grad) -> tuple[float, float]:
    def step():
        fn(x, w).backward(grad)

    fwd = do_bench(lambda: fn(x, w), warmup=25, rep=100)
    both = do_bench(step, warmup=25, rep=100, grad_to_none=[x, w])
    return fwd, both


def _print(row):
    print(
        f"{row['name']:<34} {row['shape']:<22} {row['ms']:>8.3f} ms {row['gbps']:>7.0f} GB/s"
        f"  {row['vs_copy']:>5.2f}x copy  {row.get('vs_compile', float('nan')):>5.2f}x compile",
        flush=True,
    )


def _bench_grouped(copy_gbps: float) -> dict:
    """Query-head norm read in place from a fused QKV output: [16384 tokens, 4 groups, 16 + 2 rows, 192]."""
    tokens, groups, heads, dim = 16384, 4, 16, 192
    qkv = (
        torch.randn(tokens, groups, heads + 2, dim, device="cuda")
        .to(torch.bfloat16)
        .requires_grad_()
    )
    w = (torch.randn(dim, device="cuda") * 0.1).requires_grad_()
    grad = torch.randn(tokens * groups, heads, dim, device="cuda").to(torch.bfloat16)

    def step():
        q = qkv[:, :, :heads].flatten(0, 1)
        grouped_rms_norm(q, w, EPS).backward(grad)

    ms = do_bench(step, warmup=25, rep=100, grad_to_none=[qkv, w])
    # x read twice, y written, dy read, dx written; the strided-view backward adds a full dqkv zero + copy.
    gbps = 5 * grad.numel() * 2 / ms / 1e6
    row = {
        "name": "grouped_rms_norm fwd+bwd",
        "shape": f"({tokens}, {groups}, {heads}+2, {dim}) bf16",
        "ms": round(ms, 4),
        "gbps": round(gbps, 1),
        "vs_copy": round(gbps / copy_gbps, 3),
        "copy_gbps": round(copy_gbps, 1),
    }
    _print(row)
    return row


def _bench_query_epilogue(copy_gbps: float) -> dict:
    """The Step-5 query epilogue at one projection span (16384 tokens x 16 heads x 256, RoPE on 32
    channels): `rms_norm_rope_e4m3` against the ops it replaces (`rms_norm`, the PyTorch RoPE,
    `round_to_e4m3`), same run, and whether their bits agree."""
    tokens, heads, dim, half = 16384, 16, 256, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(dim, device="cuda", generator=gen) * 0.3
    positions = torch.randint(0, 131072, (tokens,), device="cuda", generator=gen).float()
    angles = positions[:, None] * 10000.0 ** (-torch.arange(half, device="cuda") / half)
    cos, sin = angles.cos(), angles.sin()

    def composed():
        y = rms_norm(x, w, EPS, zero_centered=True, weight_in_activation_dtype=True)
        return round_to_e4m3(rotate_half_split_(y, cos[:, None], sin[:, None]))

    fused = lambda: rms_norm_rope_e4m3(x, w, EPS, cos, sin)
    same = torch.equal(fused().view(torch.int16), composed().view(torch.int16))
    ms = do_bench(fused, warmup=25, rep=100)
    composed_ms = do_bench(composed, warmup=25, rep=100)
    gbps = 2 * x.numel() * 2 / ms / 1e6
    row = {
        "name": "rms_norm_rope_e4m3 fwd",
        "shape": f"({tokens}, {heads}, {dim}) bfloat16",
        "ms": round(ms, 4),
        "gbps": round(gbps, 1),
        "vs_copy": round(gbps / copy_gbps, 3),
        "composed_ms": round(composed_ms, 4),
        "vs_composed": round(composed_ms / ms, 3),
        "bits_equal_composed": same,
        "copy_gbps": round(copy_gbps, 1),
    }
    _print(row)
    print(f"    vs the composed ops {row['vs_composed']:.2f}x, same bits: {same}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="only the [65536, 4096] BF16 target shape"
    )
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    shapes = [((65536, 4096), torch.bfloat16)]
    if not args.quick:
        shapes += [((8192, 4096), torch.bfloat16), ((65536, 4096), torch.float32)]
    copy_gbps = copy_bandwidth_gbps(1 << 30)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s ({torch.cuda.get_device_name()})")
    rows = []
    for shape, dtype in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(shape[-1], device="cuda", generator=gen) * 0.1).requires_grad_()
        grad = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
        ours = lambda x, w: rms_norm(x, w, EPS, torch.bfloat16)
        compiled = torch.compile(
            lambda x, w: reference.rms_norm_forward(x, w, EPS, torch.bfloat16)[0]
        )
        fwd, both = _fwd_bwd_ms(ours, x, w, grad)
        cfwd, cboth = _fwd_bwd_ms(compiled, x, w, grad)
        n, xb = x.numel(), x.element_size()
        label = f"{tuple(shape)} {str(dtype)[6:]}"
        for name, ms, cms, nbytes in (
            ("rms_norm fwd", fwd, cfwd, n * (xb + 2)),
            ("rms_norm fwd+bwd", both, cboth, n * (xb + 2 + xb + 2 + xb)),
        ):
            gbps = nbytes / ms / 1e6
            row = {
                "name": name,
                "shape": label,
                "ms": round(ms, 4),
                "gbps": round(gbps, 1),
                "vs_copy": round(gbps / copy_gbps, 3),
                "compile_ms": round(cms, 4),
                "vs_compile": round(cms / ms, 3),
                "copy_gbps": round(copy_gbps, 1),
            }
            rows.append(row)
            _print(row)
    rows.append(_bench_grouped(copy_gbps))
    rows.append(_bench_query_epilogue(copy_gbps))
    x = torch.randn(65536, 256, device="cuda").to(torch.bfloat16)
    w, b = torch.randn(256, device="cuda"), torch.randn(256, device="cuda")
    ms = do_bench(lambda: layer_norm_e2(x, w, b, EPS), warmup=25, rep=100)
    compiled = torch.compile(lambda x, w, b: layer_norm_reference.layer_norm_e2(x, w, b, EPS))
    cms = do_bench(lambda: compiled(x, w, b), warmup=25, rep=100)
    gbps = 4 * x.numel() / ms / 1e6
    row = {
        "name": "layer_norm_e2 fwd",
        "shape": "(65536, 256) bfloat16",
        "ms": round(ms, 4),
        "gbps": round(gbps, 1),
        "vs_copy": round(gbps / copy_gbps, 3),
        "compile_ms": round(cms, 4),
        "vs_compile": round(cms / ms, 3),
        "copy_gbps": round(copy_gbps, 1),
    }
    rows.append(row)
    _print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
