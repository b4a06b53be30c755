"""Context-parallel scaling of the 4-layer Step-5 and QSA models: fwd+bwd tokens/s on 1 to N GPUs.

The models of `_cp_models.py`'s "bench" size (Step-5: SWA, SWA, SWA, CSA, hidden 2048, 64 heads / 4
groups, D 192, window 512, region 8, top-512; QSA: `QSAConfig`'s defaults; vocab 4096 both) in
bf16, indexers frozen, activation checkpointing with route replay (`--no-checkpointing` to drop
it), one row of random tokens sharded contiguously over every rank. Rows:

    weak scaling    `--tokens-per-gpu T` (default 32 768): T · N global tokens on N GPUs; the
                    baseline is one GPU on T tokens (ideal: the same time), so ratio = T_1 / T_N
                    is the weak-scaling efficiency
    strong scaling  `--global-tokens G` (default 131 072) on N GPUs; the baseline is one GPU on G
                    tokens divided by N (ideal), so ratio = T_1 / (N · T_N) is the efficiency

Step time is the median over `--reps` steps (after one warm-up step; none with --smoke) of the
slowest rank's CUDA-event time, the ranks lined up by a barrier before each step. Communication is
the NCCL kernel time of one profiled step (torch.profiler; gloo's collective time on the CPU), the
slowest rank's; peak memory is the largest rank's `max_memory_allocated` in that step (weights
included). The world-size-1 times come from `--baseline-json` (the rows of a world-size-1 run of
this script), or are the run itself at world size 1, or else rank 0 measures them alone in the
same job. Rows follow `tools/bench_records.py` (`--json PATH`, rewritten after every row:
docs/results/cp_scaling.json through tools/gpu_tests.py). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 unless set).

From the repo root, the workspace packages importable:

    # world size 1 (also what `python tools/gpu_tests.py --bench cp_scaling` runs)
    python packages/sa-layers/benchmarks/bench_cp_scaling.py --json cp_scaling_1gpu.json
    torchrun --nproc-per-node 1 packages/sa-layers/benchmarks/bench_cp_scaling.py --json cp_scaling_1gpu.json
    # 2, 4, 8 GPUs against that baseline, every row gathered in one file (8 GPUs: 512k global
    # tokens at 64k per GPU as well)
    cp cp_scaling_1gpu.json cp_scaling.json
    torchrun --nproc-per-node 2 packages/sa-layers/benchmarks/bench_cp_scaling.py --baseline-json cp_scaling_1gpu.json --json cp_scaling.json --append
    torchrun --nproc-per-node 4 packages/sa-layers/benchmarks/bench_cp_scaling.py --baseline-json cp_scaling_1gpu.json --json cp_scaling.json --append
    torchrun --nproc-per-node 8 packages/sa-layers/benchmarks/bench_cp_scaling.py --tokens-per-gpu 32768 65536 --baseline-json cp_scaling_1gpu.json --json cp_scaling.json --append
    # the code paths at tiny sizes on CPU gloo ranks (not a measurement)
    torchrun --nproc-per-node 2 packages/sa-layers/benchmarks/bench_cp_scaling.py --smoke

The 64k-per-GPU baseline of the 8-GPU line needs `--tokens-per-gpu 32768 65536` in the 1-GPU run
too; without a baseline row a row has no ratio. cp_scaling.json's rows are then the record rows of
docs/results/cp_scaling.json (`bench_records.write_records` adds the environment).
"""

from __future__ import annotations

import os

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import _cp_models as cpm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _timing import call_times_ms, gib, log, peak_gib  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

WEAK_GOALS = {4: 0.85, 8: 0.75}
BIG_RUN = (8, 524288)  # 512k global tokens on 8 GPUs fit and run


@dataclass(frozen=True)
class Measured:
    ms: float
    comm_ms: float | None
    peak_gib: float | None


def comm_ms(prof, device: torch.device) -> float:
    """Collective time of a profiled step: the NCCL kernels on CUDA, the gloo collectives on the
    CPU (milliseconds, summed)."""
    total_us = 0.0
    for event in prof.events():
        name = event.name.lower()
        if device.type == "cuda":
            if event.device_type == DeviceType.CUDA and "nccl" in name:
                total_us += event.time_range.elapsed_us()
        elif name.startswith("gloo:"):
            total_us += event.time_range.elapsed_us()
    return total_us / 1e3


