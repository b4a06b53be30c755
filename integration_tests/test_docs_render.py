"""docs/benchmarks.md is the rendering of docs/results/*.json; the records keep their schema; the
README quotes only figures the records hold."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"


sys.path.insert(0, str(ROOT / "tools"))
import bench_records  # noqa: E402
import render_benchmarks  # noqa: E402

RECORD_FILES = sorted(RESULTS.glob("*.json"))


def test_benchmarks_page_is_the_rendering_of_the_checked_in_records():
    rendered = render_benchmarks.render(RESULTS)
    assert PAGE.read_text() == rendered, (
        "docs/benchmarks.md differs from docs/results/*.json: run python tools/render_benchmarks.py"
    )


def test_benchmarks_page_stays_under_400_lines():
    assert len(PAGE.read_text().splitlines()) < 400


@pytest.mark.parametrize("path", RECORD_FILES, ids=[p.stem for p in RECORD_FILES])
def test_every_record_file_keeps_the_schema(path):
    assert bench_records.check_record(json.loads(path.read_text())) == []


def test_schema_check_catches_a_ratio_that_is_not_baseline_over_time():
    record = json.loads((RESULTS / "sparse_gqa_scattered.json").read_text())
    record["rows"][1]["ratio"] *= 1.5
    assert any("not baseline_ms / time_ms" in p for p in bench_records.check_record(record))
    del record["rows"][0]["shape"]
    assert any("missing ['shape']" in p for p in bench_records.check_record(record))


def test_rendering_needs_no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises
    assert render_benchmarks.render(RESULTS) == PAGE.read_text()


def test_a_new_record_file_gets_its_own_section_and_goal_row(tmp_path):
    for path in RECORD_FILES:
        shutil.copy(path, tmp_path)
    record = {
        "benchmark": "qsa_layer",
        "command": "python packages/sa-layers/benchmarks/bench_qsa_layer.py",
        "environment": dict.fromkeys(bench_records.ENVIRONMENT_KEYS),
        "rows": [
            bench_records.row(
                "QSA layer fwd+bwd",
                "S32768 toy",
                12.5,
                "dense layer",
                25.0,
                goal="≥ 1.5×",
                status="met",
            )
        ],
    }
    assert bench_records.check_record(record) == []
    (tmp_path / "qsa_layer.json").write_text(json.dumps(record))
    (tmp_path / "zz_later.json").write_text(json.dumps({**record, "benchmark": "zz_later"}))
    text = render_benchmarks.render(tmp_path)
    assert "## QSA attention layer" in text and "## zz later" in text
    assert text.index("## QSA attention layer") < text.index("## zz later")
    assert (
        "| QSA layer fwd+bwd | S32768 toy | 12.5 | – | dense layer | 25 | 2.00× | ≥ 1.5× | met |"
        in text
    )
    assert "[QSA attention layer](#qsa-attention-layer) | QSA layer fwd+bwd" in text


def test_every_plot_the_page_shows_is_checked_in():
    plots = re.findall(r"\]\(img/([^)]+)\)", PAGE.read_text())
    assert plots, "the page shows the sparse GQA speed-up plot"
    for plot in plots:
        assert (ROOT / "docs" / "img" / plot).is_file(), plot


def test_goals_closed_by_decision_are_recorded_as_such():
    step5 = json.loads((RESULTS / "step5_indexer.json").read_text())["rows"]
    at_64k = [r for r in step5 if r["shape"].startswith("S65536") and r.get("goal")]
    assert at_64k and at_64k[0]["status"].startswith("closed by decision")
    scattered = json.loads((RESULTS / "sparse_gqa_scattered.json").read_text())["rows"]
    d128_32k = [r for r in scattered if r["shape"].startswith("S32768 Hq64") and r.get("goal")]
    assert d128_32k and d128_32k[0]["status"].startswith("closed by decision")
    assert "closed by decision" in PAGE.read_text().split("## Goals")[1].split("\n## ")[0]


def _figures_in_records() -> dict[str, set[float]]:
    """Every number the records hold, by unit: ms, ×, TFLOP/s, GB/s, GiB."""
    found: dict[str, set[float]] = {"ms": set(), "×": set(), "TFLOP/s": set(), "GB/s": set()}
    units = "|".join(re.escape(u) for u in found)
    for path in RECORD_FILES:
        for row in json.loads(path.read_text())["rows"]:
            found["ms"].update(v for v in (row["time_ms"], row["baseline_ms"]) if v is not None)
            if row["ratio"] is not None:
                found["×"].add(row["ratio"])
            text = " ".join(str(v) for v in row.values() if isinstance(v, str))
            for number, unit in re.findall(rf"(\d+(?:\.\d+)?) ?({units})", text):
                found[unit].add(float(number))
    return found


def _matches(number: str, values: set[float]) -> bool:
    decimals = len(number.split(".")[1]) if "." in number else 0
    return any(round(v, decimals) == float(number) for v in values)


def test_readme_figures_come_from_the_records():
    prose = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    records = _figures_in_records()
    quoted = re.findall(
        r"(\d+(?:\.\d+)?)(?:–(\d+(?:\.\d+)?))?( ?ms\b|×(?!\d)| TFLOP/s| GB/s)", prose
    )
    assert len(quoted) >= 8, "the README quotes the current figures"
    for low, high, unit in quoted:
        values = records[unit.strip()]
        for number in filter(None, (low, high)):
            assert _matches(number, values), f"README quotes {number}{unit}, not in docs/results"
