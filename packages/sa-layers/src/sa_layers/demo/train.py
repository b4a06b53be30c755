"""The demo's staged recipe on the retrieval task: dense training, indexer warm-up, sparse training.

1. **dense**: a model whose layers attend densely learns the task (LM loss on the answers), its
   first three quarters of steps on sequences of `seq_len // 4` tokens (retrieval learned there
   carries over to the full length, and short sequences train several times faster).
2. **warmup**: `sparsify` gives it fresh indexers; `set_indexer_training("dense_warmup")` trains
   only them, by distillation from the dense attention (`CausalLMOutput.indexer_loss`).
3. **sparse**: `set_indexer_training("sparse")`: attention over the routes, LM loss for the model,
   distillation loss (over the selected units) for the indexers.

Evaluation runs the routed model with its indexers frozen ("off") on a fixed held-out batch; the
sparsified model is also evaluated before the warm-up (its random indexer: recall near chance,
`budget / seq_len`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .models import MODELS, AnswerRoutes, Geometry
from .task import RetrievalBatch, RetrievalTask

STAGES = ("dense", "warmup", "sparse")


@dataclass(frozen=True)
class DemoSettings:
    """What the demo trains. Steps are per stage; `budget` is the tokens the indexer routes each
    query (group) to, in units of `unit` tokens (QSA compress ratio, Step-5 region size); each fact
    of the task fills one aligned span of `unit` tokens (`RetrievalTask.span`), so that it is one
    unit of the indexer, as a sentence would be (`span` overrides it); `index_heads` are the indexer's query heads (QSA:
    in all; Step-5: per KV group); `index_heads` and `warmup_lr` default to the model's
    (`models.QSADemo`, `models.Step5Demo`)."""

    model: str = "step5"
    seq_len: int = 512
    steps: tuple[int, int, int] = (240, 60, 40)
    pairs: int = 1
    batch: int = 16
    eval_batch: int = 64
    eval_every: int = 20
    hidden: int = 64
    layers: int = 1
    budget: int = 64
    unit: int = 4
    index_heads: int | None = None
    span: int | None = None
    lr: float = 3e-3
    warmup_lr: float | None = None
    device: str = "cpu"
    seed: int = 0

    def demo(self):
        """The `models.QSADemo` / `models.Step5Demo` of `model`."""
        heads = self.index_heads or MODELS[self.model].index_heads
        return MODELS[self.model](
            Geometry(self.hidden, self.layers, self.unit, self.budget, index_heads=heads)
        )


@dataclass
class Evaluation:
    """Answer accuracy; routing recall (`models.AnswerRoutes.recall`); attended key fraction (routed
    pairs / causal pairs); the answer queries' selected units [batch, units], for the heatmap."""

    accuracy: float
    recall: float | None = None
    key_fraction: float = 1.0
    units: torch.Tensor | None = None


@dataclass
class History:
    """Per-step training curves and per-evaluation metrics, tagged with their stage."""

    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)


@torch.no_grad()
def evaluate(model: nn.Module, batch: RetrievalBatch, demo) -> Evaluation:
    """Accuracy, recall and key fraction of `model` on `batch` with routing frozen."""
    modes = [layer.self_attn.indexer_training for layer in model.layers]
    outputs: list = []
    hooks = [
        ix.register_forward_hook(lambda _m, _i, out: outputs.append(out)) for ix in model.indexers()
    ]
    for layer in model.layers:
        layer.self_attn.indexer_training = "off"
    try:
        logits = model(batch.input_ids).logits[:, -1]
    finally:
        for layer, mode in zip(model.layers, modes, strict=True):
            layer.self_attn.indexer_training = mode
        for hook in hooks:
            hook.remove()
    accuracy = (logits.argmax(-1) == batch.answers).float().mean().item()
    if not outputs:
        return Evaluation(accuracy)
    routes: AnswerRoutes = demo.answer_routes(outputs, batch.needles, batch.input_ids.shape[1])
    return Evaluation(accuracy, routes.recall, routes.key_fraction, routes.units)


