"""Test support shared across packages: a toy routed layer, and a function run on N gloo ranks.

Run a function on N real gloo ranks (forked CPU processes) and collect each rank's result.

For tests across packages: `results = run_on_ranks(2, fn, *args)` calls `fn(rank, world_size, *args)`
in every rank with the default process group initialised, and returns the ranks' return values in rank
order. A failure on any rank is raised here with that rank's traceback.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue as queue_module
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .replay import RecomputeReplay


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    fn: Callable,
    args: tuple,
    queue: Any,
) -> None:
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size
        )
        try:
            # Serialised here: tensors sent as shared memory would die with this process.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            queue.put((rank, "ok", buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """`[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]`, each on its own rank.

    backend "gloo": forked CPU processes, so `fn` may be defined anywhere, a test module included.
    backend "nccl": spawned processes, rank r on `cuda:r`; CUDA cannot survive a fork, so `fn` and
    `args` must be importable / picklable in a fresh interpreter. Results come back on the CPU.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_on_ranks: backend must be 'gloo' or 'nccl'; got {backend!r}")
    context = multiprocessing.get_context("fork" if backend == "gloo" else "spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(
                target=_rank_main, args=(rank, world_size, store, backend, fn, args, queue)
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                try:
                    rank, status, payload = queue.get(timeout=timeout)
                except queue_module.Empty:
                    errors.append(
                        f"no answer from {world_size - len(results)} rank(s) within {timeout} s"
                    )
                    break
                if status == "ok":
                    results[rank] = torch.load(
                        io.BytesIO(payload), weights_only=False, map_location="cpu"
                    )
                else:
                    errors.append(f"rank {rank}:\n{payload}")
                    break
        finally:
            for process in processes:
                process.join(timeout=5 if errors else timeout)
                if process.is_alive():
                    process.kill()
    if errors:
        raise RuntimeError("run_on_ranks: a rank failed\n" + "\n".join(errors))
    return [results[rank] for rank in range(world_size)]


TOY_ROUTES: RecomputeReplay[torch.Tensor] = RecomputeReplay("toy-routes")


class ToyRoutedLayer(nn.Module):
    """Picks `k` token ids per batch row from its input, then attends over the picked tokens.

    The routed-layer pattern of `sa_cp.replay` in its smallest form, for tests and benchmarks.
    """

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.k = k
        self.router_calls = 0
        self.flip_router = False  # makes a recompute decide differently from the forward

    def select(self, x: torch.Tensor) -> torch.Tensor:
        self.router_calls += 1
        scores = x.sum(-1)
        return (-scores if self.flip_router else scores).topk(self.k, dim=-1).indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = TOY_ROUTES.select_or_replay(lambda: self.select(x))
        h = self.proj(x)
        picked = h.gather(1, ids[..., None].expand(-1, -1, h.size(-1)))
        return x + torch.softmax(h @ picked.transpose(1, 2), dim=-1) @ picked
