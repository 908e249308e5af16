"""The observer layer's cheap hot path keeps what the findings need: the call site (taken as
code + line, made text at report), the module path (read off the frames), and for a call made
in backward the forward call whose node runs it (the node's metadata)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from opcontracts._engine.callsite import find_call_site, site_of, site_token
from opcontracts._observers import layer


def test_the_cheap_call_site_is_the_same_line_as_the_full_lookup() -> None:
    frame = sys._getframe(0)
    assert site_of(site_token(frame)) == find_call_site(frame)
    assert site_of(None) is None


Seen = list[tuple[str | None, str | None]]


class Leaf(nn.Module):
    """Records the module path the tracker reads while it runs."""

    def __init__(self, seen: Seen) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(layer.module_name(layer._modules.snapshot()))
        return x


class Block(nn.Module):
    def __init__(self, seen: Seen) -> None:
        super().__init__()
        self.mlp = Leaf(seen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def test_module_path_from_the_frames_names_leaf_under_root() -> None:
    seen: Seen = []

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(seen), Block(seen)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.layers:
                x = b(x)
            return x

    was = layer._modules.running
    layer._modules.start()
    try:
        Root()(torch.zeros(1))
        outside = layer._modules.snapshot()
    finally:
        if not was:
            layer._modules.stop()
    assert seen == [("layers.0.mlp", "Leaf"), ("layers.1.mlp", "Leaf")]
    assert outside is None


def test_a_leaf_keeps_the_root_it_was_first_seen_under_until_tracking_restarts() -> None:
    import gc

    seen: Seen = []
    Root = Block  # a root with one leaf, ``mlp``

    tracker = layer._modules
    was = tracker.running
    tracker.start()
    try:
        root = Root(seen)
        root(torch.zeros(1))
        root.mlp(torch.zeros(1))  # called on its own (a recompute): the path it had
        assert id(root.mlp) in tracker._roots
        tracker.stop()
        tracker.start()  # forgotten: now first seen on its own
        root.mlp(torch.zeros(1))
        root(torch.zeros(1))
        leaf_id = id(root.mlp)
        del root
        gc.collect()
        assert leaf_id not in tracker._roots  # an entry leaves with its module
    finally:
        if not was:
            tracker.stop()
    assert seen == [("mlp", "Leaf"), ("mlp", "Leaf"), ("", "Leaf"), ("", "Leaf")]


def test_a_call_in_backward_finds_its_forward_call_in_the_running_node() -> None:
    found: list[object] = []

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            found.append(layer._context())
            return g * 2

    x = torch.randn(3, requires_grad=True)
    y = F.apply(x)
    marker = layer.Call("op", lambda: None, (), {}, "forward", 0, None)
    layer._mark(marker, layer._output_nodes(y))
    inner = layer.Call("inner", lambda: None, (), {}, "forward", 1, None)
    layer._mark(inner, layer._output_nodes(y))  # the innermost call sharing the node wins
    layer._mark(marker, layer._output_nodes(y))
    y.sum().backward()
    assert found == [inner]
    assert layer._context() is None  # outside any node


def test_a_call_lists_its_outputs_once_and_keeps_no_tensor_after_it(npu: Any) -> None:
    # ``Call.outputs`` is ``outputs(out)`` (the same tensors, named) while the observers and the
    # layer's hooks run, and dropped with the arguments when the call returns
    seen: list[tuple[layer.Call, list[str], bool]] = []

    class Keep(layer.Observer):
        def begin(self, call: layer.Call) -> Any:
            return True

        def end(self, call: layer.Call, state: Any, out: Any) -> None:
            want = layer.outputs(out)
            same = len(want) == len(call.outputs) and all(
                a is b for (_, a), (_, b) in zip(call.outputs, want))
            seen.append((call, [n for n, _ in call.outputs], same))

    obs = Keep()
    layer.attach(obs)
    try:
        npu.npu_moe_token_permute(torch.randn(8, 4, dtype=torch.bfloat16),
                                  torch.randint(0, 4, (8, 2)))
    finally:
        layer.detach(obs)
    ((call, names, same),) = seen
    assert names == ["output[0]", "output[1]"] and same
    assert call.outputs == [] and call.inputs == [] and call.args is None and call.kwargs is None
