"""What the QSA and Step-5 models return, and their language-model loss (aligned labels, CP scaling)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn import functional as F

from sa_cp import group_rank_and_size

IGNORE_INDEX = -100


@dataclass
class CausalLMOutput:
    """What a model call returns.

    Attributes:
        logits: [batch, local_length, vocab_size] in the model's dtype.
        loss: the mean next-token cross entropy over labelled tokens (FP32 scalar), or None
            without labels (see `QSAModel.forward` for its meaning under context parallelism).
        indexer_loss: the summed auxiliary losses of the routed layers while indexer training is
            on, else None.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    indexer_loss: torch.Tensor | None = None


def language_model_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore: torch.Tensor | None,
    cp_group=None,
) -> torch.Tensor:
    """FP32 cross entropy summed over the shard's labelled tokens, divided by the global count and
    multiplied by the CP group size: each rank's loss is `size · Σ_local / N_global`, so the average
    over the CP group (what data-parallel gradient averaging computes) is the global mean, as are
    the averaged gradients.

    Args:
        logits: [batch, local_length, vocab] in the model's dtype.
        labels: int [batch, local_length], already aligned (labels[t] is the token that follows
            position t), IGNORE_INDEX (−100) where no loss is taken.
        ignore: bool [batch, local_length], True where no loss is taken whatever the label (padding),
            or None.
        cp_group: the context-parallel group (None: one rank); the count is all-reduced over it.
    Returns:
        FP32 scalar.
    """
    targets = labels if ignore is None else labels.masked_fill(ignore, IGNORE_INDEX)
    targets = targets.long()
    total = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    count = (targets != IGNORE_INDEX).sum()
    _, size = group_rank_and_size(cp_group)
    if size > 1:
        count = count.clone()
        dist.all_reduce(count, group=cp_group)
    return total * size / count.clamp(min=1)
