"""Run every `gpu`-marked test, and the benchmarks asked for, on an offline CUDA machine with torch.

No uv, no network: the packages are used from source (`packages/*/src` goes on the path).

    python tools/gpu_tests.py                         # all gpu tests
    python tools/gpu_tests.py --part 1/2              # every second gpu test (two calls share the suite)
    python tools/gpu_tests.py --skip-passed a.json    # the tests an earlier (stopped) run did not pass
    python tools/gpu_tests.py --no-tests --bench all  # every benchmark: rewrites docs/results/*.json
    python tools/gpu_tests.py --bench rms_norm --bench sparse_gqa --quick
    python tools/gpu_tests.py --cpu-bench             # CPU-only benchmarks (the `bench` nox session)
    python tools/gpu_tests.py --bench all --dry-run   # the commands, without running them
    python tools/gpu_tests.py --records-from run.json # record files again from a saved run's rows

A benchmark is `packages/<pkg>/benchmarks/bench_<name>.py`, run as a script with `--json PATH` and the
arguments in `bench_adapters.RECORD_ARGS` (`--quick` instead: the script's quick shapes). Its rows
become the record files `docs/results/<area>.json` (`bench_adapters.records`: one per area, in the
schema of `bench_records`), from which `python tools/render_benchmarks.py` writes docs/benchmarks.md.
Quick runs, `--cpu-bench` and runs without a GPU write their record files under .bench-out/results/
instead: they are not the record.
Prints a short table last and writes everything as JSON (`--json`, default .bench-out/gpu_tests.json);
the test outcomes are rewritten there after every test, so a run stopped by a time limit still leaves
what it ran (a failure with the end of its report), and `--skip-passed` on that file runs the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_adapters import RECORD_ARGS, records  # noqa: E402
from bench_records import environment, write_records  # noqa: E402

SOURCES = sorted(str(p) for p in (ROOT / "packages").glob("*/src"))
CPU_BENCHMARKS = ["replay"]
RESULTS = ROOT / "docs" / "results"
QUICK_RESULTS = ROOT / ".bench-out" / "results"


def benchmark_scripts() -> dict[str, Path]:
    return {
        p.stem.removeprefix("bench_"): p
        for p in sorted((ROOT / "packages").glob("*/benchmarks/bench_*.py"))
    }


MESSAGE_CHARS = 3000  # the end of a failure's report kept in the JSON


class _Outcomes:
    """pytest plugin: one record per test (the call phase, or setup when it skipped or failed there,
    teardown when it failed there; a failure keeps the last `MESSAGE_CHARS` of its report); with
    `part` = (k, n), every n-th collected test starting at the k-th (the same split whatever
    `passed` holds), of which those in `passed` are left out."""

    def __init__(self, part: tuple[int, int], on_record, passed: frozenset[str] = frozenset()):
        self.records: list[dict] = []
        self.part = part
        self.on_record = on_record
        self.passed = passed

    def pytest_collection_modifyitems(self, config, items) -> None:
        k, n = self.part
        kept = [item for item in items[k - 1 :: n] if item.nodeid not in self.passed]
        if len(kept) < len(items):
            chosen = set(kept)
            config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
            items[:] = kept

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            record = {
                "test": report.nodeid,
                "outcome": report.outcome,
                "seconds": round(report.duration, 3),
            }
            if report.failed:
                record["message"] = report.longreprtext[-MESSAGE_CHARS:]
            self.records.append(record)
            self.on_record(self.records)


def passed_tests(paths: list[str]) -> frozenset[str]:
    """The test ids that the JSON files of earlier runs (`--json`) record as passed, and not also
    as failed (a teardown error after a passing call)."""
    outcomes: dict[str, set[str]] = {}
    for path in paths:
        for record in json.loads(Path(path).read_text())["tests"]:
            outcomes.setdefault(record["test"], set()).add(record["outcome"])
    return frozenset(test for test, seen in outcomes.items() if seen == {"passed"})


def test_paths() -> list[str]:
    return [str(p) for p in sorted((ROOT / "packages").glob("*/tests"))] + [
        str(ROOT / "integration_tests")
    ]


def pytest_args(extra: list[str]) -> list[str]:
    config = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT)]
    return [*config, "-m", "gpu", "-q", "-rfE", "--durations=15", *test_paths(), *extra]


def run_tests(
    extra: list[str], part: tuple[int, int], on_record, passed: frozenset[str] = frozenset()
) -> tuple[int, list[dict]]:
    import pytest

    plugin = _Outcomes(part, on_record, passed)
    code = pytest.main(pytest_args(extra), plugins=[plugin])
    return int(code), plugin.records


def parse_part(text: str) -> tuple[int, int]:
    """`"k/n"` → (k, n) with 1 <= k <= n."""
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part must be K/N, e.g. 1/2; got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--part K/N needs 1 <= K <= N; got {text!r}")
    return k, n


def script_args(name: str, quick: bool) -> list[str]:
    """The benchmark's arguments: its quick shapes, or those that regenerate its record files."""
    return ["--quick"] if quick else list(RECORD_ARGS.get(name, ()))


def run_benchmark(name: str, script: Path, quick: bool) -> dict:
    args = script_args(name, quick)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*SOURCES, os.environ.get("PYTHONPATH", "")]),
        }
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(script), "--json", str(out), *args],
            env=env,
            cwd=ROOT,
            check=False,
        )
        rows = json.loads(out.read_text()) if out.exists() else []
    return {
        "benchmark": name,
        "command": shlex.join(["python", str(script.relative_to(ROOT)), *args]),
        "returncode": done.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }


