"""Recompute replay: routes chosen once in the forward are replayed when checkpointing reruns a layer.

A routed layer follows one pattern (SEMANTICS §4), which `RecomputeReplay.select_or_replay` implements::

    binding = ROUTES.current()
    entry = binding.recorder.take() if binding is not None and binding.mode == "replay" else None
    if entry is None:
        with route_selection_region(), torch.no_grad():
            entry = select_routes(...)
        if binding is not None and binding.mode == "record":
            binding.recorder.record(entry)

`checkpoint_context_fn` wires channels into `torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
context_fn=...)`: each checkpointed call gets a fresh recorder, its forward records, its recompute
rewinds and replays. A replay miss (no entry left) is counted and the layer recomputes: never wrong.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

T = TypeVar("T")
ReplayMode = Literal["record", "replay"]
ContextFactory = Callable[
    [], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]
]
_MODES = ("record", "replay")


@dataclass
class RecomputeReplayRecorder(Generic[T]):
    """The decisions of one checkpointed call, in the order its forward made them."""

    entries: list[T] = field(default_factory=list)
    cursor: int = 0
    replay_misses: int = 0

    def record(self, entry: T) -> None:
        self.entries.append(entry)

    def take(self) -> T | None:
        """The next recorded entry, or `None` (counted in `replay_misses`) when none is left."""
        if self.cursor >= len(self.entries):
            self.replay_misses += 1
            return None
        entry = self.entries[self.cursor]
        self.cursor += 1
        return entry

    def rewind(self) -> None:
        self.cursor = 0


@dataclass(frozen=True)
class ReplayBinding(Generic[T]):
    """What `RecomputeReplay.current()` returns inside a scope."""

    recorder: RecomputeReplayRecorder[T]
    mode: ReplayMode


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"RecomputeReplay.scope: mode must be 'record' or 'replay'; got {mode!r}")


class RecomputeReplay(Generic[T]):
    """A named channel with a thread-local (recorder, mode) binding; scopes nest and restore."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"RecomputeReplay({self.name!r})"

    def __getstate__(self) -> dict:
        # Bindings are per thread and per call: a copied or pickled channel (a deep-copied model,
        # a model sent to another process) starts unbound.
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.name = state["name"]
        self._local = threading.local()

    def _stack(self) -> list[ReplayBinding[T]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self) -> ReplayBinding[T] | None:
        """The innermost binding on this thread, or `None` outside any scope."""
        stack = self._stack()
        return stack[-1] if stack else None

    @contextlib.contextmanager
    def scope(
        self, recorder: RecomputeReplayRecorder[T], mode: ReplayMode
    ) -> Iterator[ReplayBinding[T]]:
        """Bind `recorder` in `mode` ("record" or "replay") on this thread for the body."""
        if not isinstance(recorder, RecomputeReplayRecorder):
            raise TypeError(
                f"RecomputeReplay.scope: recorder must be a RecomputeReplayRecorder; got "
                f"{type(recorder).__name__}"
            )
        _check_mode(mode)
        binding = ReplayBinding(recorder, mode)
        stack = self._stack()
        stack.append(binding)
        try:
            yield binding
        finally:
            stack.pop()

    def select_or_replay(self, select: Callable[[], T]) -> T:
        """The routed-layer pattern: the recorded entry in replay mode, else `select()` (recorded in record mode).

        `select` runs under `no_grad` inside `route_selection_region()`; a replay miss (no entry left) is
        counted by the recorder and selects again, so a miss is never wrong.
        """
        binding = self.current()
        entry = (
            binding.recorder.take() if binding is not None and binding.mode == "replay" else None
        )
        if entry is None:
            with route_selection_region(), torch.no_grad():
                entry = select()
            if binding is not None and binding.mode == "record":
                binding.recorder.record(entry)
        return entry

    def checkpoint_context_fn(self, context_fn: ContextFactory | None = None) -> ContextFactory:
        """A `context_fn` for `torch.utils.checkpoint.checkpoint` that records and replays this channel."""
        return checkpoint_context_fn(context_fn, self)


@contextlib.contextmanager
def _recompute_scope(channel: RecomputeReplay, recorder: RecomputeReplayRecorder) -> Iterator[None]:
    recorder.rewind()  # a recompute may run more than once (retain_graph): always replay from the start
    with channel.scope(recorder, "replay"):
        yield


def checkpoint_context_fn(
    context_fn: ContextFactory | None = None, *channels: RecomputeReplay
) -> ContextFactory:
    """Compose `channels` (and an existing `context_fn`, e.g. selective checkpointing's) into one factory.

    Args:
        context_fn: `None`, or a factory returning `(forward_context, recompute_context)` such as
            `functools.partial(create_selective_checkpoint_contexts, policy)`.
        channels: the replay channels to record in the forward and replay in the recompute.
    Returns:
        A factory for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`.
        Each call (one per checkpointed call) binds fresh recorders.
    """
    if context_fn is not None and (
        isinstance(context_fn, RecomputeReplay) or not callable(context_fn)
    ):
        raise TypeError(
            "checkpoint_context_fn: context_fn must be None or a factory returning (forward, "
            f"recompute) contexts (channels come after it); got {type(context_fn).__name__}"
        )
    for channel in channels:
        if not isinstance(channel, RecomputeReplay):
            raise TypeError(
                f"checkpoint_context_fn: channels must be RecomputeReplay; got {type(channel).__name__}"
            )

    def factory() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        recorders = [RecomputeReplayRecorder() for _ in channels]
        inner_forward, inner_recompute = context_fn() if context_fn is not None else (None, None)

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            with contextlib.ExitStack() as stack:
                for channel, recorder in zip(channels, recorders, strict=True):
                    stack.enter_context(channel.scope(recorder, "record"))
                if inner_forward is not None:
                    stack.enter_context(inner_forward)
                yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            with contextlib.ExitStack() as stack:
                for channel, recorder in zip(channels, recorders, strict=True):
                    stack.enter_context(_recompute_scope(channel, recorder))
                if inner_recompute is not None:
                    stack.enter_context(inner_recompute)
                yield

        return forward(), recompute()

    return factory


@contextlib.contextmanager
def route_selection_region() -> Iterator[None]:
    """Run the body outside every active TorchDispatch mode.

    Selective checkpointing caches op outputs by op sequence; route selection runs in the forward but is
    replayed (skipped) in the recompute, so its ops must not be seen by those modes.
    """
    with _disable_current_modes():
        yield
