"""Test support for the distillation tests (not part of the package): seeded generators and the
loss-and-gradients-equal-the-oracle check."""

from __future__ import annotations

import torch


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_matches_oracle(loss, grads, oracle, oracle_grads, rtol: float = 2e-5) -> None:
    """`loss` equals the float64 `oracle` to `rtol`; each gradient to `rtol` of its largest value."""
    assert oracle.item() > 0  # the case has sparse queries with a real target
    torch.testing.assert_close(loss.double(), oracle, rtol=rtol, atol=1e-7)
    for got, want in zip(grads, oracle_grads, strict=True):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=rtol * scale + 1e-9)
