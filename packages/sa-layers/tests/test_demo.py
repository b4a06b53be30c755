"""The demo CLI: runs end to end, is deterministic on CPU, refuses bad options in one line."""

import json
import subprocess
import sys

import pytest

from sa_layers.demo import main
from sa_layers.demo.task import RetrievalTask

SMALL = ["--seq-len", "128", "--steps", "12", "3", "2", "--no-progress"]


def test_demo_runs_all_stages_and_is_deterministic_for_a_seed(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        assert main([*SMALL, "--out", str(tmp_path / name)]) == 0
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
    assert done.stderr.strip() == "sa-demo: --model must be one of qsa, step5; got 'gpt'"


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
