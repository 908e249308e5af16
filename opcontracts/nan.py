"""The NaN sentinel: name the first guarded op that turned finite values into NaN or inf.

A first-step NaN (see the README's incident) shows up far from its cause: the loss or a
gradient norm is NaN, and every op downstream of the culprit sees NaN too. The sentinel
watches the ops that ``opcontracts.patch`` guards and reports the FIRST one whose inputs were
finite and whose results were not:

* forward: an output of the op is non-finite while every tensor argument was finite;
* backward: a gradient the op sends to one of its inputs is non-finite while the gradients
  flowing into its outputs were finite and its forward inputs were finite (an op handed a NaN
  in forward computes its backward from it: the NaN was received, not made); a guarded op *called* during backward (a ``*_grad``
  kernel) is checked like a forward call and reported as ``backward``, with the forward op
  whose backward was running.

Each event names the op, the direction, the argument, the call site (the user's line, taken
during forward) and the ``nn.Module`` path the op ran in (``layers.2.mlp``).

Use::

    import opcontracts.patch
    from opcontracts.nan import NanSentinel

    with NanSentinel() as sentinel:
        loss = model(batch); loss.backward()
    print(sentinel.result())          # NanResult: .first, .events, .received

    # a whole run (production): the step checked at each optimizer.step() (one fused
    # reduction, one host read, nothing per guarded call); a bad step skipped and replayed
    # under the watch when its function is known (``nan_step``)
    @nan_step
    def train_step(batch): ...
    with NanSentinel(always_on=True):
        for batch in loader:
            train_step(batch)

or ``opcontracts.nan.enable()`` / ``disable()``, or ``opcontracts run --nan-check script.py``.

Why a layer and not a check in the guard: the guard's hot path must stay what it is when the
sentinel is off.  The sentinel is an observer of ``opcontracts._observers.layer``, the one layer over the
patch's guards that the shadow compare and the recorder plug into too: ``enable()`` attaches it
(the layer wraps the patch's guards while any observer is attached) and ``disable()`` detaches
it (the guards are put back ``is``-identically when the last one leaves); off, nothing of this
module runs.  Backward is watched through the layer's node hooks and probes (``_observers.layer``): per
guarded call made with grad enabled the sentinel sees exactly the gradients the op sends to its
inputs, and the gradients flowing into its outputs.

Host reads (what stalls an accelerator): none per guarded call.  Each checked tensor (every
floating argument and output, every gradient in and out) leaves its smallest and largest element
on its device (``aminmax``, one reduction, no ``.item()``), written in place into buffers made
once (``_observers.deferred.Slots``), and the step's checks are read back in one transfer when a
result is asked for: ``result()``, ``step()``, the end of the ``with`` block, each
``optimizer.step()`` with ``step_hook`` (or ``always_on``); a step whose numbers are all finite
is told from their sum, without a loop over its checks.  They are
judged in the order they were made, so the first culprit is the one a read per call would name;
the step that turned non-finite costs one more read (the culprit's NaN and inf counts).
``on_nan="warn"`` / ``"raise"`` react at the call, so they read at every checked call.
Counted by ``benchmarks/bench_accelerator.py`` and ``tests/test_host_reads.py``: 1 read per
training step, 2 or 6 layers alike (it was one per checked tensor: 28 per MoE layer).

Two modes.  The **watch** (the default, and ``always_on=True, watch=True`` to leave it on for
a run: no tensor of the job kept until the read, one read per ``optimizer.step()``) checks
every guarded call, as above: its cost is per guarded call.  **always-on**
(``always_on=True``) checks the step instead (``_observers.stepcheck``): at every
``optimizer.step()`` one fused reduction over the gradients (and the loss handed to
``loss()``), one host read, no hook and no kernel per guarded call; a non-finite step is
skipped (the parameters stay those it started from) and localised by the watch: replayed on
the same inputs and RNG states when the step's function is known (``nan_step``,
``run_step``, ``begin_step``/``record_call``/``end_step`` for a framework's loop:
``opcontracts.NanStepCallback``), or, when it is not, the watch armed from the next step
until the NaN recurs (``opcontracts run --nan-check``).  ``NanResult.findings`` says which
happened and whether the replay reproduced the NaN.

CPU cost when on (``benchmarks/bench_accelerator.py``, ``bench_nan.py``): the checks, the call
site kept as code + line per call (its text made at report), the module path read off the
frames, and with grad enabled one shared post-hook on a fused op's one node (a probe node and
a shared pre-hook per output node for a composite op, and for any op at its first watched
call: ``_observers.layer``, ``_Dispatch``).  Under ``torch.compile`` the
sentinel steps aside (the guard alone runs, no graph break).

Limits: it sees the ops ``opcontracts.patch`` guards, nothing else (a NaN made by a plain torch
op shows up as ``received``: the first guarded op that was handed it); finite garbage (a kernel
misreading bytes into huge but finite numbers) is not a NaN and is not reported; modules
imported after ``enable()`` are covered through the patch's import hook, objects captured
before it (a guard stored on an instance) are not.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import torch
from torch import nn

from ._engine.callsite import CallSite, warn_at_caller
from ._observers import layer
from ._observers.deferred import Pending, Slots, StepBoundary
from ._observers.findings import Findings, later_lines, react
from ._observers.layer import Call, Direction, Observer
from ._observers.replay import StepScope
from ._observers.sections import NanEvent
from ._observers.stepcheck import StepCheck, StepVerdict

__all__ = [
    "NanEvent",
    "NanResult",
    "NanSentinel",
    "NonFiniteError",
    "StepFinding",
    "active",
    "disable",
    "enable",
    "loss",
    "nan_step",
]

OnNan = Literal["record", "warn", "raise"]
T = TypeVar("T")
R = TypeVar("R")
_ON_NAN = ("record", "warn", "raise")


# --------------------------------------------------------------------------- results
How = Literal["replay", "recurrence", "watched", "none"]


@dataclass
class StepFinding:
    """A training step the always-on sentinel found non-finite at ``optimizer.step()``, and how
    its first culprit was looked for:

    * ``"replay"``: the step's function was known (``nan_step``, ``run_step``, the
      transformers callback): the step was run again on the same inputs, from the same
      parameters, with the RNG states restored, under the per-call watch; ``reproduced``
      says whether the replay was non-finite too (False: the NaN did not reproduce:
      nondeterminism, the hardware, a race);
    * ``"recurrence"``: the step's function was not known (``opcontracts run --nan-check`` on
      an unmodified script): the watch was armed from the next step on; ``reproduced`` says
      whether the NaN recurred (at ``at_step``) while it watched (None: still watching);
    * ``"watched"``: the watch was on for that step already (``watch_first``: the steps before
      the first ``optimizer.step()``);
    * ``"none"``: not looked for (a culprit was known already, or too many replays).

    ``culprit`` is the watch's first culprit (op, argument, direction, module path, call
    site), or None."""

    step: int
    nonfinite: list[str]                 # which tensors (a few named)
    nonfinite_count: int                 # how many of ``checked``
    checked: int
    skipped: bool = True                 # the optimizer step was skipped
    ranks_bad: int = 0                   # in a job: ranks whose step was non-finite
    how: How = "none"
    reproduced: bool | None = None
    at_step: int | None = None           # recurrence: the step the culprit was named at
    culprit: NanEvent | None = None
    received: NanEvent | None = None     # the first non-finite value a watched op received
    replay_s: float | None = None
    note: str | None = None

    def message(self) -> str:
        what = ", ".join(self.nonfinite[:3]) + (", ..." if self.nonfinite_count > 3 else "")
        head = (f"step {self.step} non-finite at optimizer.step(): {self.nonfinite_count} of "
                f"{self.checked} checked tensor(s) ({what or 'on another rank'})")
        if self.ranks_bad > 1 or (self.ranks_bad and not self.nonfinite_count):
            head += f"; non-finite on {self.ranks_bad} rank(s)"
        head += "; the step was skipped (the parameters are those it started from)"
        lines = [head]
        if self.how == "replay":
            took = f", {self.replay_s:.2f} s" if self.replay_s is not None else ""
            if self.reproduced is None:
                lines.append(f"  replayed under the watch{took}: {self.note or 'no verdict'}")
            elif self.reproduced:
                lines.append(f"  replayed under the watch (same inputs, RNG states restored"
                             f"{took}): the NaN reproduced")
            else:
                lines.append(f"  replayed under the watch (same inputs, RNG states restored"
                             f"{took}): the NaN did NOT reproduce (the replay is finite): "
                             "nondeterminism, the hardware, or a race")
        elif self.how == "watched":
            lines.append("  the watch was on for this step (watch_first: until the first "
                         "optimizer.step())")
        elif self.how == "recurrence":
            if self.reproduced is None:
                lines.append(f"  the step's function is not known: the watch is armed from "
                             f"step {self.step + 1} on, and names the culprit if the NaN recurs")
            elif self.reproduced:
                lines.append(f"  the step's function is not known: the watch, armed from step "
                             f"{self.step + 1}, named the culprit when the NaN recurred at step "
                             f"{self.at_step}")
            else:
                lines.append(f"  the step's function is not known: the watch, armed from step "
                             f"{self.step + 1}, {self.note or 'saw no NaN recur'}")
        if self.culprit is not None:
            lines += ["  " + ln for ln in self.culprit.message().splitlines()]
        elif self.received is not None and self.reproduced:
            lines.append("  no guarded op made it (a plain torch op did); the first guarded op "
                         "that received it:")
            lines += ["  " + ln for ln in self.received.message().splitlines()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "nonfinite": list(self.nonfinite),
            "nonfinite_count": self.nonfinite_count, "checked": self.checked,
            "skipped": self.skipped, "ranks_bad": self.ranks_bad, "how": self.how,
            "reproduced": self.reproduced, "at_step": self.at_step,
            "culprit": self.culprit.to_dict() if self.culprit else None,
            "received": self.received.to_dict() if self.received else None,
            "replay_s": self.replay_s, "note": self.note,
        }


@dataclass
class NanResult:
    """What the sentinel found: the first culprit, every culprit seen (bounded), and the first
    non-finite value a watched op *received* (useful when no watched op produced it)."""

    first: NanEvent | None
    events: list[NanEvent] = field(default_factory=list)
    received: NanEvent | None = None
    calls: int = 0       # guarded calls the sentinel checked
    dropped: int = 0     # culprit events beyond ``max_events``, counted only
    # the always-on step check: steps checked, the non-finite ones (skipped), how each
    # localised one was looked into (None: not the always-on step check)
    steps: int | None = None
    bad_steps: list[int] = field(default_factory=list)
    findings: list[StepFinding] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.first is not None

    def summary(self) -> str:
        if self.steps is not None:
            return self._step_summary()
        return self._plain_summary()

    def _plain_summary(self) -> str:
        if self.first is None:
            text = f"NaN sentinel: no guarded op produced NaN or inf ({self.calls} call(s) checked)"
            if self.received is not None:
                text += "\n" + self.received.message()
            return text
        lines = [f"NaN sentinel ({self.calls} guarded call(s) checked)", self.first.message()]
        lines += later_lines(self.events[1:], self.dropped)
        return "\n".join(lines)

    def _step_summary(self) -> str:
        bad = self.bad_steps
        if not self.steps:  # no optimizer.step() seen: what the watch of the first steps saw
            return self._plain_summary() + ("\n(always-on: no optimizer.step() was seen)"
                                            if self.first is None else "")
        if not self.findings and (self.first is not None or self.received is not None):
            # the watch of the first steps (watch_first) found it, no optimizer step judged it
            return self._plain_summary() + (f"\n(always-on: {self.steps} optimizer step(s) "
                                            "checked)")
        if not bad:
            return (f"NaN sentinel, always-on: {self.steps} step(s) checked at optimizer.step(), "
                    "all finite")
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        lines = [f"NaN sentinel, always-on: {len(bad)} of {self.steps} step(s) non-finite "
                 f"(skipped: step {shown}); {self.calls} guarded call(s) checked by the watch"]
        lines += [f.message() for f in self.findings]
        lines += later_lines(self.events[1:], self.dropped)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "first": self.first.to_dict() if self.first else None,
            "events": [e.to_dict() for e in self.events],
            "received": self.received.to_dict() if self.received else None,
            "calls": self.calls,
            "dropped": self.dropped,
        }
        if self.steps is not None:
            out["always_on"] = {"steps": self.steps, "bad_steps": list(self.bad_steps),
                                "findings": [f.to_dict() for f in self.findings]}
        return out


class NonFiniteError(ArithmeticError):
    """Raised by a sentinel with ``on_nan="raise"`` at the first culprit."""

    def __init__(self, event: NanEvent, message: str | None = None) -> None:
        super().__init__(message or event.message())
        self.event = event


# --------------------------------------------------------------------------- tensor helpers
# The check of one tensor is its smallest and largest element (``aminmax``), both finite exactly
# when every element is: it propagates NaN, shows +inf and -inf, and, unlike a sum, cannot
# overflow on large finite values; one reduction (~3 us on a (256, 64) CPU tensor), written with
# ``out=`` into the sentinel's buffers (``_observers.deferred.Slots``: nothing allocated, nothing
# read at the call), and torch_npu has it (op-plugin's ``op_plugin_functions.yaml``: ``aminmax``,
# ``aminmax.out``).  Integers and bools are always finite; a complex tensor is checked through
# its real view; empty and sparse tensors are not checked.
_aminmax = torch.aminmax
_strided = torch.strided


class _State:
    """The sentinel's per-call state: how far the (deferred) checks of this call got when
    they were read (``_judge``, on a step that turned non-finite only).  No ``__init__``: the
    flags start as the class's, and only ``call`` is set per call (``begin``)."""

    call: Call
    bad_input = False     # a non-finite input was handed in (reported as received)
    out_done = False      # an output was reported already
    incoming_bad = False  # a non-finite gradient flowed in (reported as received)
    grad_done = False     # an input's gradient was reported already


