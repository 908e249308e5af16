"""Observers that do not stall the device: host reads per training step, counted.

On an accelerator every host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``)
waits for the device queue.  The counter of ``benchmarks/_host_reads.py`` counts them on the
CPU (a count, not a timing).  The NaN sentinel and the shadow compare judge on the device and
read once per step: they add at most 2 reads to a step, on a 6-layer model as on a 2-layer one,
and name the same first culprit as when every call is read at once (``on_nan="warn"`` /
``on_divergence="warn"`` react at the call, so they read per call: the reference here).
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts._tools import demo
from opcontracts.compare import ShadowCompare
from opcontracts.nan import NanSentinel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _host_reads import HostReads  # noqa: E402

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def moe() -> Iterator[types.ModuleType]:
    with demo._environment() as mod:
        yield mod


def _step(mod: types.ModuleType, layers: int) -> Callable[[], None]:
    """The incident's training step (fused unpermute, fp32 probs, contracts off): forward,
    backward, SGD step; a NaN gradient appears in backward."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = mod.MoEModel(vocab=demo.VOCAB, layers=layers).to(BF16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids, targets = demo._batch(0)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(ids, targets).backward()
        opt.step()

    return step


def _reads(step: Callable[[], None], observer: Any = None) -> tuple[int, Any]:
    """Host reads of one step with ``observer`` on (its result read at the step's end)."""
    with opcontracts.mode("off"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with HostReads() as reads:
            if observer is None:
                step()
                return reads.total, None
            with observer:
                step()
                result = observer.result()
    return reads.total, result


def test_the_counter_sees_reads_in_forward_and_in_backward_hooks() -> None:
    x = torch.randn(3, requires_grad=True)
    with HostReads() as reads:
        y = x * 2
        float(y.detach().sum())
        y.register_hook(lambda g: None if bool(g.sum() > 0) else None)  # read in backward
        y.sum().backward()
    assert reads.by_kind == {"__float__": 1, "__bool__": 1}


def _first(r: Any) -> tuple[Any, ...]:
    e = r.first
    assert e is not None, r
    return (e.op, e.direction, e.kind, e.module, e.call_site, getattr(e, "arg", None),
            getattr(e, "argument", None))


@pytest.mark.parametrize("layers", [2, 6])
def test_sentinel_reads_once_per_step_and_names_the_same_culprit(
        moe: types.ModuleType, layers: int) -> None:
    bare, _ = _reads(_step(moe, layers))
    per_call, at_call = _reads(_step(moe, layers), NanSentinel(on_nan="warn"))
    deferred, once = _reads(_step(moe, layers), NanSentinel())
    # the watch left on for a whole run (``always_on=True, watch=True``: no tensor kept)
    always, always_on = _reads(_step(moe, layers),
                               NanSentinel(always_on=True, watch=True, on_nan="record"))
    assert deferred - bare <= 2 and always - bare <= 2, (bare, deferred, always)
    assert per_call - bare >= 4 * layers  # the counter would see per-call reads
    assert _first(once) == _first(at_call) == _first(always_on)
    # counted from the tensor kept to the read (NaN or inf: which one the bf16 backward makes
    # depends on the CPU's kernels)
    assert (once.first.nan, once.first.inf) == (at_call.first.nan, at_call.first.inf)
    assert once.first.counted and once.first.nan + once.first.inf > 0
    assert always_on.first.nan == -1 and not always_on.first.counted
    assert "NaN and inf not counted" in always_on.first.message()


@pytest.mark.parametrize("layers", [2, 6])
def test_compare_reads_once_per_step_and_names_the_same_divergence(
        moe: types.ModuleType, layers: int) -> None:
    bare, _ = _reads(_step(moe, layers))
    per_call, at_call = _reads(_step(moe, layers), ShadowCompare(on_divergence="warn"))
    deferred, once = _reads(_step(moe, layers), ShadowCompare())
    assert deferred - bare <= 2, (bare, deferred)
    assert per_call - bare >= 4 * layers  # grows with the model: one read per call
    assert _first(once) == _first(at_call)
    assert once.first.metrics == at_call.first.metrics
    assert [e.seq for e in once.events] == [e.seq for e in at_call.events]
    sampled, _ = _reads(_step(moe, layers), ShadowCompare(sample=0.01))
    assert sampled - bare <= 2


def test_the_watch_left_on_reads_at_each_optimizer_step(moe: types.ModuleType) -> None:
    step = _step(moe, 2)
    with opcontracts.mode("off"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        with NanSentinel(always_on=True, watch=True) as s:
            step()  # optimizer.step() is the step boundary: the read, the warning
            assert s.steps == 1 and s.first_bad_step == 1
            assert any("first non-finite value" in str(w.message) for w in caught)
            step()
            assert s.steps == 2 and s.first_bad_step == 1
    assert s.steps == 2  # nothing waits after the hook's read: the exit reads nothing new


def test_pending_values_come_back_in_order_in_one_read() -> None:
    from opcontracts._observers.deferred import Pending

    for values in ([torch.tensor(1.0), (torch.tensor(2.0), torch.tensor(3.0))],  # one size
                   [torch.tensor([1.0, 2.0]), torch.tensor([3], dtype=torch.int64),
                    (torch.tensor(4.0), torch.tensor(5.0, dtype=torch.float64))]):  # mixed
        p: Pending[int] = Pending()
        for i, v in enumerate(values):
            p.add(v, i)
        with HostReads() as reads:
            got = p.read()
        assert reads.total == 1 and len(p) == 0
        flat = [x for _, numbers in got for x in numbers]
        assert [i for i, _ in got] == list(range(len(values)))
        assert flat == [float(k) for k in range(1, len(flat) + 1)]
    full: list[int] = []
    p = Pending(limit=2, on_full=lambda: full.append(len(p)))
    p.add(torch.tensor(0.0), 0)
    p.add(torch.tensor(0.0), 1)
    assert full == [2]


def test_slots_are_written_in_place_and_read_in_order_in_one_read() -> None:
    from opcontracts._observers.deferred import Slots, _Buffer

    def fill(x: torch.Tensor, out: tuple[torch.Tensor, ...]) -> None:
        for v, n in zip(out, x.tolist()):
            v.fill_(n)

    s: Slots[str] = Slots(2)
    xs = [torch.tensor([1.0, 2.0], dtype=BF16), torch.tensor([3.0, -4.0]),
          torch.tensor([5.0, 6.0], dtype=BF16), torch.tensor([-7.0, 8.0], dtype=torch.float64)]
    s.put_many([(x, f"check {i}") for i, x in enumerate(xs)], torch.aminmax)  # in place
    with HostReads() as reads:
        got = s.read()
    assert reads.total == 1 and len(s) == 0  # three dtypes, one device: one read
    assert got == [("check 0", [1.0, 2.0]), ("check 1", [-4.0, 3.0]),
                   ("check 2", [5.0, 6.0]), ("check 3", [-7.0, 8.0])]
    # the buffers are reused: a second round overwrites the first, the non-finite ones found
    # among more checks than a chunk holds
    n = _Buffer.CHUNK  # checks of 2 numbers: two chunks
    nan = float("nan")
    s.put_many([(torch.tensor([float(i), nan if i in (3, n - 1) else float(i)]), f"again {i}")
                for i in range(n)], fill)
    with HostReads() as reads:
        bad = s.read(only_nonfinite=True)
    assert reads.total == 1
    assert [p for p, _ in bad] == ["again 3", f"again {n - 1}"]
    huge = torch.tensor([1.7e308, 1.7e308], dtype=torch.float64)  # finite; their sum is not
    s.put_many([(huge, "huge")], fill)
    assert s.read(only_nonfinite=True) == []
    # a reduction that fails leaves its slot finite, not the number a previous read left there
    s.put_many([(torch.tensor([nan, nan]), "stale")], fill)
    assert [p for p, _ in s.read(only_nonfinite=True)] == ["stale"]

    def broken(x: torch.Tensor, out: tuple[torch.Tensor, ...]) -> None:
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        s.put_many([(torch.tensor([1.0, 1.0]), "failed")], broken)
    assert s.read(only_nonfinite=True) == []
    full: list[int] = []
    s = Slots(2, limit=2, on_full=lambda: full.append(len(s)))
    s.put_many([(torch.tensor([0.0, 0.0]), 0)], fill)
    assert full == []
    s.put_many([(torch.tensor([0.0, 0.0]), 1)], fill)
    assert full == [2]


def test_the_paired_benchmark_observes_one_step_of_each_pair(moe: types.ModuleType,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    import bench_accelerator

    begun: list[str] = []
    begin = NanSentinel.begin

    def counting(self: NanSentinel, call: Any) -> Any:
        begun.append(call.op)
        return begin(self, call)

    monkeypatch.setattr(NanSentinel, "begin", counting)
    step = bench_accelerator.Step(moe, 2)
    ratios = bench_accelerator.time_paired(step, "watch always-on", 4)
    assert len(ratios) == 4 and all(o > 0 and b > 0 for o, b in ratios)
    per_step = 4  # 2 layers: a permute and an unpermute each
    assert len(begun) == per_step * (3 + 4)  # the 3 warm steps and one step of each pair
    from opcontracts._observers import layer

    assert layer.attached() == [] and layer._dispatch.observers == ()


def test_the_parts_benchmark_times_each_part_of_the_observed_steps_only(
        moe: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the benchmark adds up, not how long it took: its clock is a counter here (each
    read one tick), so a part's figure is how often its timer ran, whatever the machine's
    load."""
    import itertools

    import bench_accelerator
    import bench_sentinel_parts

    from opcontracts import nan
    from opcontracts._observers import layer

    ticks = itertools.count()
    monkeypatch.setattr(bench_sentinel_parts, "time",
                        types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    before = (layer.Call.__init__, layer.Call._place, NanSentinel._checks, nan._aminmax,
              layer._Dispatch._hook_outputs, layer._node_posthook, NanSentinel.step)
    step = bench_accelerator.Step(moe, 2)
    parts, bare, observed, calls = bench_sentinel_parts.measure(step, 4)
    assert calls == 4 and len(bare) == len(observed) == 4
    # every part ran in the observed steps (a part renamed in the package shows up here)
    assert all(parts[p] > 0 for p in bench_sentinel_parts.PARTS), parts
    # per observed step: one read at its optimizer step (the bare and warm-up steps' reads
    # are not counted), one call record per guarded call
    assert parts["the step's read"] == 1, parts
    assert parts["call record"] == calls, parts
    # the wrappers are off again, nothing attached
    assert (layer.Call.__init__, layer.Call._place, NanSentinel._checks, nan._aminmax,
            layer._Dispatch._hook_outputs, layer._node_posthook, NanSentinel.step) == before
    assert layer.attached() == [] and layer._dispatch.observers == ()