def attention_flops(settings: DemoSettings, key_fraction: float) -> float:
    """Forward attention FLOPs per sequence (4 · head_dim per query head and attended key)."""
    causal = settings.seq_len * (settings.seq_len + 1) / 2
    return 4 * settings.hidden * causal * key_fraction * settings.layers


def run(
    settings: DemoSettings,
    on_step: Callable[[str, dict], None] | None = None,
) -> dict:
    """Train the three stages; returns the metrics (JSON-ready) plus the models under "models" and
    each stage's final `Evaluation.units` under `stages[stage]["_units"]`.

    `on_step(stage, record)` is called after every training step (the CLI's progress bar).
    """
    torch.manual_seed(settings.seed)
    device = torch.device(settings.device)
    demo = settings.demo()
    span = settings.span or settings.unit
    short = RetrievalTask(max(settings.seq_len // 4, 64), settings.pairs, settings.seed, span=span)
    task = RetrievalTask(settings.seq_len, settings.pairs, seed=settings.seed, span=span)
    held_out = RetrievalTask(settings.seq_len, settings.pairs, settings.seed + 1, span=span)
    held_out = held_out.sample(settings.eval_batch)
    held_out = RetrievalBatch(*(t.to(device) for t in vars(held_out).values()))
    history = History()

    dense = demo.dense().to(device)
    stages: dict[str, dict] = {}
    model = dense
    for stage, steps in zip(STAGES, settings.steps, strict=True):
        if stage == "warmup":
            model = demo.sparsify(dense)
            stages["random_indexer"] = _record(evaluate(model, held_out, demo))
            model.set_indexer_training("dense_warmup")
        elif stage == "sparse":
            model.set_indexer_training("sparse")
        params = [p for p in model.parameters() if p.requires_grad]
        warmup_lr = settings.warmup_lr or demo.warmup_lr
        lr = {"dense": settings.lr, "warmup": warmup_lr, "sparse": settings.lr / 3}[stage]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        tokens, elapsed = 0, 0.0
        for step in range(steps):
            curriculum = stage == "dense" and step < 3 * steps // 4
            batch = (short if curriculum else task).sample(settings.batch)
            ids, labels = batch.input_ids.to(device), batch.labels.to(device)
            start = time.perf_counter()
            out = model(ids, labels=labels)
            loss = out.loss if stage != "warmup" else out.indexer_loss
            total = (
                loss if out.indexer_loss is None or stage == "warmup" else loss + out.indexer_loss
            )
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
            elapsed += time.perf_counter() - start
            tokens += ids.numel()
            record = {
                "stage": stage,
                "step": len(history.steps),
                "lm_loss": out.loss.item(),
                "indexer_loss": None if out.indexer_loss is None else out.indexer_loss.item(),
            }
            if (step + 1) % settings.eval_every == 0 or step + 1 == steps:
                ev = evaluate(model, held_out, demo)
                record |= {"accuracy": ev.accuracy, "recall": ev.recall}
                history.evals.append(record)
            history.steps.append(record)
            if on_step is not None:
                on_step(stage, record)
        stages[stage] = _record(evaluate(model, held_out, demo))
        stages[stage]["tokens_per_s"] = tokens / max(elapsed, 1e-9)
    return {
        "settings": vars(settings) | {"steps": list(settings.steps)},
        "stages": stages,
        "history": {"steps": history.steps, "evals": history.evals},
        "needles": held_out.needles.tolist(),
        "models": {"dense": dense, "sparse": model},
    }


def _record(evaluation: Evaluation) -> dict:
    """The JSON part of an evaluation; the unit map under "_units" (popped before writing)."""
    record = vars(evaluation).copy()
    record["_units"] = record.pop("units")
    return record
