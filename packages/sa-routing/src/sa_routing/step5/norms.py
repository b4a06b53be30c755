"""The indexer's norms (SEMANTICS §1.2): `q_norm` RMSNorm and `k_norm` LayerNorm, weights rounded to the activation dtype."""

import torch
from torch import nn

from sa_kernels import layer_norm_e2, rms_norm


class Step5IndexerRMSNorm(nn.Module):
    """Zero-centred RMSNorm `x * rstd * (1 + w)` whose FP32 weight is first rounded to x's dtype.

    Input [..., dim] BF16 → output [..., dim] in x's dtype; FP32 statistics, one rounding.
    """

    def __init__(
        self, dim: int, eps: float = 1e-5, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            x, self.weight, self.eps, zero_centered=True, weight_in_activation_dtype=True
        )


class Step5IndexerLayerNorm(nn.Module):
    """LayerNorm with variance `E[x²] − E[x]²` in FP32; weight and bias rounded to x's dtype first.

    Input [..., dim] BF16 → output [..., dim] in x's dtype. Forward only (no autograd history).
    """

    def __init__(
        self, dim: int, eps: float = 1e-5, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_e2(x, self.weight, self.bias, self.eps)
