"""The demo CLI: runs end to end, is deterministic on CPU, refuses bad options in one line."""

import json
import subprocess
import sys

import pytest
import torch

from sa_layers.demo import main
from sa_layers.demo.models import Geometry, QSADemo, Step5Demo
from sa_layers.demo.task import RetrievalTask
from sa_routing import RegionSelection

SMALL = ["--seq-len", "128", "--steps", "12", "3", "2", "--no-progress"]


@pytest.mark.parametrize("model", ["step5", "qsa"])
def test_demo_runs_all_stages_and_is_deterministic_for_a_seed(model, tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        assert main([*SMALL, "--model", model, "--out", str(tmp_path / name)]) == 0
        runs.append(json.loads((tmp_path / name / "metrics.json").read_text()))
    out = capsys.readouterr().out
    assert "sparse, after sparse training" in out and "routing recall" in out
    assert runs[0]["history"] == runs[1]["history"]
    stages = runs[0]["stages"]
    assert set(stages) == {"dense", "random_indexer", "warmup", "sparse"}
    assert stages["dense"]["recall"] is None and 0 <= stages["sparse"]["recall"] <= 1
    assert 0 < stages["sparse"]["key_fraction"] < 1  # the routed model attends to fewer keys
    assert [r["stage"] for r in runs[0]["history"]["steps"]] == ["dense"] * 12 + ["warmup"] * 3 + [
        "sparse"
    ] * 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt"], "--model must be one of"),
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--seq-len", "100"], "--seq-len must be a multiple of 4 and >= 128"),
        (["--steps", "1", "0", "1"], "--steps must be positive"),
        (["--seq-len", "abc"], "invalid int value"),
    ],
    ids=["model", "device", "seq-len", "steps", "not-an-int"],
)
def test_bad_options_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_python_m_entry_point_exits_2_without_a_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "sa_layers.demo", "--model", "gpt"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "sa-demo: --model must be one of step5, qsa; got 'gpt'"


def test_retrieval_task_places_one_needle_before_the_questions_and_labels_only_them():
    task = RetrievalTask(64, seed=3)
    batch = task.sample(8)
    rows = range(8)
    facts = (batch.input_ids >= 32) & (batch.input_ids < 32 + 64)
    assert facts.sum(1).eq(1).all() and (batch.needles < 64 - task.questions).all()
    assert all(facts[r, batch.needles[r]] for r in rows)
    value = (batch.input_ids[list(rows), batch.needles] - 32) % 8
    assert (batch.answers == RetrievalTask.answer(value)).all()
    assert (batch.labels[:, -task.questions :] == batch.answers[:, None]).all()
    assert (batch.labels[:, : -task.questions] == -100).all()


def test_retrieval_task_spans_fill_aligned_blocks_with_the_fact():
    task = RetrievalTask(64, seed=5, span=4)
    batch = task.sample(6)
    assert (batch.needles % 4 == 0).all()
    for r in range(6):
        block = batch.input_ids[r, batch.needles[r] : batch.needles[r] + 4]
        assert (block == block[0]).all() and 32 <= block[0] < 32 + 64
    facts = (batch.input_ids >= 32) & (batch.input_ids < 32 + 64)
    assert facts.sum(1).eq(4).all()


def test_qsa_answer_routes_count_the_needle_token_and_the_routed_pairs():
    demo = QSADemo(Geometry(hidden=16, layers=1, unit=4, budget=8))
    length = 16
    ids = torch.full((2, length, 11), -1, dtype=torch.int32)
    for q in range(length):  # every query routes to itself only
        ids[:, q, 0] = q
    ids[0, -1, :3] = torch.tensor([4, 5, 15])  # example 0's answer query: tokens 4, 5 and itself
    routes = demo.answer_routes([ids], torch.tensor([5, 9]), length)
    assert routes.recall == 0.5  # token 5 is routed for example 0, token 9 is not for example 1
    # one key per query, two more for example 0: (16 + 18) / 2 pairs per row
    assert routes.key_fraction == pytest.approx((length + 2 / 2) / (length * (length + 1) / 2))
    assert routes.units[0].tolist() == [0, 1, 0, 1] and routes.units[1].tolist() == [0, 0, 0, 1]


def test_step5_answer_routes_count_the_needle_region_per_group_and_visible_keys():
    demo = Step5Demo(Geometry(hidden=16, layers=1, unit=4, budget=4))
    length, regions = 16, 4
    ids = torch.full((1, 2, length, 2), regions, dtype=torch.int32)  # topk 1 + current
    ids[..., 0] = torch.arange(length) // 4  # every query: its current region only
    ids[0, 0, -1] = torch.tensor([1, 3])  # group 0's answer query: region 1 and its own
    ids[0, 1, -1] = torch.tensor([2, 3])  # group 1's: region 2 and its own
    routes = demo.answer_routes([RegionSelection(ids, regions)], torch.tensor([6]), length)
    assert routes.recall == 0.5  # the needle (token 6) lies in region 1: group 0 only
    causal_own = sum(q % 4 + 1 for q in range(length))  # the current region's visible keys
    assert routes.key_fraction == pytest.approx((causal_own + 4) / (length * (length + 1) / 2))
    assert routes.units[0].tolist() == [0, 0.5, 0.5, 1]
