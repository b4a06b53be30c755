"""tools/cp_parity.py and bench_cp_scaling.py as the GPU machine runs them, on 2 gloo CPU ranks
(torchrun) at tiny sizes: the parity report passes for both models on plain and packed rows, a CP
run that sees a wrong shard fails it, and the scaling benchmark's smoke run writes record rows
whose ratios are the efficiency against one rank."""

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PARITY = ROOT / "tools" / "cp_parity.py"
SCALING = ROOT / "packages" / "sa-layers" / "benchmarks" / "bench_cp_scaling.py"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(SCALING.parent))  # the scripts' own folder, as when they run as scripts
import bench_records  # noqa: E402


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _torchrun(script: Path, *args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-port",
        str(_free_port()),
        str(script),
        *args,
    ]
    return subprocess.run(
        command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240, check=False
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cp_parity_passes_for_both_models_plain_and_packed_and_fsdp2_2ranks(tmp_path):
    report_path = tmp_path / "parity.json"
    done = _torchrun(
        PARITY,
        *("--device", "cpu", "--backend", "gloo", "--tokens", "64", "--packed"),
        *("--fsdp-dp", "1", "--steps", "2", "--json", str(report_path)),
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["world_size"] == 2 and report["dtype"] == "float32"
    assert "PASS" in done.stdout
    checks = report["checks"]
    assert all(c["pass"] for c in checks)
    for model in ("step5", "qsa"):
        for batch in ("plain", "packed"):
            names = [c["check"] for c in checks if c["model"] == model and c["batch"] == batch]
            assert names[:3] == ["logits", "loss", "indexer loss"], names
            assert any(n.startswith("grads (") for n in names)
            assert any(n.startswith("worst grad") for n in names)
            assert any(n.startswith("FSDP2 dp 1 × cp 2, 2 steps") for n in names)
            routes = next(
                c
                for c in checks
                if c["model"] == model and c["batch"] == batch and c["check"] == "routes"
            )
            assert routes["rows"] > 0 and routes["differ"] == 0
    # the comparison saw real sharding: FP32 noise, not bit-equality everywhere
    assert any(c.get("max_abs", 0.0) > 0.0 for c in checks)
    training = [c for c in checks if c["check"].startswith("FSDP2")]
    assert all(len(c["losses"]) == len(c["reference_losses"]) == 2 for c in training)


def _one_rank(monkeypatch) -> None:
    """The environment torchrun gives a world of one rank (the script then runs in this process)."""
    for name, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1"
    ).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))


def test_cp_parity_fails_when_the_cp_run_sees_a_wrong_shard(tmp_path, monkeypatch):
    """One rank in this process: the CP run (a group of one rank) gets one token changed, which
    the logits, loss and gradient checks must catch."""
    parity = _load(PARITY)
    honest = parity.cpm.run

    def tampered(kind, model, batch, shard=(0, 1), group=None):
        if group is not None:
            ids = batch.input_ids.clone()
            ids[0, -1] = (ids[0, -1] + 1) % parity.cpm.config(kind, "tiny").vocab_size
            batch = parity.cpm.Batch(
                ids, batch.labels, batch.positions, batch.padding, batch.cu_seqlens
            )
        return honest(kind, model, batch, shard, group)

    monkeypatch.setattr(parity.cpm, "run", tampered)
    _one_rank(monkeypatch)
    report_path = tmp_path / "parity.json"
    code = parity.main(
        ["--device", "cpu", "--tokens", "32", "--model", "qsa", "--json", str(report_path)]
    )
    report = json.loads(report_path.read_text())
    assert code == 1 and not report["passed"]
    failed = {c["check"] for c in report["checks"] if not c["pass"]}
    assert {"logits", "loss"} <= failed
    assert any(name.startswith("grads (") for name in failed)


def test_cp_parity_trains_a_bf16_model_under_fsdp2_with_its_fp32_weights_kept_whole(
    tmp_path, monkeypatch
):
    """BF16 models keep FP32 norms and indexer weights, which one FSDP2 group cannot hold with the
    BF16 ones (the GPU configuration): they stay whole, their gradients averaged by hand."""
    parity = _load(PARITY)
    _one_rank(monkeypatch)
    report_path = tmp_path / "parity.json"
    args = ["--device", "cpu", "--dtype", "bf16", "--tokens", "32", "--model", "step5"]
    code = parity.main([*args, "--fsdp-dp", "1", "--steps", "2", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert code == 0 and report["passed"] and report["dtype"] == "bfloat16"
    (training,) = [c for c in report["checks"] if c["check"].startswith("FSDP2 dp 1 × cp 1")]
    assert training["losses"][1] != training["losses"][0]  # the step moved the weights


def test_bench_cp_scaling_smoke_writes_record_rows_with_efficiency_2ranks(tmp_path):
    rows_path = tmp_path / "cp_scaling.json"
    done = _torchrun(SCALING, "--smoke", "--json", str(rows_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = json.loads(rows_path.read_text())
    record = {
        "benchmark": "cp_scaling",
        "command": "torchrun --nproc-per-node 2 bench_cp_scaling.py --smoke",
        "environment": dict.fromkeys(bench_records.ENVIRONMENT_KEYS),
        "rows": rows,
    }
    assert bench_records.check_record(record) == []
    kinds = ("Step5Model", "QSAModel")
    for kind in kinds:
        for mode in ("weak", "strong"):
            (row,) = [r for r in rows if kind in r["what"] and f"{mode} scaling" in r["what"]]
            assert row["what"].endswith("CP over 2 CPU ranks")
            # the baseline: rank 0 alone, measured in the same job
            assert row["baseline"].startswith("1 CPU rank on")
            assert row["time_ms"] > 0 and row["ratio"] > 0
            # the collectives of the profiled step were found
            assert float(re.search(r"comm (\d+\.\d) ms", row["throughput"])[1]) > 0


def test_bench_cp_scaling_reads_the_baseline_of_a_one_rank_run(tmp_path):
    bench = _load(SCALING)
    _, args = bench.parse_args(["--smoke"])
    device = torch.device("cpu")
    one = bench.Measured(ms=40.0, comm_ms=None, peak_gib=None)
    rows = [
        bench.make_row(args, "step5", "weak", 1, 32, one, None, device),
        bench.make_row(args, "qsa", "strong", 1, 64, one, None, device),
    ]
    assert all(r["ratio"] is None and r["baseline"] is None for r in rows)
    path = tmp_path / "one.json"
    path.write_text(json.dumps(rows))
    baselines = bench.baseline_times(str(path))
    assert baselines == {
        (bench.cpm.LABELS["step5"], 32): 40.0,
        (bench.cpm.LABELS["qsa"], 64): 40.0,
    }
    two = bench.Measured(ms=50.0, comm_ms=5.0, peak_gib=None)
    weak = bench.make_row(args, "step5", "weak", 2, 64, two, 40.0, device)
    strong = bench.make_row(args, "qsa", "strong", 2, 64, two, 40.0, device)
    assert weak["ratio"] == pytest.approx(40.0 / 50.0, abs=1e-3)  # T_1 / T_N
    assert strong["ratio"] == pytest.approx(40.0 / (2 * 50.0), abs=1e-3)  # T_1 / (N · T_N)
    assert "comm 5.0 ms (10 % of the step)" in weak["throughput"]
