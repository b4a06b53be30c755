"""The feed-forward modules of Step-5 decoder layers (SEMANTICS §1.1): the dense MLP and the MoE.

`Step5MoE` routes every token to `top_k` of `num_experts` clamped-SwiGLU experts with a sigmoid router and
an aux-loss-free balancing bias (DeepSeek-V3 style), and adds one always-on shared expert. Per forward:

1. routing (FP32): `scores = sigmoid(x @ router.T)`; the experts are the top `top_k` of
   `scores + expert_bias`, ties to the lowest expert id; the combine weights are the selected
   *unbiased* scores, normalised to sum 1 (`norm_topk_prob`) and times `routed_scaling_factor`;
2. dispatch: the `tokens * top_k` (token, expert) pairs are sorted by expert once (stable: token order
   within an expert), the token rows gathered into that order;
3. experts: `torch._grouped_mm` over the sorted rows (no host synchronisation), or a loop over experts
   on contiguous slices (one `.tolist()` of the expert offsets per forward);
4. combine: the expert rows go back to token order and `shared(x) + Σ_k w_k · y_k` is one batched matmul
   (`baddbmm`): the FP32 weights enter it rounded to the activation dtype, the products accumulate in
   FP32 on GPUs and the sum rounds once to the activation dtype.

Gathers whose backward would sum by atomics (the `top_k` copies of a token) reduce in token order
instead, so gradients are deterministic.
"""

import itertools
import math
import numbers
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from sa_kernels import clamped_swiglu
from sa_kernels.backend import device_capability

from .mlp import ClampedSwiGLUMLP

Step5MLP = ClampedSwiGLUMLP
"""The Step-5 dense MLP is `ClampedSwiGLUMLP` itself (separate gate/up projections, `clamped_swiglu`):
the same class under the Step-5 name, so the dense MLP and the MoE's shared expert are one type."""

ExpertBackend = Literal["auto", "grouped_mm", "loop"]
_EXPERT_BACKENDS = ("auto", "grouped_mm", "loop")

# `torch._grouped_mm` strides and offsets must be multiples of 16 bytes.
_GROUPED_MM_ALIGNMENT_BYTES = 16

# (device type, device index, dtype) -> None when `torch._grouped_mm` runs there and matches per-group
# matmuls forward and backward (an empty group included), else the reason it does not.
_GROUPED_MM_PROBES: dict[tuple[str, int | None, torch.dtype], str | None] = {}


@torch.compiler.disable
def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> str | None:
    """Runs `torch._grouped_mm` once at a tiny shape on `device`/`dtype`; cached per device and dtype."""
    key = (device.type, device.index, dtype)
    if key in _GROUPED_MM_PROBES:
        return _GROUPED_MM_PROBES[key]
    reason = None
    if not hasattr(torch, "_grouped_mm"):
        reason = f"torch {torch.__version__} has no torch._grouped_mm"
    else:
        try:
            reason = _run_grouped_mm_probe(device, dtype)
        except RuntimeError as error:  # unsupported device, dtype or build
            reason = f"torch._grouped_mm fails on {device.type} {dtype}: {error}".split("\n")[0]
    _GROUPED_MM_PROBES[key] = reason
    return reason


def _run_grouped_mm_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    with torch.inference_mode(False), torch.enable_grad():  # a first forward may run under either
        generator = torch.Generator().manual_seed(0)
        rows, inner, outer, sizes = 6, 16, 16, (2, 0, 4)  # one empty group
        x = torch.randn(rows, inner, generator=generator).to(device, dtype).requires_grad_()
        w = torch.randn(len(sizes), outer, inner, generator=generator).to(device, dtype)
        w.requires_grad_()
        grad = torch.randn(rows, outer, generator=generator).to(device, dtype)
        offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        y.backward(grad)
    bounds = list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))
    x32, w32, g32 = x.detach().float(), w.detach().float(), grad.float()
    expected = {
        "forward": (y, torch.cat([x32[a:b] @ w32[e].T for e, (a, b) in enumerate(bounds)])),
        "input gradient": (
            x.grad,
            torch.cat([g32[a:b] @ w32[e] for e, (a, b) in enumerate(bounds)]),
        ),
        "weight gradient": (w.grad, torch.stack([g32[a:b].T @ x32[a:b] for a, b in bounds])),
    }
    tolerance = 0.1 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    for name, (got, want) in expected.items():
        error = (got.float() - want).abs().max().item()
        if not error <= tolerance * max(1.0, want.abs().max().item()):
            return f"torch._grouped_mm's {name} differs from per-group matmuls by {error}"
    if w.grad[1].count_nonzero().item() != 0:
        return "torch._grouped_mm gives an expert without tokens a nonzero weight gradient"
    return None