def write_benchmark_records(result: dict, env: dict, results: Path) -> bool:
    """Write the record files of one benchmark run (`run_benchmark`'s dict); False if its rows do not
    fit the benchmark's adapter (the other benchmarks still run)."""
    name = result["benchmark"]
    try:
        written = write_records(
            results, name, result["command"], env, records(name, result["rows"])
        )
    except (KeyError, ValueError) as error:
        print(f"bench {name}: its rows did not become record files: {error!r}")
        return False
    result["record_files"] = [str(p) for p in written]
    return True


def rewrite_records(run_json: str, results: Path | None) -> int:
    """Record files again from the rows an earlier run saved (`--json`), for an adapter that changed:
    no GPU, the run's own environment and commit. A quick run's or a GPU-less run's rows go to
    .bench-out/results unless `results` is given: they are not the record."""
    report = json.loads(Path(run_json).read_text())
    not_the_record = not report["environment"].get("gpu")
    code = 0
    for result in report["benchmarks"]:
        quick = "--quick" in shlex.split(result["command"]) and "--quick" not in RECORD_ARGS.get(
            result["benchmark"], ()
        )
        folder = results or (QUICK_RESULTS if quick or not_the_record else RESULTS)
        if result["returncode"] == 0:
            ok = write_benchmark_records(result, report["environment"], folder)
            code = code or (0 if ok else 1)
            print(f"bench {result['benchmark']:<24} -> {', '.join(result.get('record_files', []))}")
    return code


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
    parser.add_argument(
        "--results",
        help="folder for the record files (default docs/results, .bench-out/results with --quick)",
    )
    parser.add_argument(
        "--commit", help="the commit measured, for the record files (default: git's HEAD, if any)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would run, run nothing, write nothing"
    )
    parser.add_argument(
        "--part",
        type=parse_part,
        default=(1, 1),
        help="K/N: run every N-th gpu test from the K-th, so N calls under a time limit share the suite",
    )
    parser.add_argument(
        "--skip-passed",
        action="append",
        default=[],
        metavar="JSON",
        help="leave out the tests this earlier run's --json file records as passed (repeatable)",
    )
    parser.add_argument(
        "--records-from",
        metavar="JSON",
        help="rewrite the record files from the benchmark rows of an earlier run's --json file "
        "(after an adapter changed); runs nothing",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    scripts = benchmark_scripts()
    wanted = CPU_BENCHMARKS if args.cpu_bench else args.bench
    names = list(scripts) if "all" in wanted else wanted
    unknown = [n for n in names if n not in scripts]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {sorted(scripts)}")
    run_pytest = not (args.no_tests or args.cpu_bench)
    missing = [path for path in args.skip_passed if not Path(path).is_file()]
    if missing and not args.dry_run:
        parser.error(
            f"--skip-passed: no such file {missing[0]!r} (a --json file of an earlier run)"
        )
    if any(Path(path).resolve() == Path(args.json).resolve() for path in args.skip_passed):
        parser.error(
            f"--skip-passed {args.json!r} is also this run's --json, which it would overwrite; "
            "give this run another --json (and the next run both files)"
        )
    not_the_record = args.quick or args.cpu_bench
    results = Path(args.results) if args.results else QUICK_RESULTS if not_the_record else RESULTS
    if args.records_from:
        return rewrite_records(args.records_from, Path(args.results) if args.results else None)
    if args.dry_run:
        if run_pytest:
            part = "" if args.part[1] == 1 else f"  (part {args.part[0]}/{args.part[1]})"
            if args.skip_passed:
                part += f"  (leaving out the tests passed in {', '.join(args.skip_passed)})"
            print("pytest " + shlex.join(pytest_args(args.pytest_args)) + part)
        for name in names:
            relative = scripts[name].relative_to(ROOT)
            print(shlex.join(["python", str(relative), *script_args(name, args.quick)]))
        print(f"record files: {results}")
        return 0
    sys.path[:0] = SOURCES
    os.environ["PYTHONPATH"] = os.pathsep.join([*SOURCES, os.environ.get("PYTHONPATH", "")])
    import torch

    if results == RESULTS and names and not torch.cuda.is_available():
        results = QUICK_RESULTS  # a run without a GPU is not the record
        print(f"no CUDA device: record files go to {results}")

    report: dict = {"environment": environment(ROOT, args.commit), "tests": [], "benchmarks": []}
    code = 0
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(tests: list[dict]) -> None:  # whole or not at all: a time limit may stop the run
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps({**report, "tests": tests}, indent=2))
        os.replace(partial, out)

    if run_pytest:
        passed = passed_tests(args.skip_passed)
        code, report["tests"] = run_tests(args.pytest_args, args.part, save, passed)
    for name in names:
        result = run_benchmark(name, scripts[name], args.quick)
        report["benchmarks"].append(result)
        code = code or result["returncode"]
        if result["returncode"] == 0 and not write_benchmark_records(
            result, report["environment"], results
        ):
            result["returncode"] = code = code or 1

    save(report["tests"])
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
            f"bench {result['benchmark']:<24} rc={result['returncode']} rows={len(result['rows'])}"
            f" {result['seconds']}s -> {', '.join(result.get('record_files', [])) or 'no record'}"
        )
    print(f"json: {args.json}")
    return code


if __name__ == "__main__":
    sys.exit(main())
