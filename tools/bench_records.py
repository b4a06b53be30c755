"""The benchmark record: the schema of the files in docs/results/, and how they are written.

A record file, `docs/results/<area>.json`, holds one run of one benchmark script:

    {"benchmark": "<name of bench_<name>.py>", "command": "python packages/.../bench_<name>.py ...",
     "environment": {"gpu", "driver", "torch", "triton", "cuda", "commit", "date"},
     "rows": [{"what", "shape", "time_ms", "throughput", "baseline", "baseline_ms", "ratio",
               "goal", "status"}, ...]}

`ratio` is baseline_ms / time_ms (above 1: faster than the baseline); `throughput` (a string with its
unit), `goal` and `status` may be absent. `tools/bench_adapters.py` turns each script's own rows into
such rows; tools/gpu_tests.py writes them, tools/render_benchmarks.py renders them.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

RECORD_KEYS = ("benchmark", "command", "environment", "rows")
ENVIRONMENT_KEYS = ("gpu", "driver", "torch", "triton", "cuda", "commit", "date")
ROW_KEYS = (
    "what",
    "shape",
    "time_ms",
    "throughput",
    "baseline",
    "baseline_ms",
    "ratio",
    "goal",
    "status",
)
REQUIRED_ROW_KEYS = ("what", "shape", "time_ms", "baseline", "baseline_ms", "ratio")


def check_record(record: dict) -> list[str]:
    """What breaks the schema in a record file's content (an empty list when nothing does)."""
    problems = []
    if tuple(sorted(record)) != tuple(sorted(RECORD_KEYS)):
        problems.append(f"keys must be {RECORD_KEYS}; got {tuple(record)}")
    env = record.get("environment", {})
    if not isinstance(env, dict) or tuple(sorted(env)) != tuple(sorted(ENVIRONMENT_KEYS)):
        problems.append(f"environment keys must be {ENVIRONMENT_KEYS}; got {tuple(env)}")
    rows = record.get("rows", [])
    if not isinstance(rows, list) or not rows:
        problems.append("rows must be a non-empty list")
        return problems
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED_ROW_KEYS if k not in row]
        extra = [k for k in row if k not in ROW_KEYS]
        if missing or extra:
            problems.append(f"row {i}: missing {missing}, unknown {extra}")
            continue
        if not isinstance(row["what"], str) or not isinstance(row["shape"], str):
            problems.append(f"row {i}: what and shape must be strings")
        for key in ("time_ms", "baseline_ms", "ratio"):
            if row[key] is not None and not isinstance(row[key], int | float):
                problems.append(f"row {i}: {key} must be a number or null; got {row[key]!r}")
        if (row["baseline"] is None) != (row["baseline_ms"] is None and row["ratio"] is None):
            problems.append(f"row {i}: a baseline needs baseline_ms or a ratio, and only then")
        if row["time_ms"] and row["baseline_ms"] and row["ratio"] is not None:
            expected = row["baseline_ms"] / row["time_ms"]
            if abs(row["ratio"] - expected) > 0.01 * expected + 0.005:  # 2-decimal rounding
                problems.append(f"row {i}: ratio {row['ratio']} is not baseline_ms / time_ms")
    return problems


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=False, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _driver() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def environment(root: Path, commit: str | None = None) -> dict:
    """GPU, driver, torch, Triton, CUDA, commit (git's HEAD, `-dirty` with local changes) and date."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if commit is None:
        commit = _git(root, "rev-parse", "--short", "HEAD")
        if commit and _git(root, "status", "--porcelain", "--untracked-files=no"):
            commit += "-dirty"
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "driver": _driver() if cuda else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def row(
    what: str,
    shape: str,
    time_ms: float | None,
    baseline: str | None = None,
    baseline_ms: float | None = None,
    *,
    throughput: str | None = None,
    ratio: float | None = None,
    goal: str | None = None,
    status: str | None = None,
) -> dict:
    """One record row; `ratio` defaults to baseline_ms / time_ms."""
    if ratio is None and baseline_ms and time_ms:
        ratio = baseline_ms / time_ms
    out = {
        "what": what,
        "shape": shape,
        "time_ms": None if time_ms is None else round(time_ms, 4),
        "baseline": baseline,
        "baseline_ms": None if baseline_ms is None else round(baseline_ms, 4),
        "ratio": None if ratio is None else round(ratio, 3),
    }
    if throughput is not None:
        out["throughput"] = throughput
    if goal is not None:
        out["goal"] = goal
    if status is not None:
        out["status"] = status
    return out


def write_records(
    folder: Path, name: str, command: str, env: dict, areas: dict[str, list]
) -> list[Path]:
    """One file per area: `folder/<area>.json`; returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for area, rows in areas.items():
        record = {"benchmark": name, "command": command, "environment": env, "rows": rows}
        problems = check_record(record)
        if problems:
            raise ValueError(f"write_records: {area}: {problems}")
        path = folder / f"{area}.json"
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        written.append(path)
    return written