class _GatherRows(torch.autograd.Function):
    """`x.index_select(0, index)` whose backward gathers instead of scattering.

    `index` holds each row of `x` exactly `copies` times; `inverse[r * copies + j]` is the output row
    holding copy `j` of row `r`. The gradient is `grad[inverse].view(rows, copies, -1).sum(1)`, a
    reduction in a fixed order (no atomics: deterministic). `copies == 1` is a permutation.
    """

    @staticmethod
    def forward(ctx, x, index, inverse, copies):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if ctx.copies > 1:
            grad = grad.view(-1, ctx.copies, grad.shape[-1]).sum(1)
        return grad, None, None, None


def _check_size(owner: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int; got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}; got {value}")
    return value


def _check_limit(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a float; got {value!r}")
    if math.isnan(value):
        raise ValueError(
            f"{owner}: {name} must not be NaN (<= 0 disables the clamp); got {value!r}"
        )
    return float(value)


class Step5RoutedExperts(nn.Module):
    """`num_experts` clamped-SwiGLU MLPs with stacked weights, applied to rows already sorted by expert.

    Parameters (nn.Linear layout per expert: `[out, in]`), in the model dtype:
        gate_proj, up_proj: [num_experts, intermediate_size, hidden_size].
        down_proj: [num_experts, hidden_size, intermediate_size].
    Each is initialised as `nn.Linear` initialises one expert: uniform in `±1/sqrt(fan_in)`.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        limit: float,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = "Step5RoutedExperts"
        _check_size(owner, "hidden_size", hidden_size)
        _check_size(owner, "intermediate_size", intermediate_size)
        _check_size(owner, "num_experts", num_experts)
        self.limit = _check_limit(owner, "limit", limit)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        factory = {"dtype": dtype, "device": device}
        gate_shape = (num_experts, intermediate_size, hidden_size)
        self.gate_proj = nn.Parameter(torch.empty(gate_shape, **factory))
        self.up_proj = nn.Parameter(torch.empty(gate_shape, **factory))
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, **factory)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for weight in (self.gate_proj, self.up_proj, self.down_proj):
                bound = 1.0 / math.sqrt(weight.shape[-1])
                weight.uniform_(-bound, bound)

    def grouped_mm_refusal(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when `torch._grouped_mm` can run these experts on `device`/`dtype`, else the reason."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        for name, size in (
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
        ):
            if size * itemsize % _GROUPED_MM_ALIGNMENT_BYTES:
                return (
                    f"torch._grouped_mm needs rows of a multiple of {_GROUPED_MM_ALIGNMENT_BYTES} "
                    f"bytes; {name}={size} of {dtype} is {size * itemsize}"
                )
        return _probe_grouped_mm(device, dtype)

    def forward_grouped(self, rows: torch.Tensor, expert_ends: torch.Tensor) -> torch.Tensor:
        """rows: [pairs, hidden] sorted by expert; expert_ends: [num_experts] int64 cumulative counts."""
        offs = expert_ends.to(torch.int32)
        gate = torch._grouped_mm(rows, self.gate_proj.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(rows, self.up_proj.transpose(-2, -1), offs=offs)
        hidden = clamped_swiglu(gate, up, self.limit)
        return torch._grouped_mm(hidden, self.down_proj.transpose(-2, -1), offs=offs)

    def forward_loop(self, rows: torch.Tensor, expert_ends: torch.Tensor) -> torch.Tensor:
        """As `forward_grouped`, one expert at a time on its contiguous slice of `rows`.

        Reads the expert offsets on the host with one `.tolist()` (a device synchronisation on GPUs);
        experts without tokens are skipped (their weight gradients are zero).
        """
        ends = expert_ends.tolist()
        outputs = []
        start = 0
        for expert, end in enumerate(ends):
            if end > start:
                chunk = rows[start:end]
                gate = F.linear(chunk, self.gate_proj[expert])
                up = F.linear(chunk, self.up_proj[expert])
                hidden = clamped_swiglu(gate, up, self.limit)
                outputs.append(F.linear(hidden, self.down_proj[expert]))
            start = end
        return torch.cat(outputs)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, limit={self.limit}"
        )


class Step5MoE(nn.Module):
    """Sigmoid-routed top-k clamped-SwiGLU experts plus one always-on shared expert (SEMANTICS §1.1).

    `output = shared_expert(x) + Σ_{e in top_k(scores + expert_bias)} w_e · expert_e(x)` with
    `scores = sigmoid(x @ router.weight.T)` and `w_e = routed_scaling_factor · scores_e / Σ scores_sel`
    (`/ Σ` only when `norm_topk_prob`; the sum carries `+ 1e-20`). Ties in `scores + expert_bias`
    go to the lowest expert id. The selection is not differentiable; the weights are (through the
    router). No expert parallelism: every expert lives on this device.

    Args:
        hidden_size: model width H.
        moe_intermediate_size: width I of each routed expert.
        num_experts: routed experts E.
        top_k: experts per token, `1 <= top_k <= num_experts`.
        swiglu_limit: clamp of the routed experts' SwiGLU; `<= 0` disables it.
        shared_intermediate_size: width of the shared expert; `None` means `moe_intermediate_size`.
        routed_scaling_factor: multiplies the combine weights (> 0).
        norm_topk_prob: normalise the selected scores to sum 1.
        dtype, device: of the experts and the shared expert (the model dtype).
        shared_swiglu_limit: clamp of the shared expert's SwiGLU; `None` means `swiglu_limit`.
        expert_backend: "auto" (`torch._grouped_mm` for bf16 on CUDA sm90 where a one-time probe at the
            first forward on the device passes and the widths are 16-byte aligned, else the loop),
            "grouped_mm" (wherever it runs; raises where it does not) or "loop".
    Submodules, parameters and buffers (the state_dict keys):
        router.weight: [E, H] FP32 (FP64 in an FP64 module); `module.to(bf16)` keeps it FP32.
        expert_bias: [E] buffer, FP32 (FP64 in an FP64 module): the selection bias, not trained by
            gradient; `update_expert_bias` moves it.
        experts.gate_proj, experts.up_proj: [E, I, H]; experts.down_proj: [E, H, I] (Step5RoutedExperts).
        shared_expert: a `ClampedSwiGLUMLP` of width `shared_intermediate_size`.
    Attributes:
        last_expert_counts: int64 [E], (token, expert) pairs of the latest forward per expert (detached;
            None before the first forward).
        pending_expert_counts: int64 [E] buffer (not in the state_dict), the counts summed over training
            forwards since the last `update_expert_bias`.
    Shapes:
        x: [..., H] in the experts' dtype → [..., H] same dtype. Routing math runs in the router's dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        swiglu_limit: float,
        shared_intermediate_size: int | None = None,
        routed_scaling_factor: float = 1.0,
        norm_topk_prob: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        shared_swiglu_limit: float | None = None,
        expert_backend: ExpertBackend = "auto",
    ) -> None:
        super().__init__()
        owner = "Step5MoE"
        _check_size(owner, "hidden_size", hidden_size)
        _check_size(owner, "moe_intermediate_size", moe_intermediate_size)
        _check_size(owner, "num_experts", num_experts)
        _check_size(owner, "top_k", top_k)
        if top_k > num_experts:
            raise ValueError(
                f"Step5MoE: top_k must be <= num_experts ({num_experts}); got top_k={top_k}"
            )
        if shared_intermediate_size is None:
            shared_intermediate_size = moe_intermediate_size
        _check_size(owner, "shared_intermediate_size", shared_intermediate_size)
        swiglu_limit = _check_limit(owner, "swiglu_limit", swiglu_limit)
        shared_swiglu_limit = _check_limit(
            owner,
            "shared_swiglu_limit",
            swiglu_limit if shared_swiglu_limit is None else shared_swiglu_limit,
        )
        if (
            isinstance(routed_scaling_factor, bool)
            or not isinstance(routed_scaling_factor, numbers.Real)
            or not math.isfinite(routed_scaling_factor)
            or routed_scaling_factor <= 0
        ):
            raise ValueError(
                f"Step5MoE: routed_scaling_factor must be a finite float > 0; got {routed_scaling_factor!r}"
            )
        if not isinstance(norm_topk_prob, bool):
            raise TypeError(f"Step5MoE: norm_topk_prob must be a bool; got {norm_topk_prob!r}")
        if expert_backend not in _EXPERT_BACKENDS:
            raise ValueError(
                f"Step5MoE: expert_backend must be one of {_EXPERT_BACKENDS}; got {expert_backend!r}"
            )
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"Step5MoE: dtype must be a floating torch.dtype; got {dtype!r}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.norm_topk_prob = norm_topk_prob
        self.expert_backend = expert_backend
        router_dtype = _router_dtype(dtype or torch.get_default_dtype())
        self.router = nn.Linear(
            hidden_size, num_experts, bias=False, dtype=router_dtype, device=device
        )
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts, dtype=router_dtype, device=device)
        )
        self.register_buffer(
            "pending_expert_counts",
            torch.zeros(num_experts, dtype=torch.int64, device=device),
            persistent=False,
        )
        self.experts = Step5RoutedExperts(
            hidden_size, moe_intermediate_size, num_experts, swiglu_limit, dtype, device
        )
        self.shared_expert = ClampedSwiGLUMLP(
            hidden_size, shared_intermediate_size, shared_swiglu_limit, dtype, device
        )
        self.last_expert_counts: torch.Tensor | None = None
        self._expert_paths: dict[tuple[str, str, int | None, torch.dtype], str] = {}

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` must not round the router or its bias: where `fn` would give them a
        # dtype below FP32 they only move device (from their FP32/FP64 values, so nothing is lost).
        def keep_router_precision(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.is_floating_point() and out.dtype != _router_dtype(out.dtype):
                return t.to(device=out.device)
            return out

        if recurse:
            for module in self.children():
                module._apply(keep_router_precision if module is self.router else fn)
        return super()._apply(keep_router_precision, recurse=False)

    def expert_path(self, device: torch.device, dtype: torch.dtype) -> str:
        """How the experts run on `device`/`dtype` ("grouped_mm" or "loop"), decided once and cached.

        The first call on a device may run the `torch._grouped_mm` probe (a few tiny matmuls and host
        reads): make it eagerly, e.g. with one forward, before capturing CUDA graphs.

        Raises:
            RuntimeError: expert_backend="grouped_mm" where `torch._grouped_mm` does not run (the reason).
        """
        key = (self.expert_backend, device.type, device.index, dtype)
        path = self._expert_paths.get(key)
        if path is None:
            if self.expert_backend == "loop":
                path = "loop"
            elif self.expert_backend == "grouped_mm":
                refusal = self.experts.grouped_mm_refusal(device, dtype)
                if refusal is not None:
                    raise RuntimeError(
                        f"Step5MoE: expert_backend='grouped_mm' cannot run: {refusal}"
                    )
                path = "grouped_mm"
            else:
                fast_device = (
                    device.type == "cuda"
                    and dtype == torch.bfloat16
                    and device_capability(device)[0] == 9
                )
                usable = fast_device and self.experts.grouped_mm_refusal(device, dtype) is None
                path = "grouped_mm" if usable else "loop"
            self._expert_paths[key] = path
        return path

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts and combine weights of tokens `x`.

        Args:
            x: [tokens, H] in the experts' dtype.
        Returns:
            experts: int64 [tokens, top_k], by biased score descending, ties to the lower id.
            weights: [tokens, top_k] in the router's dtype (FP32), differentiable through the router.
        """
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(self.router.weight.dtype), self.router.weight)
        scores = torch.sigmoid(logits)
        with torch.no_grad():
            biased = scores + self.expert_bias
            experts = torch.sort(biased, dim=-1, descending=True, stable=True).indices
            experts = experts[:, : self.top_k]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Step5MoE: x must be a tensor; got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"Step5MoE: x must be [..., hidden_size={self.hidden_size}]; got {tuple(x.shape)}"
            )
        expert_dtype = self.experts.gate_proj.dtype
        if x.dtype != expert_dtype:
            raise TypeError(
                f"Step5MoE: x must have the experts' dtype ({expert_dtype}); got {x.dtype}"
            )
        flat = x.reshape(-1, self.hidden_size)
        tokens, top_k = flat.shape[0], self.top_k
        shared = self.shared_expert(flat)
        if tokens == 0:
            self._record_counts(torch.zeros_like(self.pending_expert_counts))
            return shared.reshape(x.shape)

        experts, weights = self.route(flat)
        # dispatch: the (token, expert) pairs sorted by expert once; pair p = token * top_k + slot
        sorted_experts, order = torch.sort(experts.reshape(-1), stable=True)
        inverse = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=order.device)
        )
        expert_ids = torch.arange(self.num_experts, device=x.device)
        expert_ends = torch.searchsorted(sorted_experts, expert_ids, right=True)
        self._record_counts(torch.diff(expert_ends, prepend=expert_ends.new_zeros(1)))
        rows = _GatherRows.apply(flat, order // top_k, inverse, top_k)

        if self.expert_path(x.device, x.dtype) == "grouped_mm":
            routed = self.experts.forward_grouped(rows, expert_ends)
        else:
            routed = self.experts.forward_loop(rows, expert_ends)

        # combine in token order: shared + Σ_k w_k · y_k as one [1, top_k] @ [top_k, H] per token
        routed = _GatherRows.apply(routed, inverse, order, 1).view(tokens, top_k, -1)
        out = torch.baddbmm(shared.unsqueeze(1), weights.to(x.dtype).unsqueeze(1), routed)
        return out.reshape(x.shape)

    def _record_counts(self, counts: torch.Tensor) -> None:
        self.last_expert_counts = counts.detach()
        if self.training:
            self.pending_expert_counts += self.last_expert_counts

    @torch.no_grad()
    def update_expert_bias(self, rate: float, counts: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing: `expert_bias += rate · sign(mean(counts) − counts)`.

        Overloaded experts (above the mean count) lose `rate`, underloaded ones gain it. `counts`
        defaults to `pending_expert_counts`, which is then reset to zero. With data parallelism,
        all-reduce (sum) `pending_expert_counts` first so every rank applies the same step. Recomputing
        a checkpointed forward adds its counts again; when every micro-batch is recomputed alike the
        counts scale and the sign step is unchanged.

        Args:
            rate: step size γ (>= 0).
            counts: optional [E] per-expert pair counts (any real dtype).
        """
        if (
            isinstance(rate, bool)
            or not isinstance(rate, numbers.Real)
            or not math.isfinite(rate)
            or rate < 0
        ):
            raise ValueError(
                f"Step5MoE.update_expert_bias: rate must be a finite float >= 0; got {rate!r}"
            )
        pending = counts is None
        if pending:
            counts = self.pending_expert_counts
        elif not isinstance(counts, torch.Tensor) or counts.shape != (self.num_experts,):
            shape = (
                tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
            )
            raise ValueError(
                f"Step5MoE.update_expert_bias: counts must be [num_experts={self.num_experts}]; got {shape}"
            )
        load = counts.to(device=self.expert_bias.device, dtype=self.expert_bias.dtype)
        self.expert_bias.add_(torch.sign(load.mean() - load), alpha=float(rate))
        if pending:
            self.pending_expert_counts.zero_()

    def extra_repr(self) -> str:
        return (
            f"top_k={self.top_k}, routed_scaling_factor={self.routed_scaling_factor}, "
            f"norm_topk_prob={self.norm_topk_prob}, expert_backend={self.expert_backend!r}"
        )


def _router_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """FP32 routing, FP64 in an FP64 module (so FP64 references and gradcheck stay exact)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32
