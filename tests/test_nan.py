"""The NaN sentinel (``opcontracts.nan``) on small synthetic guarded ops.

Each test guards the functions of a throw-away module (``nan_test_ops``) with contracts of its
own through ``opcontracts.patch``, exactly as the shipped contracts guard torch_npu; the
fixture takes the patch off and puts the process back as it found it.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _broken_kernels import NanGrad
from _guarded_module import guarded_module
from torch import nn

import opcontracts
import opcontracts.patch as patch
from opcontracts import Arg, Contract, nan
from opcontracts.nan import NanSentinel, NonFiniteError

MOD = "nan_test_ops"


def _good(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _bad_forward(x: torch.Tensor) -> torch.Tensor:
    return x / torch.zeros_like(x)  # inf (and NaN where x is 0)


def _bad_backward(x: torch.Tensor) -> torch.Tensor:
    return NanGrad.apply(x)


def _pair(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * scale, x.detach().clone()


@pytest.fixture
def ops() -> Iterator[types.ModuleType]:
    """``nan_test_ops`` with four guarded functions; patch and registry restored after."""
    fns = {"good": _good, "bad_forward": _bad_forward, "bad_backward": _bad_backward,
           "pair": _pair}
    with guarded_module(MOD, fns, [Contract(f"t.{name}", {"x": Arg("fp32")},
                                            targets=[f"{MOD}.{name}"], source="test")
                                   for name in fns]) as mod:
        yield mod


def _current(rec: Any) -> Any:
    if isinstance(rec.owner, type):
        return rec.owner.__dict__.get(rec.attr)
    return getattr(rec.owner, rec.attr)


class Inner(nn.Module):
    def __init__(self, fn: str) -> None:
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(sys.modules[MOD], self.fn)(self.lin(x))  # the guarded call


class Block(nn.Module):
    def __init__(self, fn: str) -> None:
        super().__init__()
        self.inner = Inner(fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Net(nn.Module):
    def __init__(self, fn: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block("good"), Block(fn)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


GUARDED_LINE = Inner.forward.__code__.co_firstlineno + 1


# --------------------------------------------------------------------------- off costs nothing
def test_off_means_nothing_is_wrapped(ops: types.ModuleType) -> None:
    from torch.nn.modules import module as mm

    records = patch.patched()
    assert records, "the fixture's contracts were not patched"
    before = [_current(r) for r in records]
    hooks = (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks))
    guard = ops.good
    assert not hasattr(guard, "__opcontracts_nan__")
    with NanSentinel():
        assert ops.good is not guard and ops.good.__wrapped__ is guard
        assert getattr(ops.good, "__opcontracts_nan__", False)
        assert ops.good.__name__ == guard.__name__
        # module paths are read off the frames: every module call keeps torch's fast path
        assert (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks)) == hooks
    after = [_current(r) for r in patch.patched()]
    assert all(a is b for a, b in zip(before, after))  # the patch's own objects, exactly
    assert ops.good is guard
    assert (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks)) == hooks
    assert nan.active() is None


def test_names_bound_by_from_import_are_rewrapped_and_restored(ops: types.ModuleType) -> None:
    user = types.ModuleType("nan_test_user")
    user.good = ops.good  # `from nan_test_ops import good` after the patch: the guard
    sys.modules[user.__name__] = user
    try:
        guard = ops.good
        with NanSentinel():
            assert user.good is ops.good and user.good is not guard
            late = types.ModuleType("nan_test_late")
            late.good = ops.good  # bound while the sentinel is on: the wrapper
            sys.modules[late.__name__] = late
        assert user.good is guard and late.good is guard
    finally:
        sys.modules.pop("nan_test_user", None)
        sys.modules.pop("nan_test_late", None)


def test_wrapper_kept_elsewhere_passes_through_when_off(ops: types.ModuleType) -> None:
    with NanSentinel() as s:
        kept = ops.bad_forward
    kept(torch.ones(2))  # the sentinel is off: no event, no error
    assert s.result().first is None and s.result().calls == 0


# --------------------------------------------------------------------------- forward
def test_forward_nan_names_op_argument_call_site_and_module(ops: types.ModuleType) -> None:
    net = Net("bad_forward")
    with NanSentinel() as s:
        net(torch.randn(3, 4))
    r = s.result()
    assert r.first is not None, r
    e = r.first
    assert (e.op, e.direction, e.kind, e.arg) == ("t.bad_forward", "forward", "output", "output")
    assert e.module == "blocks.1.inner" and e.module_type == "Inner"
    assert e.call_site is not None and e.call_site.endswith(f"test_nan.py:{GUARDED_LINE} in forward")
    assert e.inf + e.nan > 0 and e.shape == (3, 4) and e.dtype == "float32"
    assert "first non-finite value: forward, in t.bad_forward" in str(r)
    assert r.calls == 2
    assert r.to_dict()["first"]["module"] == "blocks.1.inner"


def test_nan_input_is_received_not_blamed(ops: types.ModuleType) -> None:
    x = torch.tensor([1.0, float("nan")])
    with NanSentinel() as s:
        ops.good(x)
    r = s.result()
    assert r.first is None and not r
    assert r.received is not None and r.received.op == "t.good" and r.received.arg == "x"
    assert r.received.kind == "received" and r.received.direction == "forward"


def test_raise_on_first(ops: types.ModuleType) -> None:
    with NanSentinel(on_nan="raise"), pytest.raises(NonFiniteError, match="t.bad_forward"):
        ops.bad_forward(torch.ones(2))


def test_warn_on_first(ops: types.ModuleType) -> None:
    with NanSentinel(on_nan="warn"), pytest.warns(RuntimeWarning, match="t.bad_forward"):
        ops.bad_forward(torch.ones(2))


# --------------------------------------------------------------------------- backward
def test_backward_nan_names_op_input_and_forward_place(ops: types.ModuleType) -> None:
    net = Net("bad_backward")
    x = torch.randn(3, 4, requires_grad=True)
    with NanSentinel() as s:
        out = net(x)
        assert s.result().first is None  # the forward pass is finite
        out.sum().backward()
    r = s.result()
    assert r.first is not None, r
    e = r.first
    assert (e.op, e.direction, e.kind, e.arg) == ("t.bad_backward", "backward", "input_grad", "x")
    assert e.module == "blocks.1.inner"
    assert e.call_site is not None and e.call_site.endswith(f"test_nan.py:{GUARDED_LINE} in forward")
    assert e.nan == 12 and "gradient of 'x'" in e.message()
    # downstream of the culprit (in backward order) every op receives NaN: not blamed
    assert [ev.op for ev in r.events] == ["t.bad_backward"]


def test_kept_tensors_are_bounded_and_an_uncounted_event_still_names_the_culprit(
        ops: types.ModuleType) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with NanSentinel(keep_bytes=0) as s:  # nothing kept until the read: flags only
        Net("bad_backward")(x).sum().backward()
    e = s.result().first
    assert e is not None and (e.op, e.kind, e.arg) == ("t.bad_backward", "input_grad", "x")
    assert not e.counted and e.nan == e.inf == -1 and e.shape == (3, 4)
    assert "NaN and inf not counted" in e.message()


def test_the_checks_are_read_at_step_and_at_each_optimizer_step(ops: types.ModuleType) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1)
    with NanSentinel(step_hook=True) as s:
        Net("good")(x).sum().backward()
        assert len(s._pending) > 0  # judged later: nothing was read at the calls
        opt.step()
        assert len(s._pending) == 0 and s.steps == 1 and s.first_bad_step is None
        Net("bad_backward")(x).sum().backward()
        assert s.step() and s.first_bad_step == 2


def test_a_bounded_backlog_reads_by_itself_and_finds_the_same_culprit(
        ops: types.ModuleType) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with NanSentinel() as free:
        Net("bad_backward")(x).sum().backward()
    with NanSentinel(limit=3) as bounded:
        Net("bad_backward")(x).sum().backward()
        assert len(bounded._pending) < 3
    a, b = free.result().first, bounded.result().first
    assert a is not None and b is not None
    assert (a.op, a.kind, a.arg, a.module, a.call_site, a.nan) == (
        b.op, b.kind, b.arg, b.module, b.call_site, b.nan)
    with pytest.raises(ValueError, match="limit"):
        NanSentinel(limit=0)


def test_nan_gradient_from_an_unwatched_op_is_received_not_blamed(ops: types.ModuleType) -> None:
    x = torch.randn(3, requires_grad=True)
    with NanSentinel() as s:
        y = ops.good(x)
        (y * float("nan")).sum().backward()  # the NaN comes from plain torch, after the op
    r = s.result()
    assert r.first is None
    assert r.received is not None and r.received.direction == "backward"
    assert r.received.op == "t.good"


def test_multi_output_op_and_finite_run_is_silent(ops: types.ModuleType) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    scale = torch.randn(2, 3, requires_grad=True)
    with NanSentinel() as s:
        a, b = ops.pair(x, scale)
        assert not b.requires_grad
        (a.sum() + ops.good(a).sum()).backward()
    assert s.result().first is None and s.result().received is None
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert scale.grad is not None and torch.allclose(scale.grad, x.detach() * 3)


def test_gradients_unchanged_and_no_hooks_left_on_parameters(ops: types.ModuleType) -> None:
    net = Net("good")
    x = torch.randn(3, 4)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    with NanSentinel():
        for _ in range(3):
            net.zero_grad()
            net(x).sum().backward()
    for p, g in zip(net.parameters(), ref):
        assert torch.equal(p.grad, g)
        assert not p._backward_hooks  # probes are graph nodes: nothing accumulates
    assert nan.active() is None


def test_large_finite_values_whose_sum_overflows_are_not_reported(ops: types.ModuleType) -> None:
    x = torch.full((4,), 2e38)  # finite, but its fp32 sum is inf: the exact check decides
    with NanSentinel() as s:
        a, _ = ops.pair(x, torch.full((4,), 0.5))
    assert torch.isfinite(a).all()
    assert s.result().first is None and s.result().received is None


def test_fix_mode_cast_inside_the_guard_still_watched(ops: types.ModuleType) -> None:
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with opcontracts.mode("fix"), warnings.catch_warnings(), NanSentinel() as s:
        warnings.simplefilter("ignore")
        y = ops.bad_backward(x)
        assert y.dtype == torch.float32
        y.sum().backward()
    assert s.result().first is not None and s.result().first.op == "t.bad_backward"
    assert x.grad is not None and x.grad.dtype == torch.float64


# --------------------------------------------------------------------------- lifecycle
def test_one_sentinel_at_a_time_and_module_functions(ops: types.ModuleType) -> None:
    s = nan.enable()
    try:
        assert nan.active() is s and nan.enable() is s
        with pytest.raises(RuntimeError, match="another NanSentinel"):
            NanSentinel().enable()
        ops.bad_forward(torch.ones(1))
    finally:
        res = nan.disable()
    assert res is not None and res.first is not None
    assert nan.active() is None and nan.disable() is None


def test_reset_and_bounded_events(ops: types.ModuleType) -> None:
    with NanSentinel(max_events=2) as s:
        for _ in range(4):
            ops.bad_forward(torch.ones(1))
        r = s.result()
        assert len(r.events) == 2 and r.dropped == 2 and r.first is r.events[0]
        s.reset()
        assert s.result().first is None and s.result().calls == 0


def test_without_the_patch_it_warns_and_watches_nothing(ops: types.ModuleType) -> None:
    patch.unpatch()
    with pytest.warns(RuntimeWarning, match="opcontracts.patch is not applied"):
        s = NanSentinel().enable()
    s.disable()


def test_bad_on_nan_value() -> None:
    with pytest.raises(ValueError, match="on_nan"):
        NanSentinel(on_nan="explode")  # type: ignore[arg-type]


def test_patch_apply_and_unpatch_while_on_keep_the_patch_restorable(ops: types.ModuleType) -> None:
    original = ops.good.__wrapped__
    with NanSentinel():
        patch.apply()  # sees the sentinel's wrapper as the guard: nothing dropped or re-recorded
        assert getattr(ops.good, "__opcontracts_nan__", False)
    patch.unpatch()
    assert ops.good is original
    patch.apply()
    with NanSentinel():
        patch.unpatch()  # the patch takes everything off, the sentinel's layer with it
        assert ops.good is original
    assert ops.good is original


def test_steps_aside_under_torch_compile(ops: types.ModuleType) -> None:
    torch._dynamo.reset()

    def f(x: torch.Tensor) -> torch.Tensor:
        return ops.good(x) + 1

    try:
        with NanSentinel() as s:
            explained = torch._dynamo.explain(f)(torch.randn(3))
        assert explained.graph_break_count == 0
        assert s.result().calls == 0  # compiled code runs the guard alone
    finally:
        torch._dynamo.reset()