def measure(args, kind: str, local: int, group, device: torch.device) -> Measured:
    """One model's fwd+bwd step on `local` tokens per rank of `group` (the slowest rank's)."""
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    model = cpm.build(kind, args.size, device, args.dtype)
    if args.checkpointing:
        model.enable_activation_checkpointing()
    batch = cpm.make_batch(kind, args.size, local * size, False, device)

    def step():
        model.zero_grad(set_to_none=True)
        cpm.run(kind, model, batch, shard=(rank, size), group=group).loss.backward()

    times = call_times_ms(
        step,
        reps=args.reps,
        device=device,
        warmup=0 if args.smoke else 1,  # the smoke run checks code paths, it does not measure
        before=lambda: dist.barrier(group=group),
    )
    times = cpm.all_ranks_max(times, device, group)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier(group=group)
    with profile(activities=activities) as prof:
        if device.type == "cuda":
            peak = peak_gib(step, device, absolute=True)  # synchronises the device
        else:
            step()
            peak = None
    comm, peak_max = cpm.all_ranks_max([comm_ms(prof, device), peak or 0.0], device, group)
    return Measured(
        statistics.median(times), comm if size > 1 else None, None if peak is None else peak_max
    )


# -- rows --------------------------------------------------------------------------------------------


def unit(device: torch.device, n: int) -> str:
    noun = "GPU" if device.type == "cuda" else "CPU rank"
    return f"{n} {noun}{'s' if n > 1 else ''}"


def what(kind: str, mode: str, n: int, device: torch.device) -> str:
    return f"{cpm.LABELS[kind]} fwd+bwd, {mode} scaling, CP over {unit(device, n)}"


def shape(args, kind: str, global_tokens: int, n: int, device: torch.device) -> str:
    per = "GPU" if device.type == "cuda" else "rank"
    extras = ", activation checkpointing" if args.checkpointing else ""
    extras += "" if device.type == "cuda" else " (CPU smoke)"
    dtype = str(args.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    return (
        f"{global_tokens:,} global tokens ({global_tokens // n:,} per {per}), "
        f"{cpm.geometry(kind, args.size)}, {dtype}{extras}"
    )


_ONE = re.compile(r", (?:weak|strong) scaling, CP over 1 (?:GPU|CPU rank)$")
_TOKENS = re.compile(r"^([\d,]+) global tokens")


def baseline_times(path: str | None) -> dict[tuple[str, int], float]:
    """{(model label, global tokens): ms} of the world-size-1 rows of a previous run's JSON (a
    list of rows or a record file)."""
    if path is None:
        return {}
    with open(path) as f:
        rows = json.load(f)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    out = {}
    for row in rows:
        label = _ONE.split(row["what"])[0] if _ONE.search(row["what"]) else None
        tokens = _TOKENS.match(row["shape"])
        if label is not None and tokens is not None:
            out[(label.removesuffix(" fwd+bwd"), int(tokens[1].replace(",", "")))] = row["time_ms"]
    return out


def make_row(args, kind, mode, n, global_tokens, m: Measured, base_ms, device) -> dict:
    efficiency = None
    baseline = baseline_ms = None
    if n > 1 and base_ms is not None:
        ideal = base_ms if mode == "weak" else base_ms / n
        efficiency = ideal / m.ms
        baseline = (
            f"{unit(device, 1)} on {global_tokens // n:,} tokens (ideal: the same time)"
            if mode == "weak"
            else f"{unit(device, 1)} on {global_tokens:,} tokens, its time / {n} (ideal)"
        )
        baseline_ms = ideal
    parts = [f"{global_tokens / m.ms * 1e3:,.0f} tok/s"]
    if efficiency is not None:
        parts.append(f"efficiency {100 * efficiency:.0f} %")
    if m.comm_ms is not None:
        parts.append(f"comm {m.comm_ms:.1f} ms ({100 * m.comm_ms / m.ms:.0f} % of the step)")
    parts.append(f"peak {gib(m.peak_gib)} per {'GPU' if device.type == 'cuda' else 'rank'}")
    goals, met = [], []
    if mode == "weak" and n in WEAK_GOALS and efficiency is not None and device.type == "cuda":
        goals.append(f"≥ {100 * WEAK_GOALS[n]:.0f} % weak-scaling efficiency")
        met.append(efficiency >= WEAK_GOALS[n])
    if n == BIG_RUN[0] and global_tokens >= BIG_RUN[1] and device.type == "cuda":
        goals.append("512k global tokens fit and run")
        met.append(True)
    row = {
        "what": what(kind, mode, n, device),
        "shape": shape(args, kind, global_tokens, n, device),
        "time_ms": round(m.ms, 3),
        "baseline": baseline,
        "baseline_ms": None if baseline_ms is None else round(baseline_ms, 3),
        "ratio": None if efficiency is None else round(efficiency, 3),
        "throughput": "; ".join(parts),
    }
    if goals:
        row["goal"] = "; ".join(goals)
        row["status"] = "met" if all(met) else "not met"
    return row


# -- the command -------------------------------------------------------------------------------------


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens-per-gpu", type=int, nargs="+", help="weak scaling (default 32768)"
    )
    parser.add_argument(
        "--global-tokens", type=int, nargs="+", help="strong scaling (default 131072)"
    )
    parser.add_argument("--model", choices=("step5", "qsa", "both"), default="both")
    parser.add_argument("--reps", type=int, help="timed steps per row (default 3; --smoke 1)")
    parser.add_argument("--baseline-json", help="rows of a world-size-1 run of this script")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--quick", action="store_true", help="weak scaling only, 2 timed steps")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny models on CPU gloo ranks: the code paths only"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda unless --smoke")
    parser.add_argument("--json", help="write the rows here (a list of record rows)")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the rows already in --json, replacing those of the same what and shape",
    )
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke or not cuda else "cuda")
    if args.device == "cuda" and not cuda:
        parser.error("needs a CUDA device (or --smoke for the CPU code-path check)")
    args.backend = "nccl" if args.device == "cuda" else "gloo"
    args.size = "tiny" if args.smoke else "bench"
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    args.reps = args.reps or (1 if args.smoke else 2 if args.quick else 3)
    args.tokens_per_gpu = args.tokens_per_gpu or [32 if args.smoke else 32768]
    if args.quick and args.global_tokens is None:
        args.global_tokens = []
    args.global_tokens = (
        args.global_tokens if args.global_tokens is not None else [64 if args.smoke else 131072]
    )
    args.kinds = cpm.KINDS if args.model == "both" else (args.model,)
    return parser, args


