"""Run every `gpu`-marked test, and the benchmarks asked for, on an offline CUDA machine with torch.

No uv, no network: the packages are used from source (`packages/*/src` goes on the path).

    python tools/gpu_tests.py                         # all gpu tests
    python tools/gpu_tests.py --bench rms_norm --bench sparse_gqa --quick
    python tools/gpu_tests.py --no-tests --bench all  # every benchmark
    python tools/gpu_tests.py --cpu-bench             # CPU-only benchmarks (the `bench` nox session)

Prints a short table last and writes everything as JSON (`--json`, default .bench-out/gpu_tests.json).
A benchmark is `packages/<pkg>/benchmarks/bench_<name>.py`, run as a script with `--json PATH`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(str(p) for p in (ROOT / "packages").glob("*/src"))
CPU_BENCHMARKS = ["replay"]


def benchmark_scripts() -> dict[str, Path]:
    return {
        p.stem.removeprefix("bench_"): p
        for p in sorted((ROOT / "packages").glob("*/benchmarks/bench_*.py"))
    }


class _Outcomes:
    """pytest plugin: one record per test (the call phase, or setup when it skipped or failed there)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.records.append(
                {
                    "test": report.nodeid,
                    "outcome": report.outcome,
                    "seconds": round(report.duration, 3),
                }
            )


def run_tests(extra: list[str]) -> tuple[int, list[dict]]:
    import pytest

    plugin = _Outcomes()
    paths = [str(p) for p in sorted((ROOT / "packages").glob("*/tests"))] + [
        str(ROOT / "integration_tests")
    ]
    args = [
        "-c",
        str(ROOT / "pyproject.toml"),
        "--rootdir",
        str(ROOT),
        "-m",
        "gpu",
        "-q",
        *paths,
        *extra,
    ]
    code = pytest.main(args, plugins=[plugin])
    return int(code), plugin.records


def run_benchmark(name: str, script: Path, quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, str(script), "--json", str(out), *(["--quick"] if quick else [])]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*SOURCES, os.environ.get("PYTHONPATH", "")]),
        }
        start = time.perf_counter()
        done = subprocess.run(command, env=env, cwd=ROOT, check=False)
        rows = json.loads(out.read_text()) if out.exists() else []
    return {
        "benchmark": name,
        "command": " ".join(command[1:]),
        "returncode": done.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }


def environment() -> dict:
    import torch

    info = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bench", action="append", default=[], help="benchmark name (bench_<name>.py) or 'all'"
    )
    parser.add_argument("--no-tests", action="store_true", help="run only the benchmarks")
    parser.add_argument(
        "--cpu-bench", action="store_true", help="run the CPU benchmarks (implies --no-tests)"
    )
    parser.add_argument("--quick", action="store_true", help="pass --quick to the benchmarks")
    parser.add_argument("--json", default=str(ROOT / ".bench-out" / "gpu_tests.json"))
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    sys.path[:0] = SOURCES
    os.environ["PYTHONPATH"] = os.pathsep.join([*SOURCES, os.environ.get("PYTHONPATH", "")])
    scripts = benchmark_scripts()
    wanted = CPU_BENCHMARKS if args.cpu_bench else args.bench
    names = list(scripts) if "all" in wanted else wanted
    unknown = [n for n in names if n not in scripts]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {sorted(scripts)}")

    report: dict = {"environment": environment(), "tests": [], "benchmarks": []}
    code = 0
    if not (args.no_tests or args.cpu_bench):
        code, report["tests"] = run_tests(args.pytest_args)
    for name in names:
        result = run_benchmark(name, scripts[name], args.quick)
        report["benchmarks"].append(result)
        code = code or result["returncode"]

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print("\n" + " ".join(f"{k}={v}" for k, v in report["environment"].items()))
    if report["tests"]:
        counts: dict[str, int] = {}
        for record in report["tests"]:
            counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
        print("gpu tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        for record in report["tests"]:
            if record["outcome"] == "failed":
                print(f"  FAILED {record['test']}")
    for result in report["benchmarks"]:
        print(
            f"bench {result['benchmark']:<24} rc={result['returncode']} rows={len(result['rows'])} {result['seconds']}s"
        )
    print(f"json: {args.json}")
    return code


if __name__ == "__main__":
    sys.exit(main())
