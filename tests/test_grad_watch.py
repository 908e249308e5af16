"""How the observer layer watches a guarded call's gradients (``_observers.layer``): a one-node
op (a fused kernel's autograd node wired straight to its inputs) is probed at its first watched
call and hooked on its node afterwards; any other op stays probed; either way an observer gets
exactly the gradients the op sends to each of its inputs and those flowing into its outputs."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _broken_kernels import NanGrad
from _guarded_module import guarded_module

from opcontracts import Arg, Contract
from opcontracts._observers import layer
from opcontracts.nan import NanSentinel

MOD = "grad_watch_ops"


class _Scale(torch.autograd.Function):
    """One node: (a, b) -> 3a + 5b, so the gradient sent to each argument differs."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return 3 * a + 5 * b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return 3 * g, 5 * g


def _fused(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _Scale.apply(a, b)


def _composite(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (3 * a + 5 * b).sin()  # several nodes: its output node is not wired to a and b


_branch = {"composite": False}


def _changing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # (not through _fused / _composite: the patch rebinds those names to their guards)
    return (3 * a + 5 * b).sin() if _branch["composite"] else _Scale.apply(a, b)


def _wrapper(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A guarded wrapper calling a guarded kernel with its own arguments (MindSpeed over
    torch_npu): the kernel's node is the wrapper's too."""
    return sys.modules[MOD].fused(a, b)


def _bad_backward(x: torch.Tensor) -> torch.Tensor:
    return NanGrad.apply(x)


@pytest.fixture
def ops() -> Iterator[types.ModuleType]:
    names = ("fused", "composite", "changing", "wrapper", "bad_backward")
    contracts = [Contract(f"g.{n}", {"a": Arg("fp32")} if n != "bad_backward" else
                          {"x": Arg("fp32")}, targets=[f"{MOD}.{n}"], source="test")
                 for n in names]
    with guarded_module(MOD, {n: globals()[f"_{n}"] for n in names}, contracts) as mod:
        _branch["composite"] = False
        yield mod


class Recorder(layer.Observer):
    """Every gradient the layer hands over, per call."""

    grads = True

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def begin(self, call: layer.Call) -> Any:
        rec: dict[str, Any] = {"op": call.op, "in": None, "out": {}}
        self.calls.append(rec)
        return rec

    def grad_output(self, call: layer.Call, state: Any, label: str, position: int,
                    grad: torch.Tensor) -> None:
        state["out"][label] = grad.clone()

    def grad_inputs(self, call: layer.Call, state: Any, grads: tuple[Any, ...]) -> None:
        state["in"] = {layer.arg_name(call.fn, k): g.clone() for k, g in
                       zip(call.grad_keys, grads) if g is not None}


def _probed(t: torch.Tensor) -> bool:
    """Whether a probe node is anywhere in ``t``'s graph."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if type(n).__name__ == "_GradProbeBackward":
            return True
        stack.extend(m for m, _ in n.next_functions)
    return False


def _step(fn: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``fn(a, b)`` inside a graph where a and b also feed other ops (so that a hook on the
    tensors would see the sum over consumers); returns (the output, whether it was probed)."""
    a1, b1 = a * 1, b * 1
    out = fn(a1, b1)
    ((out * 7).sum() + (a1 * 11).sum() + b1.sum()).backward()
    return out, _probed(out)


@pytest.fixture
def rec() -> Iterator[Recorder]:
    r = Recorder()
    layer.attach(r)
    try:
        yield r
    finally:
        layer.detach(r)


def test_a_one_node_op_is_probed_once_then_hooked_with_the_same_gradients(
        ops: types.ModuleType, rec: Recorder) -> None:
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    probed = [_step(ops.fused, a, b)[1] for _ in range(3)]
    assert probed == [True, False, False]  # learned at the first call
    seven = torch.full((2, 3), 7.0)
    for call in rec.calls:
        assert torch.equal(call["out"]["output"], seven)
        # what the op sends to each argument, not the sum over the tensors' consumers
        assert torch.equal(call["in"]["a"], 3 * seven) and torch.equal(call["in"]["b"], 5 * seven)
    assert layer.unwatched() == 0


def test_the_same_tensor_as_two_arguments_keeps_each_arguments_gradient(
        ops: types.ModuleType, rec: Recorder) -> None:
    x = torch.randn(4, requires_grad=True)
    for _ in range(3):
        x1 = x * 1
        ops.fused(x1, x1).sum().backward()
    assert len(rec.calls) == 3
    for call in rec.calls:
        assert torch.equal(call["in"]["a"], torch.full((4,), 3.0))
        assert torch.equal(call["in"]["b"], torch.full((4,), 5.0))


def test_a_leaf_input_is_matched_by_its_accumulator(ops: types.ModuleType, rec: Recorder) -> None:
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    for _ in range(2):
        ops.fused(a, b).sum().backward()
    assert [c["in"]["b"].tolist() for c in rec.calls] == [[5.0] * 3] * 2
    assert torch.equal(a.grad, torch.full((3,), 6.0))  # the job's gradients are untouched


def test_a_composite_op_stays_probed(ops: types.ModuleType, rec: Recorder) -> None:
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    probed = [_step(ops.composite, a, b)[1] for _ in range(3)]
    assert probed == [True, True, True]
    cos = torch.cos(3 * a + 5 * b).detach()
    for call in rec.calls:
        assert torch.allclose(call["in"]["a"], 21 * cos) and torch.allclose(call["in"]["b"], 35 * cos)


def test_an_op_whose_graph_changes_is_unwatched_once_then_probed(
        ops: types.ModuleType, rec: Recorder) -> None:
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    before = layer.unwatched()
    assert [_step(ops.changing, a, b)[1] for _ in range(2)] == [True, False]
    _branch["composite"] = True
    assert _step(ops.changing, a, b)[1] is False  # ran unprobed: the node is not one node now
    assert layer.unwatched() == before + 1
    assert rec.calls[2]["in"] is None and "output" in rec.calls[2]["out"]  # outputs still seen
    assert _step(ops.changing, a, b)[1] is True  # probed from now on
    cos = torch.cos(3 * a + 5 * b).detach()
    assert torch.allclose(rec.calls[3]["in"]["a"], 21 * cos)


def test_a_wrapper_over_a_guarded_kernel_shares_its_node(ops: types.ModuleType,
                                                          rec: Recorder) -> None:
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    probed = [_step(ops.wrapper, a, b)[1] for _ in range(3)]
    assert probed == [True, False, False]  # the kernel's probe is seen through at the first
    assert [c["op"] for c in rec.calls] == ["g.wrapper", "g.fused"] * 3
    seven = torch.full((2, 3), 7.0)
    for call in rec.calls:  # both calls get the kernel's own gradients, every step
        assert torch.equal(call["in"]["a"], 3 * seven) and torch.equal(call["in"]["b"], 5 * seven)
        assert torch.equal(call["out"]["output"], seven)


def test_the_sentinel_names_a_backward_culprit_on_every_step(ops: types.ModuleType) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    firsts = []
    for _ in range(3):
        with NanSentinel() as s:
            y = ops.bad_backward(x * 1)
            probed = _probed(y)
            y.sum().backward()
        e = s.result().first
        assert e is not None
        firsts.append((e.op, e.kind, e.arg, e.nan, probed))
    # the layer forgets what it learned when the last observer leaves: each sentinel probes
    assert firsts == [("g.bad_backward", "input_grad", "x", 12, True)] * 3
    with NanSentinel() as s:
        for _ in range(3):
            y = ops.bad_backward(x * 1)
            probed = _probed(y)
            y.sum().backward()
    r = s.result()
    assert not probed and r.first is not None and r.first.kind == "input_grad"
    assert len(r.events) == 3 and {e.arg for e in r.events} == {"x"}


def test_nothing_learned_outlives_the_layer(ops: types.ModuleType) -> None:
    a = torch.randn(3, requires_grad=True)
    r = Recorder()
    layer.attach(r)
    try:
        ops.fused(a, a * 1).sum().backward()
        assert layer._dispatch.one_node
    finally:
        layer.detach(r)
    assert not layer._dispatch.one_node
