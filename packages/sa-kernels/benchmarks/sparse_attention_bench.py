"""Timing, rows and launch sweeps shared by the sparse attention benchmarks (bench_sparse_gqa.py,
bench_sparse_region_attention.py): each times a dense causal SDPA baseline and every backend's
fwd and fwd+bwd on the same inputs, and sweeps its gather kernels' launch candidates.

TFLOP/s count the visible (query head, key) pairs: 4·D flops each forward, 14·D forward+backward,
10·D for the backward kernel alone.
"""

import functools
import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench


def add_sweep_gather_argument(parser):
    """`--sweep-gather [fwd|bwd|both]`: the `which` of `sweep_launches`."""
    parser.add_argument(
        "--sweep-gather",
        nargs="?",
        const="both",
        choices=("fwd", "bwd", "both"),
        help="gather kernels' launch candidates (forward, backward or both)",
    )


def require_cuda(script):
    """Exits naming `script` without a CUDA device; else prints the device and versions."""
    if not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA device")
    import triton

    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}",
        flush=True,
    )


def bench(fn, inputs, grad):
    """(fwd ms, fwd+bwd ms), medians of short do_bench runs."""

    def fwd_bwd():
        fn(*inputs).backward(grad)

    fwd = do_bench(lambda: fn(*inputs), warmup=5, rep=20)
    both = do_bench(fwd_bwd, warmup=5, rep=40, grad_to_none=list(inputs))
    return fwd, both


def attempt(label, fn, *args):
    """`fn(*args)`, or None after printing why it failed (the other rows are still measured)."""
    try:
        return fn(*args)
    except Exception as err:  # keep measuring the other rows; the failure is reported
        print(f"{label}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
        return None


class Table:
    """Rows printed as they come and rewritten to the JSON path after each (a timeout keeps them).

    `dense` (fwd ms, fwd+bwd ms) and `block` (fwd TFLOP/s, fwd+bwd TFLOP/s), when set, add the
    rows' ratios to them (`fwd_vs_dense`, `vs_dense`, `fwd_vs_block`, `vs_block`)."""

    def __init__(self, json_path=None, shape_width=18):
        self.json_path = json_path
        self.shape_width = shape_width
        self.rows = []
        self.dense = None  # (fwd ms, fwd+bwd ms)
        self.block = None  # (fwd TFLOP/s, fwd+bwd TFLOP/s)

    def add(self, name, shape, fwd_ms, ms, pairs, head_dim, extra=None):
        fwd_tf = 4 * pairs * head_dim / fwd_ms / 1e9
        tf = 14 * pairs * head_dim / ms / 1e9
        row = {
            "name": name,
            "shape": shape,
            "fwd_ms": round(fwd_ms, 3),
            "ms": round(ms, 3),
            "fwd_tflops": round(fwd_tf, 1),
            "tflops": round(tf, 1),
        }
        if self.dense:
            row["fwd_vs_dense"] = round(self.dense[0] / fwd_ms, 3)
            row["vs_dense"] = round(self.dense[1] / ms, 3)
        if self.block:
            row["fwd_vs_block"] = round(fwd_tf / self.block[0], 3)
            row["vs_block"] = round(tf / self.block[1], 3)
        row.update(extra or {})
        self.rows.append(row)
        self.dump()
        ratios = "".join(
            f" | {key} {row[key]:.2f}"
            for key in ("fwd_vs_dense", "vs_dense", "fwd_vs_block", "vs_block")
            if key in row
        )
        print(
            f"{name:<20} {shape:<{self.shape_width}} fwd {fwd_ms:>8.3f} ms {fwd_tf:>6.1f} TF/s"
            f" | fwd+bwd {ms:>8.3f} ms {tf:>6.1f} TF/s{ratios}" + (f" | {extra}" if extra else ""),
            flush=True,
        )
        return row

    def dump(self):
        if self.json_path:
            with open(self.json_path, "w") as fh:
                json.dump(self.rows, fh, indent=1)


def dense_causal_sdpa(table, shape, q, k, v, grad):
    """Times the dense causal SDPA baseline (flash/cuDNN kernels, K/V expanded to the query heads)
    as row `dense-causal-sdpa` and sets `table.dense`; None if it failed.

    q: [1, S, Hq, D]; k, v: [1, S, Hkv, D]; grad: [1, Hq, S, D], the output's gradient."""
    length, heads, dim = q.shape[1:]
    expand = heads // k.shape[2]
    qd = q.transpose(1, 2).contiguous().requires_grad_()
    kd = k.repeat_interleave(expand, dim=2).transpose(1, 2).contiguous().requires_grad_()
    vd = v.repeat_interleave(expand, dim=2).transpose(1, 2).contiguous().requires_grad_()
    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)
    result = attempt(f"dense-causal-sdpa {shape}", bench, sdpa, (qd, kd, vd), grad)
    if result is not None:
        table.add("dense-causal-sdpa", shape, *result, heads * length * (length + 1) // 2, dim)
        table.dense = result
    return result


def sweep_launches(table, shape, which, directions, head_pairs, head_dim):
    """Times each launch candidate of a gather kernel alone, forward and backward apart, as rows
    `sweep-gather-fwd` / `sweep-gather-bwd`; a candidate whose result differs from the default
    launch's is reported, not timed.

    Args:
        which: "fwd", "bwd" or "both".
        directions: (backward, candidates, run, want) per kernel: candidates [(config, is the
            default)], run(config) the kernel's outputs, want the default launch's outputs.
        head_pairs: visible (query head, key) pairs.
    """
    for backward, candidates, run, want in directions:
        if which != "both" and which != ("bwd" if backward else "fwd"):
            continue
        best = None
        for config, is_default in candidates:
            got = attempt(f"sweep-gather {config}", run, config)
            if got is None:
                continue
            mismatch = [
                float((a.float() - b.float()).abs().max())
                for a, b in zip(got, want, strict=True)
                if not torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
            ]
            if mismatch:  # reported, not timed; the run goes on
                print(f"sweep-gather {config}: MISMATCH vs the default, max abs diff {mismatch}")
                continue
            result = attempt(
                f"sweep-gather {config}", do_bench, functools.partial(run, config), 5, 40
            )
            if result is None:
                continue
            name = "sweep-gather-" + ("bwd" if backward else "fwd")
            flops = (10 if backward else 4) * head_pairs * head_dim
            row = {"name": name, "shape": shape, "config": config, "ms": round(result, 3)}
            row["tflops"] = round(flops / result / 1e9, 1)
            row["default"] = is_default
            table.rows.append(row)
            table.dump()
            print(
                f"{name:<20} {shape:<{table.shape_width}} {result:8.3f} ms {row['tflops']:6.1f} "
                f"TF/s {config}" + (" (default)" if row["default"] else ""),
                flush=True,
            )
            if best is None or result < best[1]:
                best = (config, result)
        if best is not None:
            print(f"sweep-gather best {'bwd' if backward else 'fwd'}: {best[0]} ({best[1]:.3f} ms)")
