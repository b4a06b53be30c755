"""Tiny Step-5 and QSA models and their batches, shared by the model integration tests (the
models are `sa_layers.testing`'s, which the sa-layers tests build too).

Both models go through one interface so that every test runs on either: `build(kind)`, a batch of
rows (`batch(kind)`), `run(kind, model, batch, rows=..., shard=...)` for the whole sequence or one
contiguous context-parallel shard, and `route_log(model)` for the routes the indexers chose.

Step-5: layers SWA, SWA, SWA, CSA (4 query heads in 2 groups, region 4, top-2, window 8: queries
from document position 12 on are sparse). QSA: two QSA layers (budget 8, compress ratio 2:
positions from 9 on are sparse). Sequences of 48 tokens split into 2 shards of 24, a multiple of
both the region size and the compress ratio.
"""

from dataclasses import dataclass

import torch
from torch import nn

from sa_layers import CausalLMOutput, testing
from sa_routing import QSAContextParallel

KINDS = ("step5", "qsa")
SEQUENCE = 48
VOCAB = testing.VOCAB
# the Step-5 model with 4 query heads (2 per KV group): the multi-rank runs stay small
STEP5_HEADS = {"num_attention_heads": 4}
qsa_config = testing.tiny_qsa_config


def step5_config(**overrides):
    return testing.tiny_step5_config(**{**STEP5_HEADS, **overrides})


def build(kind: str, seed: int = 0) -> nn.Module:
    """The tiny model of `kind` in FP32, its norm scales drawn at random (a wrong norm cannot
    hide behind identity scales)."""
    if kind == "step5":
        return testing.tiny_step5_model(seed, **STEP5_HEADS)
    return testing.tiny_qsa_model(seed)


@dataclass(frozen=True)
class Batch:
    """Global rows of one model call.

    Attributes:
        input_ids, labels: int64 [rows, SEQUENCE]; labels already aligned to their positions.
        positions: Step-5 document-local positions int64 [rows, SEQUENCE], or None.
        padding: Step-5 padding mask bool [rows, SEQUENCE] (True = padding), or None.
        attention_mask: QSA right-padding mask int64 [rows, SEQUENCE] (1 = token), or None.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    padding: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    def rows(self, index: slice) -> "Batch":
        pick = lambda t: None if t is None else t[index]
        return Batch(*(pick(getattr(self, f)) for f in self.__dataclass_fields__))


def batch(kind: str, *, padded: bool = True, seed: int = 1) -> Batch:
    """Two rows of random tokens and labels.

    padded: Step-5 row 0 packs documents of 30 and 18 tokens, row 1 documents of 21 and 16 tokens
        then 11 padding tokens; QSA row 1 is right-padded after 37 tokens. Otherwise no padding
        (Step-5 rows still packed: 30 + 18 and 18 + 30 tokens), so that every row holds as many
        labelled tokens and as many sparse queries (the mean of per-row losses is the batch's).
    """
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQUENCE), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQUENCE), generator=generator)
    if kind == "step5":
        positions, padding = testing.packed_positions(
            [[30, 18], [21, 16]] if padded else [[30, 18], [18, 30]], SEQUENCE
        )
        return Batch(ids, labels, positions, padding if padded else None)
    mask = None
    if padded:
        mask = torch.ones(2, SEQUENCE, dtype=torch.int64)
        mask[1, 37:] = 0
    return Batch(ids, labels, attention_mask=mask)


def run(
    kind: str,
    model: nn.Module,
    inputs: Batch,
    *,
    shard: tuple[int, int] = (0, 1),
    group=None,
) -> CausalLMOutput:
    """`model` on `inputs`, or on the contiguous sequence shard `shard = (rank, size)` of every row
    with `group` the context-parallel process group."""
    rank, size = shard
    local = SEQUENCE // size
    cols = slice(rank * local, (rank + 1) * local)
    ids, labels = inputs.input_ids[:, cols], inputs.labels[:, cols]
    if kind == "step5":
        positions = None if inputs.positions is None else inputs.positions[:, cols]
        padding = None if inputs.padding is None else inputs.padding[:, cols]
        return model(ids, positions, padding, labels, cp_group=group)
    if size == 1:
        return model(ids, attention_mask=inputs.attention_mask, labels=labels)
    cp = QSAContextParallel.create(local, group=group, attention_mask=inputs.attention_mask)
    return model(ids, labels=labels, cp_context=cp)


def total_loss(out: CausalLMOutput) -> torch.Tensor:
    """The training objective: LM loss plus the indexers' distillation loss when it is on."""
    return out.loss if out.indexer_loss is None else out.loss + out.indexer_loss


def route_log(model: nn.Module) -> list[torch.Tensor]:
    """A list that every indexer call of `model` appends its routes to (QSA: token ids; Step-5:
    region ids)."""
    seen: list[torch.Tensor] = []

    def record(_module, _inputs, out):
        seen.append((out if isinstance(out, torch.Tensor) else out.region_ids).detach().clone())

    for indexer in model.indexers():
        indexer.register_forward_hook(record)
    return seen


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient by name (DTensor gradients gathered into full tensors)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out
