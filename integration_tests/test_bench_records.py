"""tools/bench_records.py turns each benchmark script's rows into record files of the schema, with the
goals judged from the numbers (CPU: the scripts' rows are built here with the keys the scripts write)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    p.stem.removeprefix("bench_"): p for p in sorted(ROOT.glob("packages/*/benchmarks/bench_*.py"))
}


sys.path.insert(0, str(ROOT / "tools"))
import bench_adapters  # noqa: E402
import bench_records  # noqa: E402
import gpu_tests  # noqa: E402


def _copy_row(name, shape, ms, vs_copy, **extra):
    return {
        "name": name,
        "shape": shape,
        "ms": ms,
        "gbps": 3000.0 * vs_copy / 0.7,
        "vs_copy": vs_copy,
        "copy_gbps": 4200.0,
        **extra,
    }


def _gqa(name, shape, ms, **extra):
    return {
        "name": name,
        "shape": shape,
        "fwd_ms": ms / 3,
        "ms": ms,
        "fwd_tflops": 100.0,
        "tflops": 300.0,
        **extra,
    }


# Rows as each script writes them (the keys of its JSON), with numbers chosen to hit every branch.
NATIVE = {
    "rms_norm": [
        _copy_row(
            "rms_norm fwd+bwd",
            "(65536, 4096) bfloat16",
            0.75,
            0.85,
            compile_ms=0.80,
            vs_compile=1.07,
        ),
        _copy_row("grouped_rms_norm fwd+bwd", "(16384, 4, 16+2, 192) bf16", 1.25, 0.38),
        _copy_row(
            "rms_norm_rope_e4m3 fwd",
            "(16384, 16, 256) bfloat16",
            0.1,
            0.62,
            composed_ms=0.31,
            vs_composed=3.1,
            bits_equal_composed=True,
        ),
    ],
    "clamped_swiglu": [
        _copy_row(
            "clamped_swiglu fwd+bwd",
            "(65536, 4096) bfloat16",
            1.0,
            1.02,
            compile_ms=0.95,
            vs_compile=0.95,
        ),
        {"name": "clamped_swiglu sweep", "shape": "(65536, 4096) bfloat16", "ms": 1.0},
    ],
    "region_bitmap": [
        _copy_row("pack_region_bitmap", "B1 G4 Q16384 slots513 R16384", 0.1, 0.45, reference_ms=6.0)
    ],
    "indexer_score": [
        {
            "name": "indexer_score_tile",
            "shape": "B1 Q128 G4 H4 D256 R16384",
            "ms": 0.05,
            "tflops": 340.0,
            "graph_ms": 0.037,
            "graph_tflops": 461.0,
            "host_us_per_call": 85.0,
            "gemm_ms": 0.04,
            "gemm_tflops": 432.0,
        },
    ],
    "stable_topk": [
        {
            "rows": 2048,
            "n": 16384,
            "k": 512,
            "triton_ms": 0.116,
            "torch_path_ms": 1.4,
            "torch_topk_ms": 0.48,
            "copy_ms": 0.07,
            "gluon_runs": True,
            "triton_kernel_ms": 0.131,
            "gbps": 1157.0,
        },
    ],
    "sparse_gqa": [
        _gqa("dense-causal-sdpa", "S32768-H64/4-D128", 110.0),
        _gqa("block-flex", "S32768-H64/4-D128", 40.0),
        _gqa("clustered-flex", "S32768-H64/4-D128", 55.0),
        _gqa("clustered-fa4", "S32768-H64/4-D128", 26.0),
        _gqa("clustered-auto", "S32768-H64/4-D128", 26.0, chose="fa4"),
        _gqa("scattered-gather", "S32768-H64/4-D128", 170.0),
        {"name": "sweep-gather-fwd", "shape": "S32768-H64/4-D128", "config": {}, "ms": 30.0},
        _gqa("dense-causal-sdpa", "S131072-H24/2-D256", 1770.0),
        _gqa("scattered-gather", "S131072-H24/2-D256", 440.0),
        _gqa("scattered-auto", "S131072-H24/2-D256", 150.0, chose="flex"),
    ],
    "sparse_region_attention": [
        _gqa("dense-causal-sdpa", "S32768-H64/4-D192-R8-k512", 120.0),
        _gqa("csa-gather", "S32768-H64/4-D192-R8-k512", 80.0),
        _gqa("csa-auto", "S32768-H64/4-D192-R8-k512", 80.5, chose="gather"),
        _gqa("short-docs-auto", "S32768-H64/4-D192-R8-k512", 60.0, chose="flex"),
        {
            "name": "sweep-gather-bwd",
            "shape": "S32768-H64/4-D192-R8-k512",
            "config": {},
            "ms": 50.0,
        },
        {
            "name": "breakdown",
            "shape": "S32768-H64/4-D192-R8-k512",
            "kernel": "forward",
            "ms": 20.0,
            "reads": "keys",
            "read_gb": 100.0,
            "tb_per_s": 5.0,
        },
        {
            "name": "breakdown",
            "shape": "S32768-H64/4-D192-R8-k512",
            "kernel": "backward, key-major dK/dV",
            "ms": 40.0,
            "reads": "selections",
            "read_gb": 200.0,
            "tb_per_s": 5.0,
        },
        {
            "name": "breakdown",
            "shape": "S32768-H64/4-D192-R8-k512",
            "kernel": "forward, other",
            "ms": 0.0,
        },
        {
            "name": "breakdown",
            "shape": "S32768-H64/4-D192-R8-k512",
            "kernel": "backward, other",
            "ms": 1.0,
        },
    ],
    "scatter_add": [
        {
            "mode": mode,
            "queries": 32768,
            "keys": 32768,
            "groups": 4,
            "width": 4096,
            "row": 256,
            "ms": ms,
            "t_elements_per_s": 1.0,
            **({"floor_ms_at_bench_32k": 133.8} if mode == "atomic-add" else {}),
        }
        for mode, ms in (("atomic-add", 142.6), ("store", 115.1), ("gather-load", 32.9))
    ],
    "sparse_mla": [
        {"name": "canonical_topk", "shape": "S4096", "ms": 0.4},
        {"name": "triton fwd kernel: portable", "shape": "S4096", "ms": 8.0, "tflops": 290.0},
        {
            "name": "triton fwd kernel: Gluon Hopper (vs portable)",
            "shape": "S4096",
            "ms": 5.9,
            "tflops": 396.0,
        },
        {"name": "triton fwd", "shape": "S4096", "ms": 5.9, "tflops": 396.0},
        {
            "name": "triton bwd (autograd: kernels+dsink)",
            "shape": "S4096",
            "ms": 25.5,
            "tflops": 229.0,
        },
    ],
    "qsa_indexer": [
        {
            "name": name,
            "shape": "B1-S32768",
            "ms": ms,
            "tflops": 5.0,
            "temp_mib": 154.0,
            "ratio_vs_oracle": 128.7 / ms,
            "same_rows": 0.99994,
            "beyond_near_ties": 0,
        }
        for name, ms in (("qsa_indexer_triton", 8.22), ("qsa_indexer_oracle", 128.7))
    ],
    "step5_indexer": [
        {
            "name": "region_metadata",
            "shape": "S=131072 docs=8",
            "ms": 2.2,
            "host_syncs": 1,
            "target_ms": 5.0,
        },
        {
            "name": "region_metadata (PyTorch ops)",
            "shape": "S=131072 docs=8",
            "ms": 3.1,
            "host_syncs": 1,
        },
    ]
    + [
        {
            "name": "indexer forward",
            "options": "threshold region_chunk=16384 budget=1073741824",
            "shape": f"S={s} G4 H4 D256 topk512",
            "ms": ms,
            "tflops": 250.0,
            "ideal_ms_at_300": ideal,
            "ratio_vs_ideal": ms / ideal,
            "peak_extra_gib": 1.39,
            "host_syncs": 0,
            "ratio_without_projections": without,
        }
        for s, ms, ideal, without in ((65536, 12.0, 7.30, 0.97), (131072, 33.8, 29.29, 0.86))
    ],
    "replay": [
        {
            "variant": v,
            "device": "cpu",
            "shape": [2, 512, 64, 4],
            "ms": ms,
            "router_calls_per_layer": c,
        }
        for v, ms, c in (
            ("no-checkpoint", 8.0, 1),
            ("checkpoint", 14.0, 2),
            ("checkpoint+replay", 12.0, 1),
        )
    ],
}


def test_every_benchmark_script_has_an_adapter_or_writes_record_rows():
    for name, script in SCRIPTS.items():
        source = script.read_text()
        assert name in bench_adapters.ADAPTERS or '"what"' in source or "what=" in source, name


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_adapters_read_only_keys_their_script_writes(name):
    """A renamed key in a script fails here, not on the GPU machine."""
    if name not in SCRIPTS:
        pytest.skip(f"no bench_{name}.py in this tree")
    script = SCRIPTS[name]
    # the script and the modules its folder shares between scripts (those not named bench_*)
    shared = [p for p in sorted(script.parent.glob("*.py")) if not p.name.startswith("bench_")]
    source = "".join(p.read_text() for p in [script, *shared])
    for row in NATIVE[name]:
        for key in row:
            assert f'"{key}"' in source or f"{key}=" in source, f"bench_{name}.py writes no {key!r}"


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_each_script_s_rows_become_valid_record_files(name, tmp_path):
    areas = bench_adapters.records(name, NATIVE[name])
    assert areas and all(areas.values())
    env = dict.fromkeys(bench_records.ENVIRONMENT_KEYS)
    written = bench_records.write_records(tmp_path, name, f"python bench_{name}.py", env, areas)
    assert sorted(p.stem for p in written) == sorted(areas)


def _statuses(name):
    return {
        (r["what"], r["shape"], r["baseline"]): r.get("status")
        for rows in bench_adapters.records(name, NATIVE[name]).values()
        for r in rows
    }


def test_sparse_gqa_goals_are_judged_and_the_closed_one_says_so():
    areas = bench_adapters.records("sparse_gqa", NATIVE["sparse_gqa"])
    assert sorted(areas) == ["sparse_gqa_clustered", "sparse_gqa_scattered"]
    flex = [
        r for r in areas["sparse_gqa_clustered"] if r["what"] == "clustered routes, flex, fwd+bwd"
    ]
    assert flex[0]["ratio"] == pytest.approx(40 / 55, abs=1e-3) and flex[0]["status"] == "not met"
    clustered = areas["sparse_gqa_clustered"]
    fa4 = [r for r in clustered if re.match(r"clustered routes, fa4.*fwd\+bwd", r["what"])]
    # auto chose fa4, measured in the same run: its row is folded into fa4's, not repeated
    assert [r["what"] for r in fa4] == ["clustered routes, fa4 (auto's choice), fwd+bwd"]
    assert fa4[0]["status"] == "met"
    # at 128k auto's choice (flex) was not measured on its own: its row stays, saying what it chose
    assert [r["what"] for r in areas["sparse_gqa_scattered"] if "auto" in r["what"]] == [
        "scattered routes, auto (chose flex), fwd+bwd"
    ]
    scattered = {r["shape"]: r for r in areas["sparse_gqa_scattered"] if r.get("goal")}
    assert scattered["S32768 Hq64/Hkv4 D128, per-group routes, bf16"]["status"].startswith(
        "closed by decision"
    )
    assert scattered["S131072 Hq24/Hkv2 D256, shared route, bf16"]["status"] == "met"
    assert not any("sweep" in r["what"] for rows in areas.values() for r in rows)


def test_step5_goal_at_64k_is_read_as_decided_and_128k_plainly():
    rows = bench_adapters.records("step5_indexer", NATIVE["step5_indexer"])["step5_indexer"]
    by_shape = {r["shape"].split()[0]: r for r in rows if r["what"] == "Step-5 indexer forward"}
    assert by_shape["S65536"]["status"].startswith("closed by decision: met as read (0.97×")
    assert by_shape["S131072"]["status"].startswith("met (1.15× the ideal")
    assert by_shape["S131072"]["ratio"] == pytest.approx(29.29 / 33.8, abs=1e-3)
    slow = [
        {**r, "ratio_without_projections": 1.4} if r.get("options") else r
        for r in NATIVE["step5_indexer"]
    ]
    rows = bench_adapters.records("step5_indexer", slow)["step5_indexer"]
    assert "closed by decision: not met as read" in rows[1]["status"]


def test_throughput_and_ratio_goals_fail_when_the_numbers_do():
    assert (
        _statuses("region_bitmap")[
            (
                "pack_region_bitmap",
                "B1 G4 Q16384 slots513 R16384",
                "device copy of the same bytes (4200 GB/s)",
            )
        ]
        == "not met"
    )
    swiglu = _statuses("clamped_swiglu")
    compile_key = (
        "clamped_swiglu forward+backward",
        "(65536, 4096) bfloat16",
        "torch.compile of the reference",
    )
    assert swiglu[compile_key] == "not met"
    mla = bench_adapters.records("sparse_mla", NATIVE["sparse_mla"])
    backward = next(r for r in mla["sparse_mla"] if "backward" in r["what"])
    assert backward["status"] == "not met" and backward["baseline"] is None
    assert "sparse_mla_fused" not in mla  # without the fused runtimes their file stays as it is


def test_region_attention_rows_are_judged_against_dense_of_their_shape():
    rows = bench_adapters.records("sparse_region_attention", NATIVE["sparse_region_attention"])
    rows = rows["sparse_region_attention"]
    # csa's auto row folds into the gather row it chose; short-docs' choice was not measured alone
    assert [r["what"] for r in rows] == [
        "dense causal SDPA, K/V expanded, fwd+bwd",
        "csa selection, gather (auto's choice), fwd+bwd",
        "short-docs selection, auto (chose flex), fwd+bwd",
        "csa gather kernel: forward",
        "csa gather kernel: backward, key-major dK/dV",
        "csa gather kernel: backward, other",
    ]  # the zero-time "forward, other" left out
    assert rows[1]["ratio"] == 1.5 and rows[2]["ratio"] == 2.0
    assert rows[3]["throughput"] == "5.00 TB/s of K/V rows (100 GB)" and rows[3]["baseline"] is None
    assert rows[4]["throughput"] == "5.00 TB/s of Q/dO rows (200 GB)"
    assert "throughput" not in rows[5]


@pytest.mark.parametrize("gpu", ["NVIDIA H200", None], ids=["gpu-run", "gpu-less-run"])
def test_records_from_a_saved_run_follow_its_rows_and_stay_out_of_the_record_when_gpu_less(
    tmp_path, monkeypatch, gpu
):
    env = {**dict.fromkeys(bench_records.ENVIRONMENT_KEYS), "gpu": gpu, "commit": "abc1234"}
    run = {
        "environment": env,
        "tests": [],
        "benchmarks": [
            {
                "benchmark": "sparse_gqa",
                "command": "python packages/sa-kernels/benchmarks/bench_sparse_gqa.py --long",
                "returncode": 0,
                "rows": NATIVE["sparse_gqa"],
            },
            {"benchmark": "rms_norm", "command": "python x.py", "returncode": 1, "rows": []},
        ],
    }
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(run))
    record, quick = tmp_path / "record", tmp_path / "quick"
    monkeypatch.setattr(gpu_tests, "RESULTS", record)
    monkeypatch.setattr(gpu_tests, "QUICK_RESULTS", quick)
    assert gpu_tests.rewrite_records(str(saved), None) == 0
    folder = record if gpu else quick
    assert sorted(p.name for p in folder.iterdir()) == [
        "sparse_gqa_clustered.json",
        "sparse_gqa_scattered.json",
    ]
    written = json.loads((folder / "sparse_gqa_clustered.json").read_text())
    assert written["environment"]["commit"] == "abc1234"
    assert (
        written["rows"]
        == bench_adapters.records("sparse_gqa", NATIVE["sparse_gqa"])["sparse_gqa_clustered"]
    )
    assert not (quick if gpu else record).exists()


def test_a_script_without_adapter_must_write_record_rows():
    rows = [bench_records.row("layer fwd", "S8", 1.0, "dense", 2.0)]
    assert bench_adapters.records("qsa_layer", rows) == {"qsa_layer": rows}
    with pytest.raises(ValueError, match=r"bench_unknown\.py's rows are not record rows"):
        bench_adapters.records("unknown", [{"name": "x", "ms": 1.0}])


def test_gpu_tests_dry_run_lists_every_benchmark_with_its_record_arguments():
    done = subprocess.run(
        [sys.executable, "tools/gpu_tests.py", "--no-tests", "--bench", "all", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    listed = re.findall(r"bench_(\w+)\.py", done.stdout)
    assert sorted(listed) == sorted(SCRIPTS)
    assert "bench_sparse_gqa.py --long" in done.stdout
    assert done.stdout.rstrip().endswith("docs/results")


_SUITE = """
def test_a():
    pass

