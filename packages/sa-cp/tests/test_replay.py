"""Recompute replay: one routing decision per step under full and selective checkpointing."""

import functools
import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from sa_cp import (
    RecomputeReplay,
    RecomputeReplayRecorder,
    ReplayBinding,
    checkpoint_context_fn,
    route_selection_region,
)
from sa_cp.testing import TOY_ROUTES as ROUTES
from sa_cp.testing import ToyRoutedLayer


def mm_policy(ctx, op, *args, **kwargs):
    mms = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in mms else CheckpointPolicy.PREFER_RECOMPUTE


CONTEXTS = {
    "no-checkpoint": None,
    "full-no-replay": lambda: None,
    "full-replay": lambda: checkpoint_context_fn(None, ROUTES),
    "selective-no-replay": lambda: functools.partial(
        create_selective_checkpoint_contexts, mm_policy
    ),
    "selective-replay": lambda: checkpoint_context_fn(
        functools.partial(create_selective_checkpoint_contexts, mm_policy), ROUTES
    ),
}


def make_stack(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList([ToyRoutedLayer(16, 5) for _ in range(3)])


def run_stack(layers: nn.ModuleList, x: torch.Tensor, mode: str) -> torch.Tensor:
    for layer in layers:
        if mode == "no-checkpoint":
            x = layer(x)
        else:
            context_fn = CONTEXTS[mode]()
            kwargs = {"context_fn": context_fn} if context_fn is not None else {}
            x = checkpoint(layer, x, use_reentrant=False, **kwargs)
    return x


def loss_and_grads(mode: str, x: torch.Tensor, flip_before_backward: bool = False):
    layers = make_stack()
    x = x.clone().requires_grad_(True)
    loss = run_stack(layers, x, mode).square().mean()
    if flip_before_backward:
        for layer in layers:
            layer.flip_router = True
    loss.backward()
    grads = [x.grad] + [p.grad for p in layers.parameters()]
    return loss.detach(), grads, [layer.router_calls for layer in layers]


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randn(2, 12, 16)


@pytest.mark.parametrize(
    ("mode", "calls"),
    [
        ("no-checkpoint", 1),
        ("full-no-replay", 2),
        ("full-replay", 1),
        ("selective-no-replay", 2),
        ("selective-replay", 1),
    ],
)
def test_router_runs_once_per_step_with_replay(tokens, mode, calls):
    _, _, router_calls = loss_and_grads(mode, tokens)
    assert router_calls == [calls] * 3


@pytest.mark.parametrize(
    "mode", ["full-no-replay", "full-replay", "selective-no-replay", "selective-replay"]
)
def test_loss_and_every_gradient_bitwise_equal_to_no_checkpointing(tokens, mode):
    ref_loss, ref_grads, _ = loss_and_grads("no-checkpoint", tokens)
    loss, grads, _ = loss_and_grads(mode, tokens)
    assert torch.equal(loss, ref_loss)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert torch.equal(grad, ref)


@pytest.mark.parametrize("mode", ["full-replay", "selective-replay"])
def test_replay_keeps_the_forward_decision_when_recompute_would_differ(tokens, mode):
    ref_loss, ref_grads, _ = loss_and_grads("no-checkpoint", tokens)
    loss, grads, router_calls = loss_and_grads(mode, tokens, flip_before_backward=True)
    assert torch.equal(loss, ref_loss)
    assert router_calls == [1, 1, 1]
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert torch.equal(grad, ref)


def test_without_replay_a_changed_recompute_decision_changes_gradients(tokens):
    """The control for the test above: the flip really would change the result."""
    _, ref_grads, _ = loss_and_grads("no-checkpoint", tokens)
    _, grads, _ = loss_and_grads("full-no-replay", tokens, flip_before_backward=True)
    assert not all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


@pytest.mark.parametrize("mode", ["full-replay", "selective-replay"])
def test_interleaved_microbatches_never_share_a_log(mode):
    torch.manual_seed(1)
    batches = [torch.randn(2, 12, 16), torch.randn(2, 12, 16)]
    expected = [loss_and_grads("no-checkpoint", x)[1] for x in batches]
    layers = make_stack()
    inputs = [x.clone().requires_grad_(True) for x in batches]
    losses = [run_stack(layers, x, mode).square().mean() for x in inputs]
    for index in (1, 0):  # backward in the opposite order of the forwards
        layers.zero_grad()
        losses[index].backward()
        grads = [inputs[index].grad] + [p.grad for p in layers.parameters()]
        for grad, ref in zip(grads, expected[index], strict=True):
            assert torch.equal(grad, ref)
    assert [layer.router_calls for layer in layers] == [2, 2, 2]


def test_recorder_counts_misses_and_rewinds():
    recorder = RecomputeReplayRecorder()
    recorder.record("a")
    recorder.record("b")
    assert [recorder.take(), recorder.take(), recorder.take()] == ["a", "b", None]
    assert recorder.replay_misses == 1
    recorder.rewind()
    assert recorder.take() == "a"


def test_replay_miss_recomputes_instead_of_failing(tokens):
    layer = make_stack()[0]
    recorder = RecomputeReplayRecorder()
    with ROUTES.scope(recorder, "replay"):
        out = layer(tokens)
    assert recorder.replay_misses == 1
    assert layer.router_calls == 1
    torch.testing.assert_close(out, make_stack()[0](tokens), rtol=0, atol=0)


def test_scopes_nest_and_restore():
    outer, inner = RecomputeReplayRecorder(), RecomputeReplayRecorder()
    assert ROUTES.current() is None
    with ROUTES.scope(outer, "record"):
        assert ROUTES.current() == ReplayBinding(outer, "record")
        with ROUTES.scope(inner, "replay"):
            assert ROUTES.current() == ReplayBinding(inner, "replay")
        assert ROUTES.current().recorder is outer
    assert ROUTES.current() is None


def test_binding_is_thread_local():
    seen = []
    with ROUTES.scope(RecomputeReplayRecorder(), "record"):
        thread = threading.Thread(target=lambda: seen.append(ROUTES.current()))
        thread.start()
        thread.join()
    assert seen == [None]


def test_channels_are_independent():
    other = RecomputeReplay("other")
    with ROUTES.scope(RecomputeReplayRecorder(), "record"):
        assert other.current() is None


@pytest.mark.parametrize("mode", ["replay ", "Record", "", None])
def test_bad_mode_raises_value_error(mode):
    with (
        pytest.raises(ValueError, match="mode must be 'record' or 'replay'"),
        ROUTES.scope(RecomputeReplayRecorder(), mode),
    ):
        pass


def test_checkpoint_context_fn_rejects_non_channels():
    with pytest.raises(TypeError, match="RecomputeReplay"):
        checkpoint_context_fn(None, "routes")
    with pytest.raises(TypeError, match="channels come after it"):
        checkpoint_context_fn(ROUTES)  # the channel passed where the context factory goes
    with pytest.raises(TypeError, match="context_fn must be None or a factory"):
        checkpoint_context_fn("policy", ROUTES)


@pytest.mark.parametrize("recorder", [None, "recorder"])
def test_scope_rejects_a_recorder_of_another_type(recorder):
    with (
        pytest.raises(TypeError, match="recorder must be a RecomputeReplayRecorder"),
        ROUTES.scope(recorder, "record"),
    ):
        pass


def test_channel_method_composes_with_an_existing_context_factory(tokens):
    entered = []

    class Marker:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            return False

    layer = make_stack()[0]
    context_fn = ROUTES.checkpoint_context_fn(lambda: (Marker("forward"), Marker("recompute")))
    x = tokens.clone().requires_grad_(True)
    checkpoint(layer, x, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert entered == ["forward", "recompute"]
    assert layer.router_calls == 1


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_route_selection_region_hides_ops_from_dispatch_modes(tokens):
    with OpLog() as log:
        with route_selection_region():
            tokens.sum(-1).topk(3)
        assert torch.ops.aten.topk.default not in log.ops
        tokens.sum(-1).topk(3)
    assert torch.ops.aten.topk.default in log.ops


def test_a_copied_channel_starts_unbound_and_keeps_its_name():
    import copy
    import pickle

    channel = RecomputeReplay("routes")
    with channel.scope(RecomputeReplayRecorder(), "record"):
        for clone in (copy.deepcopy(channel), pickle.loads(pickle.dumps(channel))):
            assert clone.name == "routes" and clone.current() is None
        assert channel.current() is not None
