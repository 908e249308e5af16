"""Shadow compare: every guarded call (or a seeded sample) checked against its reference, online.

Contracts catch what someone wrote down; a kernel can still compute garbage on inputs no rule
forbids: finite garbage the NaN sentinel cannot see, a value rule nobody knew, a CANN regression.
msprobe's accuracy checker compares against CPU references offline, after a dump of hundreds of
GB, and has no reference for the MoE ops of the incident.  Here every op with a reference
(``opcontracts.reference``) is compared in the same run::

    from opcontracts.compare import ShadowCompare
    with ShadowCompare(sample=1.0) as sc:      # fraction of guarded calls compared (seeded)
        loss = model(batch); loss.backward()
    res = sc.result()
    res.first      # the first divergent call: .op, .direction, .argument, .module, .call_site,
                   # .metrics, .thresholds (what it was judged against, and their source)
    res.events, res.checked, res.skipped

* forward: the op's outputs against its reference run on up-cast copies of the inputs
  (fp16/bf16 -> fp32, fp32 -> fp64; mixed floating dtypes -> fp32, as msprobe does), on the CPU
  or on the call's own device (``device="same"``), judged per output dtype with msprobe's rules
  (``_observers.judge``); index outputs must be equal;
* backward: the gradients the op sends to its inputs against autograd through the reference on
  the same incoming gradients (the layer's probes isolate exactly this op's gradients, see
  ``_observers.layer``); a guarded ``*_grad`` kernel called in backward is compared like a forward call
  and named with the forward call whose backward ran it.

It works with contracts off or absent (``mode("off")``): it observes the guarded calls, whatever
the mode.  It never changes what the job computes: the reference runs on copies, never in place,
and nothing it does reaches the job's tensors or graph.  Ops without a reference are counted as
``skipped``; a reference that raises is counted in ``errors``, never raised.  An op without a
contract can be watched too: ``ShadowCompare(watch={"my_op": "mypkg.ops.my_op"})`` guards that
target with an empty contract (no rules) for the compare to see.

Host reads: none per compared call.  The judging numbers of each output (cosine terms, the
largest errors, the shares within 1%, 0.1%, 0.01%, the non-finite mismatches) are computed on
the reference's device into one small vector (``_observers.judge.measure``: no boolean indexing, which
would synchronise) and read with the step's others in one transfer (``_observers.deferred``) at
``result()``, ``step()``, the end of the ``with`` block or each ``optimizer.step()``
(``step_hook``); ``on_divergence="warn"`` / ``"raise"`` react at the call and read per call.
The reference's copies to the CPU (the default ``device``) are a device-to-host transfer per
compared call on an accelerator: give ``device="same"`` there.

Cost: off, nothing (no wrapper is installed).  On, per compared call: copies of the inputs, the
reference itself, the judging, and for backward the reference's autograd, so roughly the op
run twice in fp32 on the CPU plus copies (``benchmarks/bench_compare.py``).  ``sample`` keeps a
long run affordable: an unsampled call costs the layer's dispatch and one random draw.
"""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import torch

from . import reference
from ._observers import layer
from ._observers.deferred import Pending, StepBoundary
from ._observers.findings import Findings, later_lines, react
from ._observers.judge import SOURCE, Thresholds, Verdict, measure
from ._observers.layer import Call, Direction, Observer
from ._observers.sections import merge_sections, merged_lines  # across ranks: torch-free

__all__ = ["CompareResult", "Divergence", "DivergenceError", "ShadowCompare", "SOURCE",
           "merge_sections", "merged_lines"]

OnDivergence = Literal["record", "warn", "raise"]
_ON = ("record", "warn", "raise")

_NOTHING: tuple[torch.Tensor, ...] = ()  # a verdict known without a number: nothing to read