def main(argv=None) -> None:
    parser, args = parse_args(argv)
    rank, world, device = cpm.init_distributed(args.backend, args.device)
    try:
        for kind in args.kinds:
            multiple = cpm.shard_multiple(kind, args.size)
            for g in args.global_tokens:
                if g % world or (g // world) % multiple:
                    parser.error(f"--global-tokens {g}: {world} shards of a multiple of {multiple}")
            for t in args.tokens_per_gpu:
                if t % multiple:
                    parser.error(f"--tokens-per-gpu {t} must be a multiple of {multiple}")
        started = time.perf_counter()
        world_group = dist.new_group(list(range(world)))
        solo = dist.new_group([0]) if world > 1 else world_group
        baselines = baseline_times(args.baseline_json)
        cache: dict[tuple[str, int, int], Measured | None] = {}

        def measured(kind: str, local: int, n: int) -> Measured | None:
            """This world's step (n == world), or rank 0's alone (n == 1: None on the other ranks,
            which wait)."""
            key = (kind, local, n)
            if key not in cache:
                if n == world:
                    cache[key] = measure(args, kind, local, world_group, device)
                else:
                    cache[key] = measure(args, kind, local, solo, device) if rank == 0 else None
                    dist.barrier(group=world_group)
                gc.collect()  # the model of the step is gone: free its memory for the next one
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            return cache[key]

        earlier = []
        if args.append and args.json and os.path.exists(args.json):
            with open(args.json) as f:
                earlier = json.load(f)
        rows: list[dict] = []
        for kind in args.kinds:
            jobs = [("weak", t * world, t) for t in args.tokens_per_gpu]
            jobs += [("strong", g, g // world) for g in args.global_tokens]
            for mode, global_tokens, local in jobs:
                m = measured(kind, local, world)
                one_tokens = local if mode == "weak" else global_tokens
                base = baselines.get((cpm.LABELS[kind], one_tokens))
                if base is None and world == 1:
                    base = m.ms
                if base is None and world > 1 and not args.baseline_json:
                    one = measured(kind, one_tokens, 1)
                    base = None if one is None else one.ms
                if rank != 0:
                    continue
                rows.append(make_row(args, kind, mode, world, global_tokens, m, base, device))
                print(json.dumps(rows[-1], ensure_ascii=False), flush=True)
                log(f"{kind} {mode} {global_tokens} on {world}", started)
                if args.json:  # after every row: a later failure keeps what was measured
                    new = {(r["what"], r["shape"]) for r in rows}
                    kept = [r for r in earlier if (r["what"], r["shape"]) not in new]
                    with open(args.json, "w") as f:
                        json.dump(kept + rows, f, indent=1, ensure_ascii=False)
        dist.barrier()  # the ranks leave together, as in tools/cp_parity.py
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
