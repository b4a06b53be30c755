"""The demo's summary table and plots (matplotlib is optional: the `plots` extra)."""

from __future__ import annotations

from pathlib import Path

import torch

from .train import DemoSettings, attention_flops


def summary_rows(metrics: dict, settings: DemoSettings) -> list[dict]:
    """Dense vs sparse attention: accuracy, routing recall, attended keys, attention FLOPs, tokens/s."""
    stages = metrics["stages"]
    rows = []
    for label, stage in (
        ("dense attention", "dense"),
        ("sparse, random indexer", "random_indexer"),
        ("sparse, after warm-up", "warmup"),
        ("sparse, after sparse training", "sparse"),
    ):
        m = stages[stage]
        rows.append(
            {
                "model": label,
                "answer accuracy": f"{m['accuracy']:.3f}",
                "routing recall": "—" if m["recall"] is None else f"{m['recall']:.3f}",
                "attended keys": f"{m['key_fraction']:.3f}",
                "attention GFLOP/seq": f"{attention_flops(settings, m['key_fraction']) / 1e9:.3f}",
                "train tokens/s": "—" if "tokens_per_s" not in m else f"{m['tokens_per_s']:,.0f}",
            }
        )
    return rows


def write_plots(metrics: dict, units: torch.Tensor | None, settings: DemoSettings, out: Path):
    """loss.png, recall.png, routes.png in `out`; None when matplotlib is missing.

    units: float [batch, units], the sparse model's answer-query selections (`Evaluation.units`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps, evals = metrics["history"]["steps"], metrics["history"]["evals"]
    written = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for stage, key in (("dense", "lm_loss"), ("warmup", "indexer_loss"), ("sparse", "lm_loss")):
        xs = [r["step"] for r in steps if r["stage"] == stage]
        ys = [r[key] for r in steps if r["stage"] == stage]
        ax.plot(xs, ys, label=f"{stage} ({key.replace('_', ' ')})")
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="training losses")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    written.append(out / "loss.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    routed = [r for r in evals if r["recall"] is not None]
    ax.plot(
        [r["step"] for r in routed], [r["recall"] for r in routed], "o-", label="routing recall"
    )
    ax.plot(
        [r["step"] for r in evals], [r["accuracy"] for r in evals], "s-", label="answer accuracy"
    )
    chance = settings.budget / settings.seq_len
    ax.axhline(chance, color="gray", ls="--", label=f"chance ≈ budget / length = {chance:.2f}")
    ax.set(xlabel="step", ylim=(0, 1.05), title="held-out answer accuracy and routing recall")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "recall.png", dpi=120)
    written.append(out / "recall.png")

    if units is not None:
        rows = min(32, units.shape[0])
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.imshow(
            units[:rows], aspect="auto", cmap="Blues", interpolation="nearest", vmin=0, vmax=1
        )
        needles = torch.tensor(metrics["needles"][:rows]) // settings.unit
        unit_name = settings.demo().unit_name
        ax.scatter(needles, range(rows), marker="x", color="red", s=18, label=f"needle {unit_name}")
        ax.set(
            xlabel=unit_name,
            ylabel="held-out example",
            title=f"{unit_name}s the answer query routes to (sparse model)",
        )
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(out / "routes.png", dpi=120)
        written.append(out / "routes.png")
    plt.close("all")
    return written