_UP = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64,
       torch.float64: torch.float64}


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Divergence:
    """One op output (or one input's gradient) that disagrees with the reference."""

    op: str
    direction: Direction
    kind: Literal["output", "input_grad"]
    argument: str                  # "output", "output[1]", or the input whose gradient diverged
    dtype: str
    shape: tuple[int, ...]
    reason: str                    # the failed test, in words
    metrics: dict[str, float]      # cosine, max_abs, max_rel, rel_err_hundredth, ...
    thresholds: Thresholds
    call_site: str | None
    module: str | None
    module_type: str | None
    backward_of: str | None = None  # for a *_grad op run in backward: the forward op
    reference_dtype: str = ""
    seq: int = 0

    @property
    def module_label(self) -> str:
        from ._observers.sections import module_label

        return module_label(self.module, self.module_type)

    @property
    def what(self) -> str:
        return f"gradient of '{self.argument}'" if self.kind == "input_grad" else self.argument

    def message(self) -> str:
        op = self.op + (f" (in the backward of {self.backward_of})" if self.backward_of else "")
        shape = "(" + ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "") + ")"
        m = self.metrics
        shown = ", ".join(f"{k} {m[k]:.4g}" for k in ("cosine", "max_abs", "max_rel",
                                                      "rel_err_hundredth", "rel_err_thousandth",
                                                      "error_rate") if k in m)
        lines = [
            f"divergence from the reference: {self.direction}, in {op}",
            f"  value:      {self.what}: {self.dtype} {shape} against the reference in "
            f"{self.reference_dtype or '?'}",
            f"  judged:     {self.reason}",
        ]
        if shown:
            lines.append(f"  metrics:    {shown}")
        lines += [f"  thresholds: {self.thresholds.describe()} (after msprobe)",
                  f"  call site:  {self.call_site or '?'}"]
        if self.module is not None:
            lines.append(f"  module:     {self.module_label}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.message()

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op, "direction": self.direction, "kind": self.kind,
            "argument": self.argument, "dtype": self.dtype, "shape": list(self.shape),
            "reason": self.reason, "metrics": dict(self.metrics),
            "thresholds": self.thresholds.to_dict(), "call_site": self.call_site,
            "module": self.module, "module_type": self.module_type,
            "backward_of": self.backward_of, "reference_dtype": self.reference_dtype,
            "seq": self.seq,
        }


@dataclass
class CompareResult:
    """What the compare found.  ``checked``: calls whose outputs were compared; ``grads_checked``:
    calls whose input gradients were; ``skipped``: calls of ops without a reference
    (``skipped_ops`` per op); ``unsampled``: calls left out by ``sample``; ``errors``: calls
    whose reference raised (``error_ops``); ``warnings``: outputs msprobe's rules only warn
    about; ``repaired``: calls ``fix`` mode repaired (judged on the repaired arguments: see
    ``_repaired``);
    ``grads_skipped``: calls whose gradients cannot be compared because the op consumes one of
    its own outputs (a Python op: the gradient reaching that output is not only the outside's;
    a fused kernel is one autograd node and never does)."""

    first: Divergence | None
    events: list[Divergence] = field(default_factory=list)
    checked: int = 0
    grads_checked: int = 0
    skipped: int = 0
    unsampled: int = 0
    errors: int = 0
    warnings: int = 0
    dropped: int = 0
    sample: float = 1.0
    skipped_ops: dict[str, int] = field(default_factory=dict)
    error_ops: dict[str, str] = field(default_factory=dict)
    checked_ops: dict[str, int] = field(default_factory=dict)
    repaired: int = 0
    grads_skipped: int = 0
    grads_skipped_ops: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.first is not None

    def summary(self) -> str:
        head = (f"shadow compare: {self.checked} call(s) compared with their reference"
                f" ({self.grads_checked} with gradients)")
        if self.sample < 1.0:
            head += f", sample {self.sample:g} ({self.unsampled} not drawn)"
        extra = []
        if self.skipped:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(self.skipped_ops.items()))
            extra.append(f"{self.skipped} call(s) skipped: no reference ({ops})")
        if self.errors:
            extra.append(f"{self.errors} call(s) whose reference raised ("
                         + "; ".join(f"{op}: {why}" for op, why in self.error_ops.items()) + ")")
        if self.warnings:
            extra.append(f"{self.warnings} output(s) within msprobe's warning band only")
        if self.grads_skipped:
            extra.append(f"{self.grads_skipped} call(s) whose gradients could not be compared: the "
                         "op reuses its own output ("
                         + ", ".join(f"{op} x{n}" for op, n in sorted(self.grads_skipped_ops.items()))
                         + ")")
        if self.repaired:
            extra.append(f"{self.repaired} call(s) repaired by fix mode, judged on the repaired "
                         "arguments the kernel got")
        if self.first is None:
            lines = [head + "; no divergence"]
            lines += ["  " + e for e in extra]
            return "\n".join(lines)
        lines = [head, self.first.message()]
        lines += later_lines(self.events[1:], self.dropped)
        lines += ["  " + e for e in extra]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        return {
            "first": self.first.to_dict() if self.first else None,
            "events": [e.to_dict() for e in self.events],
            "checked": self.checked, "grads_checked": self.grads_checked,
            "skipped": self.skipped, "unsampled": self.unsampled, "errors": self.errors,
            "warnings": self.warnings, "dropped": self.dropped, "sample": self.sample,
            "skipped_ops": dict(self.skipped_ops), "error_ops": dict(self.error_ops),
            "checked_ops": dict(self.checked_ops), "repaired": self.repaired,
            "grads_skipped": self.grads_skipped, "grads_skipped_ops": dict(self.grads_skipped_ops),
            "thresholds_source": SOURCE,
        }


