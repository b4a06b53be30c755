"""Turn a CUDA run of the demo (`sa-demo --device cuda`) into the record file docs/results/demo_cuda.json.

    python -m sa_layers.demo --device cuda [--model step5|qsa] --out OUT
    python tools/demo_record.py OUT/metrics.json [--commit SHA] [--results docs/results]

Rows: the sparse model after each stage against the dense model of the same run (training step
time from the stage's tokens/s; answer accuracy and routing recall in the throughput column).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from bench_records import environment, row, write_records

ROOT = Path(__file__).resolve().parent.parent
RECALL_GOAL = 0.9
_LAYER = {"qsa": "QSA", "step5": "Step-5 CSA"}


def rows_of(metrics: dict) -> list[dict]:
    settings, stages = metrics["settings"], metrics["stages"]
    tokens = settings["batch"] * settings["seq_len"]
    dense_ms = 1e3 * tokens / stages["dense"]["tokens_per_s"]
    shape = (
        f"{settings['batch']} × {settings['seq_len']} tokens, hidden {settings['hidden']}, "
        f"{settings['layers']} {_LAYER.get(settings.get('model', 'qsa'), 'routed')} layer, "
        f"budget {settings['budget']}"
    )
    out = []
    for stage, label in (("warmup", "after indexer warm-up"), ("sparse", "after sparse training")):
        m = stages[stage]
        ok = m["recall"] >= RECALL_GOAL
        out.append(
            row(
                f"demo: sparse model {label} (train step)",
                shape,
                1e3 * tokens / m["tokens_per_s"],
                f"dense model's train step (accuracy {stages['dense']['accuracy']:.2f})",
                dense_ms,
                throughput=(
                    f"accuracy {m['accuracy']:.2f}, routing recall {m['recall']:.2f} (random "
                    f"indexer {stages['random_indexer']['recall']:.2f}), keys {m['key_fraction']:.2f}"
                ),
                goal=f"recall ≥ {RECALL_GOAL}" if stage == "sparse" else None,
                status=("met" if ok else "not met") if stage == "sparse" else None,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics")
    parser.add_argument("--commit")
    parser.add_argument("--results", default=str(ROOT / "docs" / "results"))
    args = parser.parse_args()
    metrics = json.loads(Path(args.metrics).read_text())
    s = metrics["settings"]
    command = shlex.join(
        [
            "python",
            "-m",
            "sa_layers.demo",
            "--device",
            "cuda",
            "--seq-len",
            str(s["seq_len"]),
            "--steps",
            *map(str, s["steps"]),
        ]
    )
    env = environment(ROOT, args.commit)
    print(write_records(Path(args.results), "demo", command, env, {"demo_cuda": rows_of(metrics)}))


if __name__ == "__main__":
    main()
