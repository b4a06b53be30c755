"""Tiny QSA and Step-5 models for tests (the package's and the integration tests'): one home for
their geometry, so that every test builds the same models.

QSA: two routed layers, budget 8 and compress ratio 2, so positions from 9 on are sparse.
Step-5: layers SWA, SWA, SWA, CSA (the default pattern) with window 8, region 4 and top-2, so queries from document
position (2 + 1) · 4 = 12 on are sparse. Both: vocabulary 50, hidden 32, head dim 16, the
reference attention backend, FP32, initializer range 0.2 (routes that differ from a uniform pick).
"""

from __future__ import annotations

import torch
from torch import nn

from sa_routing import Step5SparseConfig

from .qsa import QSAConfig, QSAModel
from .step5 import Step5Config, Step5Model

VOCAB = 50
HIDDEN = 32
# the fields both tiny configs share
_SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=48,
    head_dim=16,
    attn_backend="reference",
    initializer_range=0.2,
)


def tiny_qsa_config(**overrides) -> QSAConfig:
    """The tiny `QSAConfig`; `overrides` replace any of its fields."""
    fields = dict(
        _SHARED,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        indexer_n_heads=2,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=2,
    )
    fields.update(overrides)
    return QSAConfig(**fields)


def tiny_step5_config(*, sparse: dict | None = None, **overrides) -> Step5Config:
    """The tiny `Step5Config`; `overrides` replace any of its fields, `sparse` any field of its
    `Step5SparseConfig` (whose hidden size stays 32 whatever `hidden_size` says)."""
    fields = dict(
        _SHARED,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_attention_groups=2,
        sliding_window=8,
        rope_theta=(10000.0, 500.0, 10000.0, 1000.0),
        partial_rotary_factor=(0.5, 1.0, 0.5, 0.25),
        swiglu_limits=(0.0, 2.0, 0.0, 1.5),
        sparse_config=Step5SparseConfig(
            proxy_dim=16,
            index_heads=4,
            num_provider_groups=2,
            rope_dim=8,
            region_size=4,
            topk=2,
            hidden_size=HIDDEN,
            **(sparse or {}),
        ),
    )
    fields.update(overrides)
    return Step5Config(**fields)


def randomise_norms(module: nn.Module) -> None:
    """Non-trivial norm scales, so that a wrong norm cannot hide behind identity scales: the
    zero-centred norms' weights uniform in [−0.5, 0.5], the indexers' 1-D weights (their plain
    norms) uniform in [0.5, 1.5]."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "indexer" in name:
                if p.dim() == 1:
                    p.uniform_(0.5, 1.5)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5)


def packed_positions(
    documents: list[list[int]] | tuple[tuple[int, ...], ...], length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-5 inputs of rows of back-to-back documents, then padding up to `length`.

    Args:
        documents: per row, the lengths of its documents (summing to at most `length`).
    Returns:
        positions: int64 [rows, length], restarting at 0 at every document (0 on padding);
        padding: bool [rows, length], True after each row's documents.
    """
    positions = torch.zeros(len(documents), length, dtype=torch.int64)
    padding = torch.ones(len(documents), length, dtype=torch.bool)
    for row, lengths in enumerate(documents):
        pieces = torch.cat([torch.arange(n) for n in lengths])
        positions[row, : pieces.numel()] = pieces
        padding[row, : pieces.numel()] = False
    return positions, padding


def tiny_qsa_model(seed: int = 0, **overrides) -> QSAModel:
    """A `QSAModel` of `tiny_qsa_config(**overrides)`, seeded, FP32, norm scales randomised."""
    torch.manual_seed(seed)
    model = QSAModel(tiny_qsa_config(**overrides))
    randomise_norms(model)
    return model


def tiny_step5_model(seed: int = 0, *, sparse: dict | None = None, **overrides) -> Step5Model:
    """A `Step5Model` of `tiny_step5_config(sparse=sparse, **overrides)`, seeded, FP32, norm
    scales randomised."""
    torch.manual_seed(seed)
    model = Step5Model(tiny_step5_config(sparse=sparse, **overrides))
    randomise_norms(model)
    return model