class DivergenceError(ArithmeticError):
    """Raised by a compare with ``on_divergence="raise"`` at the first divergence."""

    def __init__(self, event: Divergence) -> None:
        super().__init__(event.message())
        self.event = event


# --------------------------------------------------------------------------- copies
def _upcast_map(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[torch.dtype, torch.dtype]:
    """msprobe's reference precision: fp16/bf16 -> fp32, fp32 -> fp64; mixed floating dtypes
    all go to fp32 (fp64 if one is fp64)."""
    floats = {t.dtype for _, t in layer.tensors(args, kwargs) if t.is_floating_point()}
    if len(floats) <= 1:
        return {d: _UP.get(d, d) for d in floats}
    target = torch.float64 if torch.float64 in floats else torch.float32
    return dict.fromkeys(floats, target)


def _copy(value: Any, up: Mapping[torch.dtype, torch.dtype], device: torch.device | None,
          grad: bool) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().to(device=device if device is not None else value.device,
                              dtype=up.get(value.dtype, value.dtype), copy=True)
        if grad and value.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        return t
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_copy(v, up, device, grad) for v in value)
    return value


def _repaired(call: Call, args: tuple[Any, ...], kwargs: dict[str, Any],
              ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments the kernel gets when ``fix`` mode repairs this call, or None when it does
    not.  The layer sits outside the guard and sees the arguments as the user passed them;
    judging the kernel's output against a reference of the unrepaired arguments would report
    the repair's own rounding as a divergence, so the reference runs on the repaired ones
    (the same planner as the guard's, ``_engine.violations.plan_fix``, on detached values)."""
    from ._engine.enforce import compiled_of
    from ._engine.violations import _Bound, plan_fix
    from ._lang import modes

    if modes.mode_for(call.op) is not modes.FIX:
        return None
    try:
        cc = compiled_of(call.fn)
        if cc is None:
            return None
        raw = cc.check(*args, **kwargs)
        if raw is None:
            return None
        with torch.no_grad():
            b = _Bound(cc, args, kwargs)
            repairs = plan_fix(cc, b, raw)
        if repairs[-1].new is None:  # the call fails in the guard: nothing runs to judge
            return None
        return tuple(b.args), dict(b.kwargs)
    except Exception:  # the check's own trouble: judge the call as it is
        return None


class _State:
    """One compared call: the reference's inputs (copies) and, for backward, its outputs."""

    __slots__ = ("ref", "args", "kwargs", "grad", "by_key", "ref_outs", "incoming", "device")

    def __init__(self, ref: reference.Reference, args: tuple[Any, ...], kwargs: dict[str, Any],
                 grad: bool, device: torch.device | None) -> None:
        self.ref = ref
        self.args: tuple[Any, ...] | None = args
        self.kwargs: dict[str, Any] | None = kwargs
        self.grad = grad
        self.by_key: dict[Any, torch.Tensor] = {}
        self.ref_outs: list[torch.Tensor] | None = None
        self.incoming: dict[int, torch.Tensor] = {}
        self.device = device


# --------------------------------------------------------------------------- the observer
class ShadowCompare(Observer):
    """Compare guarded calls with their references while the job runs; a context manager, or
    ``enable()`` / ``disable()``.

    ``sample``: the fraction of calls compared, drawn from ``random.Random(seed)`` (a ``*_grad``
    op run in backward is compared exactly when its forward call was, and named with its
    module and call site); ``step_hook``: judge at every ``optimizer.step()`` (one host read
    per step; else at ``result()`` / ``step()`` / the end); ``device``: where the
    reference runs (default the CPU; ``"same"``: each call's own device); ``backward``: also
    compare the gradients; ``on_divergence``: ``"record"`` (default), ``"warn"`` (a
    ``RuntimeWarning`` at the first) or ``"raise"`` (``DivergenceError``); ``max_events``
    bounds the divergences kept; ``watch``: ``{op: "module.function"}`` targets without a
    contract to guard (with an empty contract) so that they are compared too.
    """

    grads = True
    modules = True
    reuse = True   # gradients of an op that consumes its own output cannot be compared
    # sampling: a *_grad kernel run in backward follows its forward call, drawn or not; the
    # forward call of an undrawn one must be known too, or the kernel would be drawn on its own
    # and reported with no module and the .backward() line as its call site
    contexts = True

    def __init__(self, sample: float = 1.0, *, seed: int = 0, device: str | torch.device | None
                 = None, backward: bool = True, on_divergence: OnDivergence = "record",
                 max_events: int = 32, watch: Mapping[str, str] | None = None,
                 step_hook: bool = False, limit: int = 4096) -> None:
        if not 0.0 <= float(sample) <= 1.0:
            raise ValueError(f"sample must be a fraction in [0, 1], not {sample!r}")
        if on_divergence not in _ON:
            raise ValueError(f"on_divergence must be one of {', '.join(_ON)}, "
                             f"not {on_divergence!r}")
        self.sample = float(sample)
        self.seed = seed
        self.device = device
        self.backward = backward
        self.on_divergence = on_divergence
        self.max_events = max_events
        self.watch = dict(watch or {})
        self.step_hook = step_hook
        # react at the call (per-call reads) only when the reaction must come from the call
        self._at_call = on_divergence != "record"
        self._pending: Pending[Any] = Pending(limit, on_full=self._read)
        self._read_lock = threading.RLock()
        self._boundary: StepBoundary | None = None
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._drawn: weakref.WeakSet[Call] = weakref.WeakSet()
        self._enabled = False
        self._watched: list[str] = []
        self.reset()

    # ----------------------------------------------------------------- public
    def enable(self) -> ShadowCompare:
        with self._lock:
            if self.watch and not self._watched:
                self._watched = layer.watch(self.watch, source="opcontracts.compare")
        layer.attach(self, who="opcontracts.compare")
        self._enabled = True
        if self.step_hook and self._boundary is None:
            self._boundary = StepBoundary(self.step)
        return self

    def disable(self) -> CompareResult:
        if self._enabled:
            layer.detach(self)
            self._enabled = False
        if self._boundary is not None:
            self._boundary.remove()
            self._boundary = None
        return self.result()

    def step(self) -> bool:
        """The end of a training step: judge what the step measured (one host read); whether a
        divergence is known now.  Called by ``optimizer.step()`` with ``step_hook``."""
        self._read()
        with self._lock:
            return self._found.first is not None

    @property
    def enabled(self) -> bool:
        return self._enabled

    def __enter__(self) -> ShadowCompare:
        return self.enable()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.disable()

    def reset(self) -> None:
        self._pending.clear()
        with self._lock:
            self._found: Findings[Divergence] = Findings(self.max_events)
            self._checked = self._grads_checked = self._skipped = self._unsampled = 0
            self._errors = self._warnings = self._seq = self._repaired = 0
            self._grads_skipped = 0
            self._grads_skipped_ops: dict[str, int] = {}
            self._skipped_ops: dict[str, int] = {}
            self._error_ops: dict[str, str] = {}
            self._checked_ops: dict[str, int] = {}

    def result(self) -> CompareResult:
        """What was found so far (judges what is still waiting on the device first)."""
        self._read()
        with self._lock:
            f = self._found
            return CompareResult(f.first, list(f.events), self._checked,
                                 self._grads_checked, self._skipped, self._unsampled,
                                 self._errors, self._warnings, f.dropped, self.sample,
                                 dict(self._skipped_ops), dict(self._error_ops),
                                 dict(self._checked_ops), self._repaired,
                                 self._grads_skipped, dict(self._grads_skipped_ops))

    # ----------------------------------------------------------------- the observed call
    def _draw(self, call: Call) -> bool:
        ctx = call.context
        if ctx is not None:  # a *_grad op inside a backward node: as its forward call was
            return ctx in self._drawn
        # no guarded forward call runs this backward (a *_grad op a user's backward calls):
        # drawn on its own, named at its own line
        if self.sample >= 1.0:
            return True
        with self._lock:
            return self._rng.random() < self.sample

    def begin(self, call: Call) -> Any:
        if not self._draw(call):
            with self._lock:
                self._unsampled += 1
            return None
        ref = reference.get(call.op)
        if ref is None:
            with self._lock:
                self._skipped += 1
                self._skipped_ops[call.op] = self._skipped_ops.get(call.op, 0) + 1
            return None
        assert call.args is not None and call.kwargs is not None
        args, kwargs = call.args, call.kwargs
        fixed = _repaired(call, args, kwargs)
        if fixed is not None:  # judged on what the kernel gets
            args, kwargs = fixed
            with self._lock:
                self._repaired += 1
        grad = (self.backward and torch.is_grad_enabled()
                and any(t.requires_grad for _, t in call.inputs))
        try:
            device = self._device_of()
            up = _upcast_map(args, kwargs)
            with torch.no_grad():
                cargs = tuple(_copy(a, up, device, grad) for a in args)
                ckwargs = {k: _copy(v, up, device, grad) for k, v in kwargs.items()}
        except Exception as exc:  # a copy that cannot be made is the compare's problem only
            self._error(call.op, exc)
            return None
        st = _State(ref, cargs, ckwargs, grad, device)
        if grad:  # the user's tensors (the gradients reach them) by their copies' positions
            originals = call.inputs  # the arguments as given (``args`` may be repaired)
            copies = list(layer.tensors(cargs, ckwargs))
            st.by_key = {k: c for (k, t), (_, c) in zip(originals, copies) if t.requires_grad
                         and c.requires_grad}
        if call.context is None:
            self._drawn.add(call)
        _ = call.site  # judged after the call: its line is looked up while it runs
        return st

    def _device_of(self) -> torch.device | None:
        if self.device is None:
            return torch.device("cpu")
        if self.device == "same":
            return None  # each tensor stays where it is
        return torch.device(self.device)

    def end(self, call: Call, state: Any, out: Any) -> None:
        st: _State = state
        try:
            with layer.busy(), torch.set_grad_enabled(st.grad):
                ref_out = st.ref.forward(*st.args or (), **st.kwargs or {})
        except Exception as exc:  # the reference's failure is counted, never the job's
            self._error(call.op, exc)
            return
        finally:
            st.args = st.kwargs = None
        got = call.outputs
        want = list(layer.outputs(ref_out))
        with self._lock:
            self._checked += 1
            self._checked_ops[call.op] = self._checked_ops.get(call.op, 0) + 1
        if len(got) != len(want):
            self._error(call.op, ValueError(f"the op returned {len(got)} tensor(s), its "
                                            f"reference {len(want)}"))
            return
        for (name, a), (_, e) in zip(got, want):
            self._judged(call, "output", name, a, e)
        if st.grad:
            st.ref_outs = [e for _, e in want]
        if self._at_call:
            self._read()

    def grad_output(self, call: Call, state: Any, label: str, position: int,
                    grad: torch.Tensor) -> None:
        st: _State = state
        if st.ref_outs is None or position >= len(st.ref_outs):
            return
        ref_out = st.ref_outs[position]
        if not ref_out.requires_grad:
            return
        dev = st.device if st.device is not None else ref_out.device
        with torch.no_grad():
            st.incoming[position] = grad.detach().to(device=dev, dtype=ref_out.dtype, copy=True)

    def grad_inputs(self, call: Call, state: Any, grads: tuple[Any, ...]) -> None:
        st: _State = state
        outs, incoming = st.ref_outs, st.incoming
        st.ref_outs, st.incoming = None, {}  # the reference graph is used once
        if outs is None or not incoming:
            return
        if call.reused is None or call.reused:
            # the op consumes its own output (a Python op): the gradient reaching that output
            # includes the op's internal flow, not only what flows in from outside; there is no
            # incoming gradient to hand the reference
            with self._lock:
                self._grads_skipped += 1
                self._grads_skipped_ops[call.op] = self._grads_skipped_ops.get(call.op, 0) + 1
            return
        keys = [k for k in call.grad_keys if k in st.by_key]
        inputs = [st.by_key[k] for k in keys]
        pairs = [(outs[p], g) for p, g in sorted(incoming.items())]
        if not inputs or not pairs:
            return
        try:
            with layer.busy():
                ref_grads = torch.autograd.grad([o for o, _ in pairs], inputs,
                                                [g for _, g in pairs], allow_unused=True)
        except Exception as exc:
            self._error(call.op, exc)
            return
        by_key = dict(zip(call.grad_keys, grads))
        with self._lock:
            self._grads_checked += 1
        for k, inp, r in zip(keys, inputs, ref_grads):
            g = by_key.get(k)
            if g is None and r is None:
                continue
            if r is None:
                r = torch.zeros_like(inp)
            if g is None:
                g = torch.zeros(inp.shape, dtype=inp.dtype)
            name = layer.arg_name(call.fn, k)
            self._judged(call, "input_grad", name, g, r)
        if self._at_call:
            self._read()

    # ----------------------------------------------------------------- bookkeeping
    def _error(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self._errors += 1
            self._error_ops.setdefault(op, f"{type(exc).__name__}: {exc}"[:200])

    def _judged(self, call: Call, kind: Literal["output", "input_grad"], name: str,
                actual: torch.Tensor, expected: torch.Tensor) -> None:
        """Measure on the device now, judge at the read (``_observers.deferred``: one transfer for every
        judged output of a step, in the order they were measured)."""
        try:
            with torch.no_grad():
                m = measure(actual, expected)
        except Exception as exc:
            self._error(call.op, exc)
            return
        dtype = str(actual.dtype).removeprefix("torch.")
        shape = tuple(int(s) for s in actual.shape)
        ref_dtype = str(expected.dtype).removeprefix("torch.")
        if isinstance(m, Verdict):
            self._pending.add(_NOTHING, (call, kind, name, dtype, shape, ref_dtype, m))
        else:
            self._pending.add(m.vector, (call, kind, name, dtype, shape, ref_dtype, m))

    def _read(self) -> None:
        """Judge every measured output waiting on the device, in order (one host read)."""
        with self._read_lock:
            for (call, kind, name, dtype, shape, ref_dtype, m), numbers in self._pending.read():
                v = m if isinstance(m, Verdict) else m.verdict(numbers)
                self._verdict(call, kind, name, dtype, shape, ref_dtype, v)

    def _verdict(self, call: Call, kind: Literal["output", "input_grad"], name: str, dtype: str,
                 shape: tuple[int, ...], ref_dtype: str, v: Verdict) -> None:
        if v.status == "pass":
            return
        if v.status == "warning":
            with self._lock:
                self._warnings += 1
            return
        if kind == "input_grad":  # in backward: the forward call's place (its site is kept)
            site, where, backward_of = call.site, call.where, None
        else:  # during the call (a *_grad op: its forward call's place)
            site, where, backward_of = call.place()
        module, module_type = layer.module_name(where)
        direction: Direction = "backward" if kind == "input_grad" else call.direction
        with self._lock:
            self._seq += 1
            ev = Divergence(call.op, direction, kind, name, dtype, shape, v.reason, v.metrics,
                            v.thresholds, str(site) if site is not None else None, module,
                            module_type, backward_of, ref_dtype, self._seq)
            first = self._found.add(ev)
        if first:
            react(self.on_divergence, ev.message(), lambda: DivergenceError(ev))