def test_b():
    assert 1 + 1 == 3, "b's own message"

def test_c():
    pass

def test_d():
    pass
"""

_RUN_PLUGIN = """
import json, sys
sys.path.insert(0, sys.argv[1])
import pytest, gpu_tests
passed = gpu_tests.passed_tests(sys.argv[4:])
plugin = gpu_tests._Outcomes((int(sys.argv[3]), 2), lambda records: None, passed)
pytest.main([sys.argv[2], "-q", "-p", "no:cacheprovider"], plugins=[plugin])
print("RECORDS " + json.dumps(plugin.records))
"""


@pytest.mark.parametrize("part", [1, 2])
def test_gpu_tests_leave_out_what_an_earlier_run_passed_and_keep_failure_messages(tmp_path, part):
    """An earlier run passed test_a and failed test_b: the next run, in two parts, splits the whole
    collection as any run does (a, c | b, d), leaves a out and runs b, c and d once between its
    parts; a failure's record carries the end of its report."""
    suite = tmp_path / "test_suite.py"
    suite.write_text(_SUITE)
    earlier = tmp_path / "earlier.json"
    ids = [f"test_suite.py::test_{name}" for name in "abcd"]
    earlier.write_text(
        json.dumps(
            {
                "tests": [
                    {"test": ids[0], "outcome": "passed"},
                    {"test": ids[1], "outcome": "failed"},
                ]
            }
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN_PLUGIN,
            str(ROOT / "tools"),
            str(suite),
            str(part),
            str(earlier),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    records = json.loads(done.stdout.split("RECORDS ", 1)[1])
    expected = {1: [ids[2]], 2: [ids[1], ids[3]]}[part]
    assert [r["test"] for r in records] == expected, done.stdout
    for record in records:
        failed = record["test"] == ids[1]
        assert record["outcome"] == ("failed" if failed else "passed")
        assert ("b's own message" in record.get("message", "")) == failed


def test_gpu_tests_count_a_test_as_passed_only_without_a_failed_record(tmp_path):
    """A passing call followed by a teardown error leaves two records: the test runs again."""
    earlier = tmp_path / "earlier.json"
    records = [
        {"test": "t.py::test_a", "outcome": "passed"},
        {"test": "t.py::test_b", "outcome": "passed"},
        {"test": "t.py::test_b", "outcome": "failed"},
        {"test": "t.py::test_c", "outcome": "skipped"},
    ]
    earlier.write_text(json.dumps({"tests": records}))
    assert gpu_tests.passed_tests([str(earlier)]) == {"t.py::test_a"}


def test_gpu_tests_refuse_to_overwrite_the_file_they_skip_from(tmp_path):
    earlier = tmp_path / "run.json"
    earlier.write_text(json.dumps({"tests": []}))
    done = subprocess.run(
        [
            sys.executable,
            "tools/gpu_tests.py",
            "--skip-passed",
            str(earlier),
            "--json",
            str(earlier),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "is also this run's --json" in done.stderr