# what a check was of: an input, an output, a gradient flowing in, a gradient sent to an input
_IN, _OUT, _GRAD_IN, _GRAD_OUT = 0, 1, 2, 3

# (what, call state, argument key or label, the tensor if kept, dtype, shape)
_Check = tuple[int, _State, Any, "torch.Tensor | None", torch.dtype, tuple[int, ...]]


# --------------------------------------------------------------------------- the sentinel
class NanSentinel(Observer):
    """Watch the guarded ops for the first NaN/inf; a context manager, or ``enable()`` /
    ``disable()``.  One sentinel is active at a time.

    The checks are judged on the device and read back once (``_observers.deferred``): each checked
    tensor leaves its smallest and largest element on its device, and they are read in one transfer when a
    result is asked for (``result()``, ``step()``, ``disable()`` / the end of the ``with``
    block), after each ``optimizer.step()`` when ``step_hook`` is on, or when ``limit`` checks
    are waiting.  The first culprit is the same as if each call were read at once: the checks
    are judged in the order they were made.

    ``on_nan``: ``"record"`` (default: keep the events, read ``result()``), ``"warn"`` (a
    ``RuntimeWarning`` with the first event) or ``"raise"`` (``NonFiniteError`` at the first
    event, from the op call or from ``backward()``); ``"warn"`` and ``"raise"`` react at the
    call that made the culprit, so they read at every checked call (one synchronisation per
    call on a device): use them to debug, not on a long run.  ``max_events`` bounds the events
    kept.

    ``always_on=True`` is the mode to leave on for a whole run (production): it keeps no
    tensor of the job alive until the read (the culprit's NaN and inf are then not counted,
    its op, argument, dtype, shape, call site and module are named exactly), reads at every
    ``optimizer.step()`` (``step_hook``) so a run costs one host read per step, and warns at
    the step that turned non-finite (``on_nan="warn"``, at the read) unless told otherwise.
    Without ``always_on`` the tensors checked since the last read are kept until it (to count
    the culprit's NaN and inf), up to ``keep_bytes`` (256 MiB; beyond, a check keeps only its
    flag and an event from it does not count NaN and inf): call ``step()`` at the end of each
    step, or give ``step_hook=True``.  ``limit``: checks waiting before a read is made anyway.
    """

    grads = True     # the layer probes inputs and hooks outputs for backward checks
    modules = True   # events name the nn.Module path

    def __init__(self, *, on_nan: OnNan | None = None, max_events: int = 32,
                 always_on: bool = False, watch: bool = False, step_hook: bool | None = None,
                 limit: int = 4096, keep_bytes: int = 256 << 20, sync: bool | None = None,
                 arm_steps: int = 100, max_replays: int = 3, watch_first: bool = False) -> None:
        if on_nan is None:
            on_nan = "warn" if always_on else "record"
        if on_nan not in _ON_NAN:
            raise ValueError(f"on_nan must be one of {', '.join(_ON_NAN)}, not {on_nan!r}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit!r}")
        if arm_steps < 1:
            raise ValueError(f"arm_steps must be at least 1, not {arm_steps!r}")
        self.on_nan = on_nan
        self.max_events = max_events
        self.always_on = always_on
        # the per-step check (always_on without watch): nothing per guarded call; the watch
        # runs only in a replay, or armed after a bad step
        self.stepwise = always_on and not watch
        self.step_hook = (always_on and not self.stepwise) if step_hook is None else step_hook
        # react at the call (per-call reads) only when the reaction must come from the call
        self._at_call = not self.stepwise and (
            on_nan == "raise" or (on_nan == "warn" and not always_on))
        # bytes of the job's tensors kept until the read (to count the culprit's NaN and inf);
        # beyond, a check keeps only its flag
        self._keep_bytes = keep_bytes
        self._keep_budget = 0 if always_on else keep_bytes
        self._kept = 0
        self._lock = threading.Lock()
        self._read_lock = threading.RLock()
        self._enabled = False
        self._found: Findings[NanEvent] = Findings(max_events)
        self._received: NanEvent | None = None
        self._calls = 0
        self._seq = 0
        self._steps = 0
        self._bad_steps: list[int] = []
        self._pending: Slots[_Check] = Slots(2, limit, on_full=self._read)
        self._boundary: StepBoundary | None = None
        # the always-on step check (``stepwise``)
        self.sync = sync
        self.arm_steps = arm_steps
        self.max_replays = max_replays
        self._check: StepCheck | None = None
        self._findings: list[StepFinding] = []
        self._scope: StepScope | None = None
        self._scope_bad: tuple[StepFinding, Any] | None = None  # (finding, weak optimizer)
        self._armed: StepFinding | None = None
        self._armed_finite = 0
        self._watching = False  # attached to the layer (a replay, armed, or watch_first)
        self._replays = 0
        # the watch on until the first optimizer.step() (a script without one, a first step)
        self._first_watch = self.stepwise and watch_first

    # ----------------------------------------------------------------- public
    def enable(self) -> NanSentinel:
        """Watch every guarded op (idempotent: a second call picks up new ones); always-on
        (without ``watch``): check every ``optimizer.step()``."""
        global _active
        with _lock:
            if _active is not None and _active is not self:
                raise RuntimeError("another NanSentinel is active; disable it first")
            self._enabled = True
            _active = self
            if self.stepwise:
                if self._check is None:
                    self._check = StepCheck(self._on_step, sync=self.sync)
                self._wire()
                self._check.attach()
                if self._first_watch and not self._watching:
                    self._watching = True
                if self._watching:
                    layer.attach(self, who="opcontracts.nan")
            else:
                layer.attach(self, who="opcontracts.nan")
            if self.step_hook and self._boundary is None:
                self._boundary = StepBoundary(self.step)
        return self

    def disable(self) -> NanResult:
        """Stop watching (the guards are the patch's own objects again when no other observer
        is attached); returns the result."""
        global _active
        with _lock:
            if self._enabled:
                if not self.stepwise or self._watching:
                    layer.detach(self)
                if self._check is not None:
                    self._check.remove()
                if _active is self:
                    _active = None
                self._enabled = False
            if self._boundary is not None:
                self._boundary.remove()
                self._boundary = None
        return self.result()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def reset(self) -> None:
        """Forget what was found (and the checks not read yet)."""
        self._pending.clear()
        with self._lock:
            self._found.clear()
            self._received = None
            self._calls = 0
            self._seq = 0
            self._steps = 0
            self._bad_steps = []
            self._findings = []
            self._replays = 0
        if self._check is not None:
            self._check.steps = 0
            self._check.bad_steps = []

    def step(self) -> bool:
        """The end of a training step: read the checks the step left on the device (one host
        read) and judge them; whether a culprit is known now.  Called by ``optimizer.step()``
        with ``step_hook``.  Always-on (without ``watch``) the steps are counted at
        ``optimizer.step()`` itself: this only reads what an armed watch left."""
        if self.stepwise:  # nothing waits unless the watch is on (a replay, armed)
            if self._watching:
                self._read()
            return self._found.first is not None
        self._read()
        with self._lock:
            self._steps += 1
            if self._found.first is not None and not self._bad_steps:
                self._bad_steps.append(self._steps)
            return self._found.first is not None

    @property
    def steps(self) -> int:
        """Step boundaries seen (``step()`` calls; always-on: ``optimizer.step()`` calls)."""
        if self.stepwise:
            return self._check.steps if self._check is not None else 0
        return self._steps

    @property
    def first_bad_step(self) -> int | None:
        """The step (1-based, counted by ``step()``) whose read found the first culprit;
        always-on: the first ``optimizer.step()`` found non-finite."""
        if self.stepwise:
            bad = self._check.bad_steps if self._check is not None else []
            return bad[0] if bad else None
        return self._bad_steps[0] if self._bad_steps else None

    @property
    def findings(self) -> list[StepFinding]:
        """Always-on: the non-finite steps looked into (replayed, or watched for a recurrence)."""
        return list(self._findings)

    def result(self) -> NanResult:
        """What was found so far (reads the checks still on the device first)."""
        self._read()
        with self._lock:
            f = self._found
            res = NanResult(f.first, list(f.events), self._received, self._calls, f.dropped)
        if self.stepwise:
            res.steps = self.steps
            res.bad_steps = list(self._check.bad_steps) if self._check is not None else []
            res.findings = list(self._findings)
        return res

    def __enter__(self) -> NanSentinel:
        return self.enable()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.disable()

    # ----------------------------------------------------------------- always-on: steps
    def loss(self, t: T) -> T:
        """Check ``t`` (the step's loss) with the gradients at the next ``optimizer.step()``
        (always-on; no host read of its own); returns ``t``."""
        if self._check is not None and isinstance(t, torch.Tensor):
            self._check.loss(t)
        return t

    def run_step(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)``: one training step (forward, backward, ``optimizer.step()``)
        whose function is known, so that a non-finite step is replayed: run again on the same
        arguments, from the parameters the bad step started from (it was skipped) and the RNG
        states it started from, under the per-call watch, which names the first culprit.  The
        arguments are held only while the step runs (by reference: nothing is copied).  What
        ``@nan_step`` calls.  Without an always-on sentinel it is ``fn(*args, **kwargs)``."""
        if not self.begin_step():
            return fn(*args, **kwargs)
        try:
            self.record_call(fn, args, kwargs)
            out = fn(*args, **kwargs)
        except BaseException:
            self._close_scope()
            raise
        self.end_step()
        return out

    def begin_step(self) -> bool:
        """Open a step whose calls are recorded (``record_call``) until ``end_step()``, which
        replays them if the step went non-finite (the RNG states are taken here); whether one
        was opened (not when the sentinel is not always-on, or a step is open, or in a
        replay).  ``run_step`` and the transformers callback use it."""
        if (not self.stepwise or not self._enabled or self._scope is not None
                or (self._check is not None and self._check.replaying)):
            return False
        self._scope = StepScope()
        self._scope_bad = None
        return True

    def record_call(self, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> None:
        """Record a call of the open step (forward and backward: what a replay runs again)."""
        scope = self._scope
        if scope is not None and not (self._check is not None and self._check.replaying):
            scope.record(fn, args, kwargs)

    def end_step(self, clear_grads: bool = False) -> StepFinding | None:
        """Close the open step: replay it if it went non-finite (the finding), else drop its
        inputs.  ``clear_grads``: set the gradients to None after a replay (for a loop that
        accumulates into ``.grad`` from one step to the next, as the transformers Trainer)."""
        scope, bad = self._scope, self._scope_bad
        self._scope = self._scope_bad = None
        if scope is None or bad is None:
            if scope is not None:
                scope.release()
            return None
        finding, ref = bad
        opt = ref()
        try:
            self._replay(scope, finding, opt)
        finally:
            scope.release()
            if clear_grads and opt is not None:
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = None
        return finding

    def _close_scope(self) -> None:
        scope = self._scope
        self._scope = None
        self._scope_bad = None
        if scope is not None:
            scope.release()

    def _finite_step(self) -> None:
        """After the check of a finite ``optimizer.step()`` while the watch is armed (the
        step check calls nothing at a finite step otherwise): disarm after ``arm_steps``."""
        armed = self._armed
        if armed is not None and armed.culprit is None:
            self._armed_finite += 1
            if self._armed_finite >= self.arm_steps:
                armed.reproduced = False
                armed.note = f"saw no NaN recur in {self.arm_steps} step(s), and was disarmed"
                self._disarm()

    def _on_step(self, v: StepVerdict) -> None:
        """After the check of an ``optimizer.step()`` found non-finite (the step is skipped
        already)."""
        armed = self._armed
        f = StepFinding(v.step, v.nonfinite, v.nonfinite_count, v.checked, ranks_bad=v.ranks_bad)
        if v.step == 1 and self._found.first is not None and not self._findings:
            f.how, f.culprit, f.reproduced, f.at_step = "watched", self._found.first, True, 1
            self._findings.append(f)
            self._tell(f)
            return
        localise = (self._found.first is None and armed is None
                    and self._replays < self.max_replays
                    and len(self._findings) < self.max_events)
        if armed is not None and armed.culprit is not None and armed.at_step == v.step:
            return  # the recurrence itself: told with the armed finding
        if not localise:
            return  # counted in bad_steps only
        self._findings.append(f)
        if self._scope is not None:
            f.how = "replay"
            self._scope_bad = (f, weakref.ref(v.optimizer) if v.optimizer is not None
                               else (lambda: None))
            return
        f.how = "recurrence"
        self._arm(f)
        self._tell(f)

    def _before_step(self, _opt: Any) -> None:
        """At every ``optimizer.step()``, before the check: an armed watch reads the step's
        checks (the NaN recurred when it names a culprit)."""
        if self._first_watch:
            self._first_watch = False
            self._read()
            self._disarm()
        armed = self._armed
        if armed is None:
            return
        self._read()
        first = self._found.first
        if first is not None:
            armed.culprit = first
            armed.reproduced = True
            armed.at_step = self.steps
            self._disarm()
            self._tell(armed)
        elif self._received is not None and armed.received is None:
            armed.received = self._received

    def _wire(self) -> None:
        """Hand the step check only the callbacks the state needs: a finite step with no
        watch armed (and the first step's watch over) calls nothing of the sentinel."""
        check = self._check
        if check is not None:
            armed = self._armed is not None
            check.before = self._before_step if armed or self._first_watch else None
            check.on_finite = self._finite_step if armed else None

    def _arm(self, f: StepFinding) -> None:
        self._armed = f
        self._armed_finite = 0
        self._wire()
        self._keep_budget = 0  # a long run: no tensor of the job kept
        self._pending.clear()
        self._watching = True
        layer.attach(self, who="opcontracts.nan")

    def _disarm(self) -> None:
        self._armed = None
        self._wire()
        if self._watching:
            self._watching = False
            layer.detach(self)

    def _replay(self, scope: StepScope, f: StepFinding, opt: Any) -> None:
        """Run the bad step's calls again under the watch: the gradients cleared, the RNG
        states the step started from, the optimizer step skipped; the job's RNG states
        afterwards are those it had before the replay."""
        from ._observers.replay import RngStates

        check = self._check
        assert check is not None
        self._replays += 1
        t0 = time.perf_counter()
        after = RngStates()
        if opt is not None:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
        scope.rng.restore()
        self._pending.clear()
        self._keep_budget, self._kept = self._keep_bytes, 0
        check.replaying = True
        self._watching = True
        layer.attach(self, who="opcontracts.nan")
        error: BaseException | None = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the job's own, seen already
                for fn, args, kwargs in scope.calls:
                    fn(*args, **kwargs)
        except Exception as exc:  # the replay must not stop the job
            error = exc
        finally:
            self._watching = False
            layer.detach(self)
            check.replaying = False
            self._keep_budget = 0
            after.restore()
        self._read()
        f.culprit = self._found.first
        f.received = self._received
        if error is not None:
            f.note = f"the replay raised {type(error).__name__}: {error}"
        elif opt is not None:
            again = check.check(opt)  # None: finite
            f.reproduced = again is not None or f.culprit is not None
        else:
            f.reproduced = f.culprit is not None or f.received is not None
        f.replay_s = time.perf_counter() - t0
        self._tell(f)

    def _tell(self, f: StepFinding) -> None:
        """React to a finding: warn (at the user's line) or raise at a named culprit."""
        if self.on_nan == "record":
            return
        if self.on_nan == "raise" and f.culprit is not None:
            raise NonFiniteError(f.culprit, f.message())
        warn_at_caller("opcontracts.nan: " + f.message(), RuntimeWarning)

    # ----------------------------------------------------------------- the read
    def _read(self) -> None:
        """Judge every waiting check, in the order they were made (one host read)."""
        with self._read_lock:
            found: list[tuple[Any, ...]] = []
            # the step's checks, one host read; those not finite only (usually none: the
            # read tells it from the numbers' sum, without a loop over the checks)
            bad = self._pending.read(only_nonfinite=True)
            self._kept = 0
            for (what, st, key, t, dtype, shape), _numbers in bad:
                self._judge(found, what, st, key, t, dtype, shape)
            if not found:
                return
            # the step that turned non-finite: the events' NaN and inf, counted on the device
            # for every kept tensor at once (one more read, on that step only)
            counts: Pending[int] = Pending(limit=len(found) + 1)
            for i, ev in enumerate(found):
                t = ev[4]
                if t is not None:
                    if t.is_complex():
                        t = torch.view_as_real(t)
                    counts.add((torch.isnan(t).sum().reshape(1), torch.isinf(t).sum().reshape(1)),
                               i)
            numbers = {i: (int(n), int(f)) for i, (n, f) in counts.read()}
            for i, ev in enumerate(found):
                args: tuple[Any, ...] = (*ev[:4], numbers.get(i, (-1, -1)), *ev[5:])
                self._event(*args)

    def _judge(self, found: list[tuple[Any, ...]], what: int, st: _State, key: Any,
               t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """One non-finite check, judged as the per-call logic would have at the time: the
        event it makes, if any, goes to ``found`` (``_event``'s arguments)."""
        call = st.call
        if what == _IN:
            if st.bad_input:
                return
            st.bad_input = True
            site, where, backward_of = call.place()
            found.append((call.op, call.direction, "received", layer.arg_name(call.fn, key),
                          t, dtype, shape, site, where, backward_of))
        elif what == _OUT:
            if st.bad_input or st.out_done:
                return  # handed non-finite input: not this op's doing
            st.out_done = True
            site, where, backward_of = call.place()
            found.append((call.op, call.direction, "output", key, t, dtype, shape, site, where,
                          backward_of))
        elif what == _GRAD_IN:
            if st.incoming_bad:
                return
            st.incoming_bad = True
            found.append((call.op, "backward", "received", key, t, dtype, shape, call.site,
                          call.where))
        else:
            # handed a non-finite input in forward (its saved tensors hold it) or a non-finite
            # gradient in backward: the gradients it sends are not this op's doing
            if st.bad_input or st.incoming_bad or st.grad_done:
                return
            st.grad_done = True
            found.append((call.op, "backward", "input_grad", layer.arg_name(call.fn, key), t,
                          dtype, shape, call.site, call.where))

    # ----------------------------------------------------------------- events
    def _event(self, op: str, direction: Direction,
               kind: Literal["output", "input_grad", "received"], arg: str,
               counted: tuple[int, int], dtype: torch.dtype, shape: tuple[int, ...],
               site: CallSite | None, where: tuple[nn.Module, nn.Module] | None,
               backward_of: str | None = None) -> None:
        nan, inf = counted
        module, module_type = layer.module_name(where)
        with self._lock:
            self._seq += 1
            ev = NanEvent(op, direction, kind, arg, str(dtype).removeprefix("torch."),
                          tuple(int(n) for n in shape), nan, inf,
                          str(site) if site is not None else None, module, module_type,
                          backward_of, self._seq)
            if kind == "received":
                if self._received is None and self._found.first is None:
                    self._received = ev
                return
            first = self._found.add(ev)
        if first and not self.stepwise:  # always-on: told with its step (``_tell``)
            react(self.on_nan, ev.message(), lambda: NonFiniteError(ev))

    # ----------------------------------------------------------------- the observed call
    def _checks(self, st: _State, *groups: tuple[int, Iterable[tuple[Any, Any]]]) -> None:
        """Leave each checked tensor's smallest and largest element on its device, written into
        the sentinel's buffers (``_observers.deferred.Slots.put_many``: not read here), with
        what makes it a finding: ``groups`` are (what, (key, tensor or None) pairs), checked in
        order.

        The hot path of the sentinel (every floating tensor of every guarded call, forward and
        backward): per tensor only the type tests and the payload here, the slot and the
        reduction in ``put_many``; a tensor that requires grad is checked through a
        ``detach`` (``out=`` refuses it; the reduction joins no graph): ~0.8 us, where switching
        grad mode off around the call costs ~0.4 us and makes each reduction of such a tensor
        ~1.5 us slower (its autograd kernel still runs); one lock per call; nothing converted
        (dtype and shape as they come, named at the event)."""
        items: list[tuple[torch.Tensor, _Check]] = []
        budget = self._keep_budget
        for what, pairs in groups:
            for key, t in pairs:
                if not isinstance(t, torch.Tensor):
                    continue
                if t.is_floating_point():
                    if t.layout is not _strided or not t.numel():
                        continue
                    d = x = t.detach() if t.requires_grad else t
                elif t.is_complex() and t.layout is _strided and t.numel():
                    d = t.detach() if t.requires_grad else t
                    x = torch.view_as_real(d)
                else:
                    continue  # integers and bools are always finite
                kept = None
                if budget:
                    size = t.numel() * t.element_size()
                    if self._kept + size <= budget:
                        self._kept += size
                        kept = d  # the tensor itself, out of any graph (one detach at most)
                items.append((x, (what, st, key, kept, t.dtype, t.shape)))
        if items:
            self._pending.put_many(items, _aminmax)

    def begin(self, call: Call) -> Any:
        with self._lock:  # a ``+=`` is not atomic between threads (backward's, the main one)
            self._calls += 1
        st = _State()
        st.call = call
        self._checks(st, (_IN, call.inputs))
        return st

    def end(self, call: Call, state: Any, out: Any) -> None:
        self._checks(state, (_OUT, call.outputs))
        if self._at_call:
            self._read()

    def grad_output(self, call: Call, state: Any, label: str, position: int,
                    grad: torch.Tensor) -> None:
        self._checks(state, (_GRAD_IN, ((label, grad),)))

    def grad_inputs(self, call: Call, state: Any, grads: tuple[Any, ...]) -> None:
        self._checks(state, (_GRAD_OUT, zip(call.grad_keys, grads)))
        if self._at_call:
            self._read()

    def node_grads(self, call: Call, state: Any,
                 incoming: list[tuple[str, int, torch.Tensor]], grads: tuple[Any, ...]) -> None:
        # a one-node op's whole backward in one pass: the gradients in, then those sent
        self._checks(state, (_GRAD_IN, [(label, g) for label, _pos, g in incoming]),
                     (_GRAD_OUT, zip(call.grad_keys, grads)))
        if self._at_call:
            self._read()


_lock = threading.RLock()
_active: NanSentinel | None = None


# --------------------------------------------------------------------------- module functions
def enable(*, on_nan: OnNan | None = None, max_events: int = 32, always_on: bool = False,
           watch: bool = False, step_hook: bool | None = None) -> NanSentinel:
    """Turn the sentinel on (or return the active one, re-syncing with the patch); the
    arguments are ``NanSentinel``'s."""
    with _lock:
        s = _active
        if s is not None:
            return s.enable()
        return NanSentinel(on_nan=on_nan, max_events=max_events, always_on=always_on,
                           watch=watch, step_hook=step_hook).enable()


def disable() -> NanResult | None:
    """Turn the active sentinel off; its result, or None when none was on."""
    with _lock:
        s = _active
        return s.disable() if s is not None else None


def active() -> NanSentinel | None:
    """The sentinel that is on, or None."""
    return _active


def loss(t: T) -> T:
    """Hand the step's loss to the active always-on sentinel: it is checked with the gradients
    at the next ``optimizer.step()`` (in the same reduction and read); returns ``t``."""
    s = _active
    return s.loss(t) if s is not None else t


@overload
def nan_step(fn: Callable[..., R], /) -> Callable[..., R]: ...
@overload
def nan_step(*, sentinel: NanSentinel | None = None
             ) -> Callable[[Callable[..., R]], Callable[..., R]]: ...


def nan_step(fn: Callable[..., R] | None = None, /, *, sentinel: NanSentinel | None = None
             ) -> Any:
    """Mark a training step function (forward, backward, ``optimizer.step()``; its inputs as
    arguments) so that the always-on sentinel can replay a step that goes non-finite::

        @opcontracts.nan_step
        def train_step(batch):
            opt.zero_grad(); loss = model(batch); loss.backward(); opt.step()
            return loss

        with NanSentinel(always_on=True):
            for batch in loader:
                train_step(batch)

    A non-finite step is skipped at its ``optimizer.step()`` and, when the function returns,
    run again on the same arguments (held by reference while the step runs, dropped when it
    ends well), from the same parameters and RNG states, under the per-call watch: the
    sentinel's result names the first culprit, or says that the NaN did not reproduce.  The
    replay starts from the gradients cleared (as after ``zero_grad()``) and leaves the
    replay's gradients; its optimizer step is skipped too.  Without an active always-on
    sentinel (or ``sentinel``) the function runs as it is.  Why not a ``with`` block: a
    block's body cannot be run twice."""

    def wrap(f: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(f)
        def step(*args: Any, **kwargs: Any) -> R:
            s = sentinel if sentinel is not None else _active
            if s is None or not s.stepwise:
                return f(*args, **kwargs)
            return s.run_step(f, *args, **kwargs)

        step.__opcontracts_nan_step__ = True  # type: ignore[attr-defined]
        return step

    return wrap(fn) if fn is not None else wrap
