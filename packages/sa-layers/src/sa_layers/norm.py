"""Zero-centred RMSNorm: the residual and per-head norms of Step-5 and QSA layers (SEMANTICS §1.1, §2)."""

import torch
from torch import nn

from sa_kernels import rms_norm


class ZeroCenteredRMSNorm(nn.Module):
    """Zero-centred RMSNorm: `x * rstd * (1 + w)` with FP32 statistics and an FP32 weight, rounded once.

    Args:
        hidden_size: channels of the normalised dim.
        eps: added to the mean square.
        output_dtype: dtype of the output (the model's activation dtype, e.g. bf16); `None` keeps the
            input's dtype (the FP32 residual stream would then stay FP32).
    Shapes:
        x: [..., hidden_size] fp32 (the residual stream) or bf16 → [..., hidden_size] output_dtype.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, output_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int):
            raise TypeError(f"{name}: hidden_size must be an int; got {hidden_size!r}")
        if hidden_size < 1:
            raise ValueError(f"{name}: hidden_size must be >= 1; got {hidden_size}")
        self.eps = eps
        self.output_dtype = output_dtype
        # zero-centred: a zero weight is the identity scale, as checkpoints store it
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` would round the scale: the weight stays FP32 (SEMANTICS §1.1).
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            self.weight.data = self.weight.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.output_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, output_dtype={self.output_dtype}"


class Step5RMSNorm(ZeroCenteredRMSNorm):
    """The Step-5 residual-stream norm: `ZeroCenteredRMSNorm` with the reference checkpoint's eps 1e-5."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, output_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(hidden_size, eps, output_dtype)
