"""`sa-demo`: train a small sparse-attention model on a long-context retrieval task (CPU or CUDA).

    uv run --extra plots sa-demo [--model step5|qsa] [--seq-len N] [--steps DENSE WARMUP SPARSE]
        [--device cpu|cuda] [--seed N] [--out DIR]

A one-layer Step-5 (CSA regions, the default) or QSA (compressed blocks) model on the retrieval task
(`task.py`); stages: dense training, indexer warm-up by distillation, sparse training (`train.py`).
Prints a progress bar and a summary table (dense vs sparse attention: answer accuracy, the answer
query's routing recall, attended keys, attention FLOPs, tokens/s); writes `metrics.json`,
`loss.png`, `recall.png` and `routes.png` into `--out` (plots need matplotlib: the `plots` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .models import MODELS
from .report import summary_rows, write_plots
from .train import DemoSettings, run


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and status 2, never a traceback
        self.exit(2, f"sa-demo: {message}\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="sa-demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=next(iter(MODELS)),
        help="step5 (a CSA layer routing regions per KV group) or qsa (compressed blocks)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default 512 on CPU, 4096 on CUDA)",
    )
    parser.add_argument(
        "--steps", type=int, nargs=3, metavar=("DENSE", "WARMUP", "SPARSE"), default=None
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="sa-demo-out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    args = parser.parse_args(argv)
    if args.model not in MODELS:
        parser.error(f"--model must be one of {', '.join(MODELS)}; got {args.model!r}")
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda; got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    cuda = args.device == "cuda"
    if args.seq_len is None:
        args.seq_len = 4096 if cuda else 512
    if args.seq_len < 128 or args.seq_len % 4:
        parser.error(f"--seq-len must be a multiple of 4 and >= 128; got {args.seq_len}")
    if args.steps is None:
        args.steps = [600, 150, 100] if cuda else [240, 60, 40]
    if min(args.steps) < 1:
        parser.error(f"--steps must be positive; got {args.steps}")
    return args


def settings_of(args: argparse.Namespace) -> DemoSettings:
    cuda = args.device == "cuda"
    return DemoSettings(
        model=args.model,
        seq_len=args.seq_len,
        steps=tuple(args.steps),
        device=args.device,
        seed=args.seed,
        hidden=128 if cuda else 64,
        budget=max(64, args.seq_len // 8),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    settings = settings_of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if settings.device == "cpu":
        torch.use_deterministic_algorithms(True)
    total = sum(settings.steps)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="dense", unit="step", dynamic_ncols=True)
    last_eval: dict = {}

    def on_step(stage: str, record: dict) -> None:
        if "accuracy" in record:
            last_eval.update(accuracy=record["accuracy"], recall=record["recall"])
        if bar is not None:
            bar.set_description(stage)
            loss = record["lm_loss"] if stage != "warmup" else record["indexer_loss"]
            post = {"loss": f"{loss:.3f}"}
            if last_eval:
                post["acc"] = f"{last_eval['accuracy']:.2f}"
                if last_eval["recall"] is not None:
                    post["recall"] = f"{last_eval['recall']:.2f}"
            bar.set_postfix(post)
            bar.update(1)

    metrics = run(settings, on_step=on_step)
    if bar is not None:
        bar.close()
    models = metrics.pop("models")
    units = metrics["stages"]["sparse"]["_units"]
    for record in metrics["stages"].values():
        record.pop("_units", None)
    metrics["summary"] = summary_rows(metrics, settings)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print_summary(metrics["summary"])
    written = write_plots(metrics, units, settings, out)
    if written is None:
        print(
            "plots skipped: matplotlib is not installed (uv run --extra plots sa-demo, or pip install matplotlib)"
        )
    print(
        f"wrote {out / 'metrics.json'}"
        + ("" if written is None else ", " + ", ".join(map(str, written)))
    )
    del models
    return 0


def print_summary(rows: list[dict]) -> None:
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(str(r[k]).ljust(widths[k]) for k in keys))


if __name__ == "__main__":
    sys.exit(main())
