"""Indexer distillation losses (QSA and Step-5 CSA) against the main attention they distil, same run.

    python packages/sa-routing/benchmarks/bench_indexer_distillation.py [--quick] [--cpu-smoke]
        [--lengths N ...] [--profile] [--json PATH]

Geometries (batch 1, BF16 main Q/K/V, FP32 indexer tensors with gradients, random values):
    qsa   24 query heads / 2 KV heads of 256 (sa_layers.QSAConfig), indexer 4 heads × 128, budget
          2048, compress ratio 4 (sa_routing.QSAIndexerConfig); routes from `select_qsa_token_ids`.
    csa   64 query heads / 4 KV groups of 192, indexer 4 groups × 4 heads × 256, region 8, top-512
          (sa_routing.Step5SparseConfig); selection from `select_regions`.
Rows per (geometry, length), each with the same loss computing the LSE itself in its throughput:
    dense_warmup, attention LSE   loss forward + backward (the target, the KL and the indexer
                   gradients) with `lse=` from the flash forward (aten
                   `_scaled_dot_product_flash_attention`'s natural-log LSE), as the layers pass
                   their dense path's, vs one dense causal attention forward of the same Q/K/V
                   (torch SDPA, flash backend on CUDA, K/V expanded to the query heads outside the
                   timing); goal ≤ 1.5× that forward and peak extra memory ≤ 2 GiB at 32k / 128k.
                   On the CPU (no flash LSE) the loss computes the LSE.
    sparse, attention LSE   loss forward + backward over the routes with `lse=` from the layer's
                   sparse attention forward (`return_lse=True`), as the QSA and Step-5 layers call
                   it, vs that forward (`sa_kernels.sparse_gqa_attention` on the token routes /
                   `sa_kernels.sparse_region_attention` on the selection, block masks built outside
                   the timing); goal ≤ 0.3× that forward.
"Peak extra" is the peak allocation during the call above what was allocated before it (inputs,
routes, metadata), and also without the FP32 gradients of the indexer tensors (which the loss must
return). Times: median of `--reps` calls after one warm-up call, CUDA events around each call.
Prints one JSON row per measurement; `--json PATH` writes the rows (record schema of
tools/bench_records.py: what, shape, time_ms, baseline, baseline_ms, ratio, throughput, goal, status),
rewritten after every row. `--profile` (CUDA) also prints the device ms of the kernels of each
step with the attention's LSE given, the heaviest first. `--cpu-smoke` runs tiny shapes on the CPU
(PyTorch paths, host timer) to check the script end to end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from sa_kernels import build_route_block_mask, sparse_gqa_attention, sparse_region_attention
from sa_kernels.sparse_region_attention.block_mask import build_region_block_mask
from sa_kernels.testing import kernel_device_ms
from sa_routing import (
    csa_indexer_distillation_loss,
    qsa_indexer_distillation_loss,
    region_metadata,
    select_qsa_token_ids,
    select_regions,
)

GIB = 1024**3
DENSE_GOAL, SPARSE_GOAL, MEMORY_GOAL = 1.5, 0.3, 2.0
GOAL_LENGTHS = (32768, 131072)

# name: (heads, kv heads, head dim, indexer heads (per group), indexer dim, unit, budget units)
GEOMETRIES = {
    "qsa": (24, 2, 256, 4, 128, 4, 512),
    "csa": (64, 4, 192, 4, 256, 8, 512),
}
SMOKE = {"qsa": (4, 2, 32, 2, 16, 4, 8), "csa": (8, 4, 48, 2, 16, 8, 8)}


def times_ms(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median milliseconds of `reps` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def peak_extra_gib(fn: Callable[[], object], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB


def dense_forward(q, k, v, scale) -> Callable[[], object]:
    """One causal SDPA forward of [B, S, H, D] tensors (flash on CUDA), K/V expanded beforehand."""
    per_kv = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(per_kv, 2).transpose(1, 2)
    vt = v.repeat_interleave(per_kv, 2).transpose(1, 2)

    def run():
        if q.is_cuda:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=True, scale=scale
                )
        return torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale
        )

    return run


def attention_lse(q, k, v, scale) -> torch.Tensor | None:
    """float32 [B, S, H] natural-log LSE of the flash forward (CUDA only)."""
    if not q.is_cuda:
        return None
    per_kv = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(per_kv, 2).transpose(1, 2)
    vt = v.repeat_interleave(per_kv, 2).transpose(1, 2)
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        qt, kt, vt, 0.0, True, False, scale=scale
    )
    return out[1].transpose(1, 2).float().contiguous()


def inputs(name: str, length: int, device: torch.device, smoke: bool):
    heads, kv_heads, dim, index_heads, index_dim, unit, budget = (SMOKE if smoke else GEOMETRIES)[
        name
    ]
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def randn(*shape, dtype=dtype, grad=False):
        t = torch.randn(*shape, device=device, generator=g, dtype=dtype)
        return t.requires_grad_() if grad else t

    q, k, v = (
        randn(1, length, heads, dim),
        randn(1, length, kv_heads, dim),
        randn(1, length, kv_heads, dim),
    )
    scale = dim**-0.5
    if name == "qsa":
        iq = randn(1, length, index_heads, index_dim, dtype=torch.float32, grad=True)
        ck = randn(1, length // unit, 1, index_dim, dtype=torch.float32, grad=True)
        common = dict(token_budget=budget * unit, compress_ratio=unit, softmax_scale=scale)
        with torch.no_grad():
            routes = select_qsa_token_ids(
                iq.to(dtype), ck.to(dtype), None, token_budget=budget * unit, compress_ratio=unit
            )
        mask = build_route_block_mask(routes, length, heads) if device.type == "cuda" else None

        def loss(mode, lse=None):
            extra = {"routes": routes} if mode == "sparse" else {}
            return qsa_indexer_distillation_loss(
                q, k, iq, ck, **common, mode=mode, lse=lse, **extra
            )

        def sparse_attention(return_lse=False):
            return sparse_gqa_attention(
                q, k, v, routes, scale, block_mask=mask, return_lse=return_lse
            )

        grads = (iq, ck)
    else:
        groups = kv_heads
        positions = torch.arange(length, device=device)[None]
        padding = torch.zeros(1, length, dtype=torch.bool, device=device)
        metadata = region_metadata(positions, padding, 0, length, unit, budget)
        iq = randn(1, length, groups, index_heads, index_dim, dtype=torch.float32, grad=True)
        iw = randn(1, length, groups, index_heads, dtype=torch.float32, grad=True)
        summaries = randn(1, metadata.region_count, index_dim, dtype=torch.float32, grad=True)
        with torch.no_grad():
            selection = select_regions(
                iq.detach().to(dtype), iw.detach(), summaries.detach().to(dtype), metadata
            )
        mask = (
            build_region_block_mask(selection, metadata.region_sources, length, heads)
            if device.type == "cuda"
            else None
        )

        def loss(mode, lse=None):
            extra = {"selection": selection} if mode == "sparse" else {}
            return csa_indexer_distillation_loss(
                q, k, iq, iw, summaries, metadata, mode=mode, softmax_scale=scale, lse=lse, **extra
            )

        def sparse_attention(return_lse=False):
            return sparse_region_attention(
                q, k, v, selection, metadata.region_sources, softmax_scale=scale,
                block_mask=mask, return_lse=return_lse,
            )  # fmt: skip

        grads = (iq, iw, summaries)
    shape = (
        f"1 × {length} tokens, Hq {heads} / Hkv {kv_heads}, D {dim}, indexer {index_heads} × "
        f"{index_dim}, unit {unit}, top-{budget} units, {str(dtype).removeprefix('torch.')}"
    )
    return dict(
        q=q, k=k, v=v, scale=scale, loss=loss, sparse=sparse_attention, grads=grads, shape=shape
    )


def print_profile(label: str, fn: Callable[[], object], top: int = 10) -> None:
    """Prints the `top` kernels of `fn` by device ms per call (torch.profiler, 3 calls)."""
    times = kernel_device_ms(fn, iters=3)
    print(f"# profile {label}: {sum(times.values()):.1f} ms of kernels per call")
    for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        print(f"#   {ms:9.3f} ms  {kernel[:100]}")


def rows_for(
    name: str, length: int, device: torch.device, smoke: bool, reps: int, profile: bool = False
) -> list[dict]:
    case = inputs(name, length, device, smoke)
    q, k, v, scale, grads = case["q"], case["k"], case["v"], case["scale"], case["grads"]
    gradient_gib = sum(4 * t.numel() for t in grads) / GIB

    def step(mode, lse=None):
        def run():
            for t in grads:
                t.grad = None
            case["loss"](mode, lse).backward()

        return run

    t_dense = times_ms(dense_forward(q, k, v, scale), reps, device)
    t_sparse_attention = times_ms(case["sparse"], reps, device)
    lse = attention_lse(q, k, v, scale)
    rows = []
    dense = "dense causal attention forward (torch SDPA, flash on CUDA)"
    sparse = "the layer's sparse attention forward"
    with torch.no_grad():  # what the layers hand the loss: their sparse attention's own LSE
        sparse_lse = case["sparse"](return_lse=True)[1]
    # (mode, the attention's LSE or None: computed by the loss, baseline, its ms, goal)
    measured = [("dense_warmup", lse, dense, t_dense, DENSE_GOAL)]
    measured.append(("sparse", sparse_lse, sparse, t_sparse_attention, SPARSE_GOAL))
    for mode, given, baseline, t_base, goal in measured:
        if profile and given is not None:
            print_profile(f"{name} {length} {mode}, attention LSE given", step(mode, given))
        t_loss = times_ms(step(mode, given), reps, device)
        peak = peak_extra_gib(step(mode, given), device)
        budget = t_base * goal
        memory_ok = peak is None or mode == "sparse" or peak - gradient_gib <= MEMORY_GOAL
        # the goals judge the loss as the layers call it: with their attention's LSE
        at_goal = length in GOAL_LENGTHS and not smoke and given is not None
        what = f"{name.upper()} indexer distillation loss, {mode} fwd+bwd" + (
            ", attention LSE given" if given is not None else ""
        )
        memory = (
            ""
            if peak is None
            else f"; peak extra {peak:.2f} GiB ({peak - gradient_gib:.2f} beyond the "
            f"{gradient_gib:.2f} GiB of indexer gradients)"
        )
        computed = ""
        if given is not None:  # the same loss computing the LSE itself, on the same row
            t_own = times_ms(step(mode, None), reps, device)
            computed = f"; {t_own:.1f} ms = {t_own / t_base:.2f}× with the LSE computed by the loss"
        row = dict(
            what=what,
            shape=case["shape"],
            time_ms=round(t_loss, 3),
            baseline=baseline,
            baseline_ms=round(t_base, 3),
            ratio=round(t_base / t_loss, 3),
            throughput=f"{t_loss / t_base:.2f}× the baseline" + memory + computed,
        )
        if at_goal:
            memory_goal = f"; peak extra ≤ {MEMORY_GOAL:g} GiB" if mode == "dense_warmup" else ""
            row["goal"] = f"≤ {goal:g}× the baseline" + memory_goal
            row["status"] = "met" if t_loss <= budget and memory_ok else "not met"
        print(json.dumps(row, ensure_ascii=False))
        rows.append(row)
    if lse is not None:  # the flash LSE is the natural-log LSE the loss expects
        from sa_routing.distillation.triton_kernels import dense_lse

        documents = torch.zeros(1, length, dtype=torch.long, device=q.device)
        ours = dense_lse(q, k, documents, documents, documents, query_start=0, softmax_scale=scale)
        print(f"# {name} {length}: max |flash LSE - kernel LSE| = {(lse - ours).abs().max():.3g}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8k tokens only")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=GEOMETRIES)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="kernel times (CUDA)")
    parser.add_argument("--json")
    args = parser.parse_args()
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    if args.lengths:
        lengths = args.lengths
    elif smoke:
        lengths = [256]
    else:
        lengths = [8192] if args.quick else list(GOAL_LENGTHS)
    rows: list[dict] = []
    for length in lengths:
        for name in args.geometries:
            rows += rows_for(
                name, length, device, smoke, 2 if smoke else args.reps, args.profile and not smoke
            )
            if args.json:  # after every case: a later failure keeps what was measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1, ensure_ascii=False)
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
