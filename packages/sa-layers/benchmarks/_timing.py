"""Timing and peak memory of one call, and the record rows that compare two timings, shared by the
sa-layers benchmark scripts.

GPU calls are timed with CUDA events around each call (the device synchronised before and after),
CPU calls with a host timer; the calls these scripts time last milliseconds to seconds, so a handful
of them after one warm-up call (which compiles what the call compiles) gives a stable median.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch


def call_times_ms(
    fn: Callable[[], object],
    *,
    reps: int,
    device: str | torch.device,
    warmup: int = 1,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn` after `warmup` untimed calls; `before` runs
    ahead of every timed call, outside the timing (a barrier across ranks, for example)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_ms(
    fn: Callable[[], object], *, reps: int, device: str | torch.device, warmup: int = 1
) -> float:
    """Median milliseconds of `reps` calls after `warmup` untimed ones (`call_times_ms`)."""
    return statistics.median(call_times_ms(fn, reps=reps, device=device, warmup=warmup))


def peak_gib(
    fn: Callable[[], object], device: str | torch.device = "cuda", *, absolute: bool = False
) -> float | None:
    """Peak CUDA memory of one call of `fn` in GiB: above what was allocated before it, or the
    whole peak with `absolute` (weights and optimizer state included). None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = 0 if absolute else torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} GiB"


def log(message: str, started: float) -> None:
    """`message` on stderr after the seconds since `started` (a `time.perf_counter()`)."""
    print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)


def record_row(
    *, what: str, shape: str, time_ms: float, baseline: str, baseline_ms: float, **rest
) -> dict:
    """A record row (`tools/bench_records.py`) of `time_ms` against `baseline_ms` measured in the
    same run: times rounded to µs, `ratio` = baseline_ms / time_ms to two decimals (> 1: faster
    than the baseline), then `rest` (throughput, goal, status ...) as given."""
    return dict(
        what=what,
        shape=shape,
        time_ms=round(time_ms, 3),
        baseline=baseline,
        baseline_ms=round(baseline_ms, 3),
        ratio=round(baseline_ms / time_ms, 2),
        **rest,
    )


def tokens_per_s(tokens: int, ms: float, baseline_ms: float) -> str:
    """The throughput of `tokens` in `ms` against that in `baseline_ms`: "1,234 tok/s vs 567"."""
    return f"{tokens / ms * 1e3:,.0f} tok/s vs {tokens / baseline_ms * 1e3:,.0f}"


def share_of_layer(part_ms: float, layer_ms: float) -> str:
    """`part_ms` as a percentage of `layer_ms`, e.g. "4.2 % of the layer"."""
    return f"{100 * part_ms / layer_ms:.1f} % of the layer"
