"""Overhead of recompute replay on a toy routed stack: fwd+bwd time with checkpointing, replay on vs off.

    python packages/sa-cp/benchmarks/bench_replay.py [--quick] [--json PATH] [--device cpu|cuda]

The router is made deliberately costly (top-k over a [tokens, tokens] score matrix) so that the time
replay saves is visible; the ratio column is each variant's time over "no checkpointing" in the same run.
"""

import argparse
import json
import statistics
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sa_cp import checkpoint_context_fn
from sa_cp.testing import TOY_ROUTES, ToyRoutedLayer


class CostlyRouter(ToyRoutedLayer):
    def select(self, x: torch.Tensor) -> torch.Tensor:
        self.router_calls += 1
        scores = (x @ x.transpose(1, 2)).amax(-1)
        return scores.topk(self.k, dim=-1).indices


def step(layers: nn.ModuleList, x: torch.Tensor, variant: str) -> None:
    h = x
    for layer in layers:
        if variant == "no-checkpoint":
            h = layer(h)
        elif variant == "checkpoint":
            h = checkpoint(layer, h, use_reentrant=False)
        else:
            h = checkpoint(
                layer, h, use_reentrant=False, context_fn=checkpoint_context_fn(None, TOY_ROUTES)
            )
    h.square().mean().backward()


def time_ms(fn, device: str, repeats: int) -> float:
    times = []
    for index in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= 2:  # warm-up
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    batch, tokens, dim, layers_n = (2, 512, 64, 4) if args.quick else (4, 2048, 128, 8)
    torch.manual_seed(0)
    layers = nn.ModuleList([CostlyRouter(dim, 64) for _ in range(layers_n)]).to(args.device)
    x = torch.randn(batch, tokens, dim, device=args.device, requires_grad=True)
    rows = []
    for variant in ("no-checkpoint", "checkpoint", "checkpoint+replay"):
        ms = time_ms(lambda v=variant: step(layers, x, v), args.device, 3 if args.quick else 10)
        layers[0].router_calls = 0
        step(layers, x, variant)  # one untimed step to count router calls
        calls = layers[0].router_calls
        rows.append(
            {
                "variant": variant,
                "device": args.device,
                "shape": [batch, tokens, dim, layers_n],
                "ms": ms,
                "router_calls_per_layer": calls,
            }
        )
    base = rows[0]["ms"]
    print(f"{'variant':<20}{'ms':>10}{'vs no-ckpt':>12}{'router calls/layer':>20}")
    for row in rows:
        row["ratio_vs_no_checkpoint"] = row["ms"] / base
        print(
            f"{row['variant']:<20}{row['ms']:>10.2f}{row['ratio_vs_no_checkpoint']:>12.3f}{row['router_calls_per_layer']:>20}"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=2)


if __name__ == "__main__":
    main()
