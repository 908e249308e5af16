"""What each observer costs a training step on an accelerator: host reads per step, and time.

    python benchmarks/bench_accelerator.py [--quick] [--layers 2 6] [--rounds N] [--paired N]

On an NPU or GPU every host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``)
stalls the device: the host waits for the queue to drain instead of running ahead of the
kernels.  CPU timings cannot show it; the reads can be counted anywhere (``_host_reads``), and
they are the hardware-independent cost: an observer that adds N reads per step adds N
synchronisations per step on the device, whatever the CPU ratio says.

The step is the demo's model (``opcontracts demo``'s MoE transformer: per layer a fused
MindSpeed permute and unpermute through the emulation, the incident's fix applied so that
strict mode passes), built once, forward + backward + an SGD step; 2 and 6 layers.  Rows:

* ``bare``: nothing attached, contracts off;
* ``strict``: the guards in strict mode, nothing attached;
* ``sentinel``: the NaN sentinel's per-call watch (``NanSentinel``, contracts off), read at the
  end of each step;
* ``watch always-on``: the watch left on (``NanSentinel(always_on=True, watch=True)``: every
  guarded call checked, no tensor kept, read at ``optimizer.step()``);
* ``always-on``: ``NanSentinel(always_on=True)``, what to leave on in production: the step
  checked once at ``optimizer.step()`` (one fused reduction over the gradients, one read),
  nothing per guarded call;
* ``always-on replay``: the same with the step's function known (``sentinel.run_step``, what
  ``@opcontracts.nan_step`` calls): the RNG states taken and the inputs held per step, for a
  replay;
* ``compare S``: the shadow compare at sample S (1.0, 0.1, 0.01), contracts off.

Columns: guarded calls per step, host reads per step added to the bare step's (the model's own
reads, the expert split's ``tolist``, are the bare step's), host copies added (``.cpu()`` /
``.to("cpu")``: the compare's reference copies), ops added per step (``+ops``: the ATen ops
the dispatcher runs, counted by a ``TorchDispatchMode``, forward, backward and optimizer step:
what would be a kernel launch each on a device), and the median over interleaved rounds of the
time ratio to the bare step of the same round (a slow phase of a shared machine hits every row
of a round alike), and the ratio of the best rounds; times are this process's CPU time
(``time.process_time``: another process's load on a shared machine does not count in it, as it
does in wall time).  1 torch thread by default (on a shared 2-core machine the OpenMP pool's
spin-waiting swamps small reductions).

``--batch B`` runs B sequences per step instead of the demo's 4 (the same guarded calls on
larger tensors: what is per call shrinks relative to the step).

``--replay N`` times, per layer count, the replay of a bad step (the incident's step: fp32
probs to the bf16-only unpermute) under ``always-on replay``: the seconds the replay took
(``StepFinding.replay_s``, the watch's read included), as a ratio to the bare step, N times.

``--decompose N`` splits the always-on step check's cost, inside the real step: N pairs each
(as ``--paired``) of a step with stand-in optimizer hooks and a step without, the stand-ins
doing ever more of what the check does (``time_parts``): hooks that return at once; the
gradients gathered; their reduction (the check's own: on the CPU one ``cat`` of the small
gradients and a ``sum``; on an accelerator ``_foreach_norm`` and a ``stack``); its read (the
check's device work, all of it); the check itself (``StepCheck``: the verdict, the sentinel's own
bookkeeping).  What a row adds to the one above is what that part costs in a training step,
where a tight loop over the part alone (warm caches, no allocator churn) shows less.

``--own N`` times, for the step-wise rows (``always-on``, ``always-on replay``), opcontracts'
own code where it runs inside the real step, in N pairs as ``--paired`` makes them
(``time_own``): the step check's optimizer hooks and, with the replay, the step scope (RNG
capture, inputs held).  Printed as ``1 + own / bare step`` (medians): the share of the step the
check takes, with its cold caches after the backward pass, far steadier than the paired ratio
and an upper bound of it but for what the check warms for the optimizer.

``--paired N`` adds, per observer, N pairs of back-to-back steps, one observed and one with the
observer switched off at the layer's dispatch (``time_paired``): the median and quartiles of
the pairs' wall-time ratios, a figure whose spread is a few percent on a machine whose rounds
swing by ten, and the median extra time of the observed step divided by its guarded calls
(``us a guarded call``): what the observer costs per call, forward and backward together,
which a larger step (``--batch``) does not dilute.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _host_reads import HostReads

KINDS = ("bare", "strict", "sentinel", "watch always-on", "always-on", "always-on replay",
         "compare 1.0", "compare 0.1", "compare 0.01")
STEPWISE = ("always-on", "always-on replay")  # nothing at the layer: the step's own check


@contextlib.contextmanager
def observed(kind: str) -> Iterator[Callable[[], None]]:
    """The observer of ``kind`` around a series of steps; yields what to call at each step's
    end (the step boundary: the sentinel's and the compare's one read)."""
    import opcontracts
    from opcontracts.compare import ShadowCompare
    from opcontracts.nan import NanSentinel

    mode = "strict" if kind == "strict" else "off"
    with opcontracts.mode(mode):
        if kind in ("bare", "strict"):
            yield lambda: None
            return
        obs: Any
        if kind in STEPWISE:  # optimizer.step() is the boundary: a production loop calls
            with NanSentinel(always_on=True, on_nan="record"):  # nothing of it per step
                yield lambda: None
            return
        if kind.startswith(("sentinel", "watch")):
            obs = NanSentinel(**_always_on(kind))
        else:
            obs = ShadowCompare(sample=float(kind.split()[1]))
        with obs:
            yield lambda: _boundary(obs)


def _always_on(kind: str) -> dict[str, Any]:
    from opcontracts.nan import NanSentinel

    if kind != "watch always-on":
        return {}
    names = NanSentinel.__init__.__code__.co_varnames
    if "always_on" not in names:
        return {}  # an older opcontracts: the plain sentinel
    if "watch" not in names:
        return {"always_on": True}  # before the step check: always-on was the watch
    return {"always_on": True, "watch": True}


def _boundary(obs: Any) -> None:
    if getattr(obs, "step_hook", False):
        return  # optimizer.step() is the boundary: it read already
    step = getattr(obs, "step", None)
    if step is not None:
        step()
    else:
        obs.result()


class Step:
    """The demo's model with ``layers`` MoE blocks, built once: forward, backward, SGD step."""

    def __init__(self, model_mod: Any, layers: int, conforming: bool = True) -> None:
        from opcontracts._tools import demo

        torch.manual_seed(0)
        self.model = model_mod.MoEModel(vocab=demo.VOCAB, layers=layers).to(torch.bfloat16)
        # conforming: the fix applied, strict mode passes; else the incident (NaN gradients)
        self.model.set_fused(True, cast_probs=conforming)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.batch = demo._batch(0)

    def __call__(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(*self.batch)
        loss.backward()
        self.opt.step()


def runner(step: Step, kind: str) -> Callable[[], None]:
    """What runs one observed step of ``kind``: the step itself, or, for ``always-on
    replay``, the step through the active sentinel's ``run_step`` (its function known)."""
    if kind != "always-on replay":
        return step
    from opcontracts import nan

    s = nan.active()
    assert s is not None
    return lambda: s.run_step(step)


class OpCount:
    """ATen ops run through the dispatcher while active (a ``TorchDispatchMode``: forward,
    backward, which the autograd engine runs with the mode, and the optimizer step), views
    left out: a view (``view``, ``t``, ``expand``...) launches no kernel on a device, it makes
    a new tensor over the same storage."""

    def __init__(self) -> None:
        self.ops = 0
        self._mode: Any = None

    def __enter__(self) -> OpCount:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                if not func.is_view:
                    counter.ops += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def count(step: Step, kind: str, steps: int = 2) -> tuple[int, int, int, int]:
    """(guarded calls, host reads, host copies, dispatcher ops) per step with ``kind``
    attached; the first step warms up, the last is counted with its boundary."""
    from opcontracts._observers import layer
    from opcontracts._observers.stats import CallStats

    stats = CallStats()
    with observed(kind) as boundary:
        run = runner(step, kind)
        for _ in range(steps - 1):
            run()
            boundary()
        layer.attach(stats)
        try:
            with HostReads() as reads:
                run()
                boundary()
        finally:
            layer.detach(stats)
        # the stats counter is detached again (its own work would count): ops alone
        with OpCount() as ops:
            run()
            boundary()
    calls = sum(stats.calls.values())
    return calls, reads.total, reads.copies_total, ops.ops


def time_rounds(step: Step, kinds: tuple[str, ...], rounds: int, per: int
                ) -> dict[str, list[float]]:
    """Per round and kind: the mean step time over ``per`` steps."""
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind in kinds:
            with observed(kind) as boundary:
                run = runner(step, kind)
                run()
                boundary()  # warm (first call of the observer's paths)
                t0 = time.process_time()
                for _ in range(per):
                    run()
                    boundary()
                times[kind].append((time.process_time() - t0) / per)
    return times


def time_paired(step: Step, kind: str, pairs: int,
                observed_step: Callable[[], None] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> list[tuple[float, float]]:
    """Per pair of consecutive steps, (the observed step's wall time, the bare one's), with
    the observer attached throughout and switched off for the bare step at the layer's
    dispatch (``_Dispatch.observers``: what the wrapper reads before anything else, so the
    bare step pays the wrapper's two attribute reads and nothing more).  Pairs alternate
    which step runs first; a slow phase of a shared machine hits both steps of a pair, so the
    spread of the pairs' ratios is a few percent where whole rounds swing by ten.
    ``observed_step`` runs in place of ``step`` for the observed steps (a caller that
    accounts something per observed step).  The always-on step check has nothing at the
    layer: its optimizer hooks are taken off for the bare step instead (outside the timer).
    ``clock``: wall time by default; ``time.process_time`` leaves out what other processes
    of a loaded machine take."""
    from opcontracts import nan
    from opcontracts._observers import layer

    pc = clock
    spans: list[tuple[float, float]] = []
    with observed(kind) as boundary:
        warm = runner(step, kind)
        run_observed = warm if observed_step is None else observed_step
        d = layer._dispatch
        on = d.observers
        s = nan.active() if kind in STEPWISE else None
        check = s._check if s is not None else None

        def switch(which: bool) -> None:
            if check is not None:
                if which:
                    check.attach()
                else:
                    check.remove()
            else:
                d.observers = on if which else ()

        for _ in range(3):
            warm()
            boundary()
        try:
            for i in range(pairs):
                pair = {}
                for which in ((False, True) if i % 2 else (True, False)):
                    switch(which)
                    t0 = pc()
                    if which:
                        run_observed()
                        boundary()
                    else:
                        step()
                    pair[which] = pc() - t0
                spans.append((pair[True], pair[False]))
        finally:
            switch(True)
            d.observers = on
    return spans


PARTS = ("hooks", "gather", "+ reduce", "+ read", "the check")


def _part(upto: int) -> Callable[[Any, Any, Any], None]:
    """A step pre-hook doing the first ``upto`` of the check's parts (``PARTS``): the
    reduction is the check's own (``stepcheck._reduce``: on the CPU the flattened sums, on an
    accelerator ``_foreach_norm`` and a stack)."""
    from opcontracts._observers.stepcheck import _reduce

    tensor, strided = torch.Tensor, torch.strided

    def pre(opt: Any, _a: Any, _k: Any) -> None:
        if upto < 2:
            return
        gs = [g if type(g) is tensor else g for group in opt.param_groups
              for p in group["params"] if (g := p.grad) is not None and g.layout is strided]
        if upto < 3:
            return
        values = _reduce(gs)
        if upto < 4:
            return
        values.tolist()
    return pre


class _StandIn:
    """Global optimizer hooks switched on and off: the stand-in doing the parts of the check
    up to ``upto`` (``_part``), or, with ``check``, the sentinel's own ``StepCheck``."""

    def __init__(self, upto: int, check: Any = None) -> None:
        self.pre = _part(upto)
        self.check = check
        self.handles: list[Any] = []

    def on(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        if self.check is not None:
            self.check.attach()
            return
        self.handles = [register_optimizer_step_pre_hook(self.pre),
                        register_optimizer_step_post_hook(lambda *_: None)]

    def off(self) -> None:
        if self.check is not None:
            self.check.remove()
        while self.handles:
            self.handles.pop().remove()


def time_parts(step: Step, pairs: int, clock: Callable[[], float] = time.perf_counter
               ) -> dict[str, list[tuple[float, float]]]:
    """Per part of ``PARTS``: ``pairs`` pairs (observed, bare) of consecutive steps, as
    ``time_paired`` times them; the observed step runs with stand-in global optimizer hooks
    doing the parts up to that one (the last: the always-on sentinel's own check)."""
    from opcontracts.nan import NanSentinel

    out: dict[str, list[tuple[float, float]]] = {}
    for i, name in enumerate(PARTS, start=1):
        sentinel = NanSentinel(always_on=True, on_nan="record") if name == "the check" else None
        hooks = _StandIn(i, sentinel.enable()._check if sentinel is not None else None)
        hooks.off()
        spans = []
        try:
            for j in range(pairs + 3):
                pair = {}
                for which in ((False, True) if j % 2 else (True, False)):
                    if which:
                        hooks.on()
                    t0 = clock()
                    step()
                    pair[which] = clock() - t0
                    hooks.off()
                if j >= 3:  # the first three warm up
                    spans.append((pair[True], pair[False]))
        finally:
            hooks.off()
            if sentinel is not None:
                sentinel.disable()
        out[name] = spans
    return out


def time_own(step: Step, kind: str, pairs: int, clock: Callable[[], float] = time.perf_counter
             ) -> list[tuple[float, float, float]]:
    """Per pair of consecutive steps (as ``time_paired``: the step check's hooks off for the
    bare step), (the time spent in opcontracts' own code during the observed step, the
    observed step's time, the bare step's) for a step-wise ``kind`` (``STEPWISE``).

    Our own code: the step check's optimizer pre- and post-hooks and, for ``always-on
    replay``, the sentinel's step scope (``begin_step``, ``record_call``, ``end_step``: the
    RNG capture, the inputs held), each timed where it runs, inside the real step.  A share of
    the step far steadier than the paired ratio (whose pairs spread by a few percent): the
    check runs after a backward pass, with cold caches, which a tight loop over it would not
    show; and an upper bound of what the check adds, less what it warms for the optimizer."""
    from opcontracts import nan

    assert kind in STEPWISE, kind
    spans: list[tuple[float, float, float]] = []
    own = [0.0]
    with observed(kind) as boundary:
        s = nan.active()
        assert s is not None and s._check is not None
        check = s._check
        check.remove()  # its hooks are bound when attached: time them, then attach again

        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    own[0] += clock() - t0
            return wrapper

        wrapped = [(check, "_pre"), (check, "_post")]
        if kind == "always-on replay":
            wrapped += [(s, "begin_step"), (s, "record_call"), (s, "end_step")]
        for obj, name in wrapped:
            setattr(obj, name, timed(getattr(obj, name)))
        check.attach()
        run = runner(step, kind)
        try:
            for _ in range(3):
                run()
                boundary()
            for i in range(pairs):
                pair: dict[bool, float] = {}
                mine = 0.0
                for which in ((False, True) if i % 2 else (True, False)):
                    if which:
                        check.attach()
                    else:
                        check.remove()
                    own[0] = 0.0
                    t0 = clock()
                    if which:
                        run()
                        boundary()
                        mine = own[0]
                    else:
                        step()
                    pair[which] = clock() - t0
                spans.append((mine, pair[True], pair[False]))
        finally:
            check.remove()
            for obj, name in wrapped:
                delattr(obj, name)  # the instance's own again: its class's method
            check.attach()
    return spans


def time_replay(model_mod: Any, layers: int, times: int) -> tuple[list[float], list[float]]:
    """(replay seconds, bare step seconds) of the incident's bad step, ``times`` each: a fresh
    always-on sentinel per bad step, the step run through ``run_step``, contracts off."""
    import opcontracts
    from opcontracts.nan import NanSentinel

    replays: list[float] = []
    bares: list[float] = []
    with opcontracts.mode("off"):
        good = Step(model_mod, layers)
        good()
        for _ in range(times):
            t0 = time.perf_counter()
            good()
            bares.append(time.perf_counter() - t0)
            step = Step(model_mod, layers, conforming=False)  # the parameters before the step
            with NanSentinel(always_on=True, on_nan="record") as s:
                s.run_step(step)
            (finding,) = s.findings
            assert finding.culprit is not None and finding.replay_s is not None
            replays.append(finding.replay_s)
    return replays, bares


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (smoke test)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, metavar="KIND")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="also N step pairs per observer, bare and observed back to back "
                        "(wall time; median and quartiles of the pairs' ratios)")
    p.add_argument("--decompose", type=int, default=0, metavar="N",
                   help="also split the always-on step check's cost inside the real step: N "
                        "pairs per part (hooks, gather, reduce, read, the check)")
    p.add_argument("--own", type=int, default=0, metavar="N",
                   help="also time, in N step pairs, opcontracts' own code inside the step "
                        "(the step check's hooks, the replay mode's step scope): a steadier "
                        "share of the step than the paired ratio")
    p.add_argument("--replay", type=int, default=0, metavar="N",
                   help="also time the replay of the incident's bad step, N times")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="sequences of 32 tokens per step (the demo's: 4); a larger step shows "
                        "which costs are per guarded call")
    p.add_argument("--cpu-time", action="store_true",
                   help="pairs timed in this process's CPU time (not wall time): another "
                        "process's load on a shared machine does not count")
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    clock = time.process_time if ns.cpu_time else time.perf_counter
    clock_name = "CPU time" if ns.cpu_time else "wall time"
    rounds = ns.rounds or (2 if ns.quick else 9)
    per = 1 if ns.quick else 3
    kinds = tuple(ns.kinds)
    if "bare" not in kinds:
        kinds = ("bare", *kinds)

    import opcontracts
    from opcontracts._tools import demo

    print(f"{'layers':>6s} {'observer':20s} {'calls':>6s} {'+reads':>7s} {'+copies':>8s} "
          f"{'+ops':>6s} {'median x':>9s} {'best x':>7s} {'bare ms':>8s}")
    if ns.batch:
        demo.BATCH = ns.batch
    with demo._environment() as model_mod:
        for layers in ns.layers:
            step = Step(model_mod, layers)
            counted = {k: count(step, k) for k in kinds}
            times = time_rounds(step, kinds, rounds, per)
            bare = times["bare"]
            for kind in kinds:
                calls, reads, copies, ops = counted[kind]
                ratios = [t / b for t, b in zip(times[kind], bare)]
                print(f"{layers:6d} {kind:20s} {calls:6d} {reads - counted['bare'][1]:7d} "
                      f"{copies - counted['bare'][2]:8d} {ops - counted['bare'][3]:6d} "
                      f"{statistics.median(ratios):9.3f} "
                      f"{min(times[kind]) / min(bare):7.3f} "
                      f"{statistics.median(bare) * 1e3:8.2f}")
            if ns.paired:
                for kind in kinds:
                    if kind in ("bare", "strict"):
                        continue  # nothing attached to switch off
                    paired = time_paired(step, kind, ns.paired, clock=clock)
                    r = sorted(o / b for o, b in paired)
                    q1, q3 = r[len(r) // 4], r[(3 * len(r)) // 4]
                    # the step's extra time spread over its guarded calls: the figure that does
                    # not shrink with a larger step (``--batch``), i.e. the per-call budget
                    extra = statistics.median(o - b for o, b in paired)
                    per_call = extra / max(1, counted[kind][0]) * 1e6
                    # the step check's cost is per step, not per guarded call
                    tail = "" if kind in STEPWISE else f", {per_call:+.0f} us a guarded call"
                    print(f"{layers:6d} {kind:20s} paired x {statistics.median(r):.4f} "
                          f"(quartiles {q1:.3f}-{q3:.3f}, {len(r)} pairs, {clock_name}), "
                          f"{extra * 1e6:+.0f} us a step{tail}")
            if ns.decompose:
                before = 0.0
                for name, spans in time_parts(step, ns.decompose, clock=clock).items():
                    extra = statistics.median(o - b for o, b in spans)
                    r = statistics.median(o / b for o, b in spans)
                    print(f"{layers:6d} check part {name:10s} paired x {r:.4f}, "
                          f"{extra * 1e6:+.0f} us a step ({(extra - before) * 1e6:+.0f} us "
                          f"over the row above; {len(spans)} pairs, {clock_name})")
                    before = extra
            if ns.own:
                for kind in kinds:
                    if kind not in STEPWISE:
                        continue
                    owns = time_own(step, kind, ns.own, clock=clock)
                    mine = statistics.median(o for o, _, _ in owns)
                    bare_step = statistics.median(b for _, _, b in owns)
                    q = statistics.quantiles([o for o, _, _ in owns], n=4)
                    print(f"{layers:6d} {kind:20s} own code x {1 + mine / bare_step:.4f} "
                          f"({mine * 1e6:.0f} us a step, quartiles {q[0] * 1e6:.0f}-"
                          f"{q[2] * 1e6:.0f}; bare step {bare_step * 1e3:.2f} ms; "
                          f"{len(owns)} pairs, {clock_name})")
            if ns.replay:
                rep, bare_s = time_replay(model_mod, layers, ns.replay)
                print(f"{layers:6d} replay of a bad step: {statistics.median(rep) * 1e3:.1f} ms "
                      f"(median of {len(rep)}), {statistics.median(rep) / statistics.median(bare_s):.2f}"
                      f"x the bare step ({statistics.median(bare_s) * 1e3:.1f} ms)")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), opcontracts {opcontracts.__version__}, "
          f"{rounds} rounds x {per} steps, {demo.BATCH} x {demo.SEQ} tokens per step; load "
          f"average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
