"""`Step5IndexerWeightProjection`: the signed per-head weights of the indexer score (SEMANTICS §1.2)."""

import torch
from torch import nn


class Step5IndexerWeightProjection(nn.Module):
    """`w_proj`: an FP32 weight rounded to the activation dtype before the matmul; the result is widened
    to FP32 and scaled by `heads_per_group ** -0.5`.

    Input hidden [B, S, hidden_size] BF16 → FP32 [B, S, groups, heads_per_group].
    """

    def __init__(
        self,
        hidden_size: int,
        groups: int,
        heads_per_group: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.groups = groups
        self.heads_per_group = heads_per_group
        self.weight = nn.Parameter(
            torch.empty(groups * heads_per_group, hidden_size, dtype=torch.float32, device=device)
        )
        nn.init.normal_(self.weight, std=hidden_size**-0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not hidden.is_floating_point():
            raise TypeError(
                f"Step5IndexerWeightProjection: hidden must be a floating tensor; got {hidden.dtype}"
            )
        if hidden.shape[-1:] != self.weight.shape[1:]:
            raise ValueError(
                "Step5IndexerWeightProjection: hidden must be [..., hidden_size="
                f"{self.weight.shape[1]}]; got {tuple(hidden.shape)}"
            )
        projected = torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype)).float()
        scaled = projected * self.heads_per_group**-0.5
        return scaled.view(*hidden.shape[:-1], self.groups, self.heads_per_group)
