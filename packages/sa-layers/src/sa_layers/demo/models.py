"""The demo's two models and how it reads their routes.

- `step5`: a one-layer `Step5Model`; its routed layer is a CSA layer whose indexer picks `topk`
  historical regions of `region_size` tokens per KV group (plus the query's current region).
- `qsa`: a one-layer `QSAModel`; its routed layer's indexer picks `budget / c` compressed blocks of
  `c` tokens per query (plus the tail of the query's own block), shared by every head.

Both are trained dense first (layer type "dense"), then sparsified (`sparsify`: the same weights,
fresh indexers). Routing recall counts, for the answer query (the last position), whether the unit
(region / block) that holds the needle is among the units it selected: for Step-5 per KV group,
for QSA once (every head shares the route); the mean over routed layers (and groups).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sa_routing import Step5SparseConfig

from ..qsa import QSAConfig, QSAModel
from ..step5 import Step5Config, Step5Model
from .task import RetrievalTask


@dataclass(frozen=True)
class Geometry:
    """The attention geometry both demo models share."""

    hidden: int
    layers: int
    unit: int
    budget: int
    heads: int = 4
    groups: int = 2
    index_heads: int = 2
    init_std: float = 0.05
    """`index_heads`: the indexer's query heads, QSA in all, Step-5 per KV group."""


@dataclass(frozen=True)
class AnswerRoutes:
    """What the routed layers selected on one batch.

    Attributes:
        recall: the fraction of (layer, group, example) whose answer query selected the needle's
            unit.
        key_fraction: attended (query, key) pairs over causal pairs, mean over layers and groups.
        units: float32 [batch, units], the first routed layer's answer queries: the fraction of its
            route groups that selected each unit (for the heatmap).
    """

    recall: float
    key_fraction: float
    units: torch.Tensor


class QSADemo:
    """The QSA demo model: routes are token ids, `unit` tokens per compressed block."""

    name = "qsa"
    unit_name = "compressed block"
    index_heads = 8
    warmup_lr = 1e-3
    """Eight index heads: a fact token whose key has a non-positive dot with every head's answer
    query scores 0 (ReLU) and gets no distillation gradient; with more heads fewer facts start so."""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry

    def config(self, layer_type: str) -> QSAConfig:
        g = self.geometry
        return QSAConfig(
            vocab_size=RetrievalTask.vocab_size,
            hidden_size=g.hidden,
            intermediate_size=2 * g.hidden,
            num_hidden_layers=g.layers,
            num_attention_heads=g.heads,
            num_key_value_heads=g.groups,
            head_dim=g.hidden // g.heads,
            partial_rotary_factor=0.5,
            indexer_n_heads=g.index_heads,
            indexer_head_dim=g.hidden // g.heads,
            indexer_budget=g.budget,
            indexer_compress_ratio=g.unit,
            attn_backend="auto",
            initializer_range=g.init_std,
            layer_types=(layer_type,) * g.layers,
        )

    def dense(self) -> QSAModel:
        return QSAModel(self.config("dense"))

    def sparsify(self, dense: nn.Module) -> QSAModel:
        return QSAModel.sparsify(dense)

    def answer_routes(self, outputs: list, needles: torch.Tensor, length: int) -> AnswerRoutes:
        """outputs: the indexers' int32 token routes [batch, length, W] (−1 padding), per layer."""
        c = self.geometry.unit
        hits, pairs = [], []
        for ids in outputs:
            hits.append((ids[:, -1] == needles[:, None]).any(-1).float().mean())
            pairs.append((ids >= 0).sum() / ids.shape[0])
        units = torch.zeros(needles.shape[0], length // c)
        last = outputs[0][:, -1].long().cpu()
        rows = torch.arange(last.shape[0])[:, None].expand_as(last)
        valid = last >= 0
        units[rows[valid], (last[valid] // c).clamp(max=units.shape[1] - 1)] = 1.0
        causal = length * (length + 1) / 2
        return AnswerRoutes(
            torch.stack(hits).mean().item(), torch.stack(pairs).mean().item() / causal, units
        )


class Step5Demo:
    """The Step-5 demo model: a CSA layer routes each KV group to `budget / unit` regions."""

    name = "step5"
    unit_name = "region"
    index_heads = 2
    warmup_lr = 3e-3

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry

    def config(self, layer_type: str) -> Step5Config:
        g = self.geometry
        head_dim = g.hidden // g.heads
        return Step5Config(
            vocab_size=RetrievalTask.vocab_size,
            hidden_size=g.hidden,
            intermediate_size=2 * g.hidden,
            num_hidden_layers=g.layers,
            num_attention_heads=g.heads,
            num_attention_groups=g.groups,
            head_dim=head_dim,
            layer_types=(layer_type,) * g.layers,
            partial_rotary_factor=0.5,
            sparse_config=Step5SparseConfig(
                proxy_dim=head_dim,
                index_heads=g.index_heads * g.groups,
                num_provider_groups=g.groups,
                rope_dim=head_dim // 2,
                region_size=g.unit,
                topk=g.budget // g.unit,
                hidden_size=g.hidden,
            ),
            attn_backend="auto",
            initializer_range=g.init_std,
        )

    def dense(self) -> Step5Model:
        return Step5Model(self.config("dense"))

    def sparsify(self, dense: nn.Module) -> Step5Model:
        return Step5Model.sparsify(dense, layer_types=("csa",) * self.geometry.layers)

    def answer_routes(self, outputs: list, needles: torch.Tensor, length: int) -> AnswerRoutes:
        """outputs: the indexers' `RegionSelection`s (region ids [batch, groups, length, topk + 1],
        ascending, unused slots `region_count`), per layer. One document per row: region r holds
        tokens `[r · unit, (r + 1) · unit)`."""
        r = self.geometry.unit
        hits, pairs = [], []
        query = torch.arange(length, device=needles.device)[None, None, :, None]
        for selection in outputs:
            ids = selection.region_ids.long()  # [B, G, Q, K]
            valid = ids < selection.region_count
            last = ids[:, :, -1]
            hits.append(((last == (needles // r)[:, None, None]) & valid[:, :, -1]).any(-1).float())
            visible = (query - ids * r + 1).clamp(0, r) * valid
            pairs.append(visible.sum() / (ids.shape[0] * ids.shape[1]))
        first = outputs[0]
        ids = first.region_ids[:, :, -1].long().cpu()  # [B, G, K]
        units = torch.zeros(ids.shape[0], first.region_count + 1)
        for g in range(ids.shape[1]):
            units.scatter_add_(1, ids[:, g], torch.full(ids[:, g].shape, 1.0 / ids.shape[1]))
        units = units[:, : length // r]
        causal = length * (length + 1) / 2
        return AnswerRoutes(
            torch.stack(hits).mean().item(), torch.stack(pairs).mean().item() / causal, units
        )


MODELS = {"step5": Step5Demo, "qsa": QSADemo}
"""The demo's `--model` choices; the first is the default."""
