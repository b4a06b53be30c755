"""Test support, not part of the API: random sparse MLA problems and error measures for this package's
tests (`conftest.py` puts this folder on the import path)."""

from dataclasses import dataclass

import torch

from sa_mla.sparse_mla.reference import sparse_mla_reference_with_lse


@dataclass(frozen=True)
class SparseMlaProblem:
    """One random input set; `empty_rows` lists the rows given no valid id at all."""

    q: torch.Tensor
    kv_latent: torch.Tensor
    topk_indices: torch.Tensor
    softmax_scale: float
    topk_length: torch.Tensor | None
    attn_sink: torch.Tensor | None
    empty_rows: torch.Tensor

    def args(self) -> tuple:
        """Positional arguments of every public function (hints left at their defaults)."""
        return (self.q, self.kv_latent, self.topk_indices, self.softmax_scale, self.topk_length)

    def grad_inputs(self) -> list[torch.Tensor]:
        """The differentiable inputs: q, kv_latent and, when there is one, attn_sink."""
        return [self.q, self.kv_latent] + ([self.attn_sink] if self.attn_sink is not None else [])


def random_problem(
    tokens: int,
    heads: int,
    head_dim: int,
    keys: int,
    width: int,
    *,
    sink: bool = False,
    lengths: bool = False,
    invalid: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    requires_grad: bool = True,
) -> SparseMlaProblem:
    """Fresh random q, kv, ids. With `invalid`: ~10% -1 ids, ~5% ids >= keys, duplicated slots, and every
    fifth row (from row 1) without a valid id. With `lengths`: random per-row `topk_length` in [0, width + 2]."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    kv = torch.randn(keys, 1, head_dim, generator=gen).to(device=device, dtype=dtype)
    ids = torch.randint(0, keys, (tokens, 1, width), generator=gen, dtype=torch.int32)
    empty = torch.zeros(tokens, dtype=torch.bool)
    if invalid:
        draw = torch.rand(tokens, 1, width, generator=gen)
        ids = torch.where(draw < 0.10, -1, ids)
        ids = torch.where((draw >= 0.10) & (draw < 0.15), keys + (ids % 7), ids)
        if width > 2:
            ids[:, :, 1] = ids[:, :, 0]  # a duplicated slot in every row
        empty[1::5] = True
        ids[empty] = torch.where(torch.arange(width) % 2 == 0, -1, keys + 3).to(torch.int32)
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, width + 3, (tokens,), generator=gen, dtype=torch.int32).to(
            device
        )
    attn_sink = None
    if sink:
        sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        attn_sink = (torch.randn(heads, generator=gen) * 2).to(device=device, dtype=sink_dtype)
    if requires_grad:
        q.requires_grad_()
        kv.requires_grad_()
        if attn_sink is not None:
            attn_sink.requires_grad_()
    return SparseMlaProblem(
        q,
        kv,
        ids.to(device),
        head_dim**-0.5,
        topk_length,
        attn_sink,
        empty.nonzero().flatten().to(device),
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in FP64 (0 when both are zero)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


def errors_against_oracle(fn, problem: SparseMlaProblem, **hints) -> dict[str, float]:
    """Run `fn` forward and backward on `problem` and return relative errors against the FP32 oracle
    (computed from the same rounded inputs): keys out, dq, dkv and, with a sink, dsink.

    Also asserts what holds exactly: finite results, rows without a valid id output zero and get zero dq.
    """
    p = problem
    inputs = p.grad_inputs()
    oracle_inputs = [t.detach().float().requires_grad_() for t in inputs]
    out = fn(*p.args(), attn_sink=p.attn_sink, **hints)
    sink = oracle_inputs[2] if p.attn_sink is not None else None
    expected, _ = sparse_mla_reference_with_lse(
        oracle_inputs[0], oracle_inputs[1], p.topk_indices, p.softmax_scale, p.topk_length, sink
    )
    gen = torch.Generator(device="cpu").manual_seed(1234)
    dout = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, inputs, dout)
    expected_grads = torch.autograd.grad(expected, oracle_inputs, dout.float())
    assert torch.isfinite(out).all(), "output has non-finite values"
    assert all(torch.isfinite(g).all() for g in grads), "a gradient has non-finite values"
    if p.empty_rows.numel():
        assert torch.all(out[p.empty_rows] == 0), "a row without valid ids has a non-zero output"
        assert torch.all(grads[0][p.empty_rows] == 0), "a row without valid ids has a non-zero dq"
    names = ["out", "dq", "dkv", "dsink"]
    values = [out, *grads]
    references = [expected, *expected_grads]
    errors = {n: relative_error(v, r) for n, v, r in zip(names, values, references, strict=False)}
    if p.attn_sink is not None:
        # d_sink[h] = -sum_t w[t, h] * delta[t, h]: also its error against the norm of those terms.
        _, lse = sparse_mla_reference_with_lse(
            oracle_inputs[0].detach(),
            oracle_inputs[1].detach(),
            p.topk_indices,
            p.softmax_scale,
            p.topk_length,
            None,
        )
        weight = torch.sigmoid(sink.detach()[None, :] - lse).nan_to_num(0.0)
        terms = (weight * (dout.float() * expected.detach()).sum(-1)).abs().sum(0)
        errors["dsink_vs_terms"] = (
            grads[2].double() - expected_grads[2].double()
        ).norm().item() / max(terms.double().norm().item(), 1e-30)
    return errors
