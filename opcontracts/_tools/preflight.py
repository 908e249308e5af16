"""``opcontracts.preflight``: a training step run on fake tensors, every guarded call judged.

    with opcontracts.preflight(targets="cann=8.0.RC3,soc=Ascend910B3") as pf:
        model = build_model(full_size_config).npu()
        loss = model(batch); loss.backward(); optimizer.step()
    print(pf.report.text())

Inside the block, on the emulated ``npu`` device (installed if it is not) and under torch's
``FakeTensorMode`` (``preflight_fake``), tensors have dtypes, shapes and devices but no memory
and no values: a step at full size costs the Python of its ops, not their FLOPs.  The guards
of ``opcontracts.patch`` judge every call against the declared targets (``targets=``, else
``OPCONTRACTS_TARGETS`` / ``pyproject.toml``) in a mode that records and never raises, so every
violation of the step is collected, per call site.  The report (``pf.report``) has each
violation's full message (op, argument, rule, the full-size shapes and bindings, the user's
line, the fix), every guarded call site seen with its shapes and verdict, the peak of the
device memory as the fake allocations add up, and the value rules fake tensors could not
judge.

``steps=N`` ends the block quietly after the N-th ``optimizer.step()``.  A line that needs a
tensor's value ends it with :class:`PreflightStop`, one message naming the line
(``preflight_reads``); ``preflight.active()`` is how code gives preflight a value or skips a
part.  On exit the process is put back: mode, targets, value checks, the patch and the
emulation as they were.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

from .._engine.records import Record
from .._observers.layer import Call, Observer
from ..errors import OpContractsError

__all__ = ["PreflightReport", "PreflightStop", "Site", "preflight"]

_active = 0  # preflights running in this process (active() reads it)
_GIB = 1 << 30


class PreflightStop(OpContractsError):
    """The step stopped at a line fake tensors cannot run (it reads a value); the message
    names the line and what to do.  ``report`` holds what was judged until then."""

    def __init__(self, message: str, report: PreflightReport) -> None:
        super().__init__(message)
        self.report = report


class _StepsDone(BaseException):
    """Raised by the optimizer-step hook after the last step asked for (BaseException: the
    script's ``except Exception`` does not swallow it)."""


@dataclass
class Site:
    """One guarded call site: its op, where, how often, the first call's tensors, the verdict
    (``ok``, ``violation``, ``conditional``: rejected only on some stacks still possible)."""

    op: str
    call_site: str
    direction: str
    calls: int
    tensors: str
    verdict: str = "ok"
    module: str | None = None


@dataclass
class PreflightReport:
    violations: list[Record] = field(default_factory=list)
    sites: list[Site] = field(default_factory=list)
    peak_bytes: int = 0
    steps: int = 0
    targets: str = ""
    not_judged: list[str] = field(default_factory=list)
    conditional: list[str] = field(default_factory=list)
    stopped: str | None = None

    @property
    def ok(self) -> bool:
        """No call violates a contract and the step ran to its end."""
        return not self.violations and self.stopped is None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "targets": self.targets, "steps": self.steps,
                "peak_device_bytes": self.peak_bytes, "stopped": self.stopped,
                "violations": [asdict(r) for r in self.violations],
                "sites": [asdict(s) for s in self.sites],
                "conditional": list(self.conditional),
                "value_rules_not_judged": list(self.not_judged)}

    def text(self) -> str:
        lines = [f"opcontracts preflight: judged on {self.targets}"]
        if self.violations:
            n = sum(r.count for r in self.violations)
            lines.append(f"{n} call(s) violate a contract, at {len(self.violations)} site(s):")
            for r in self.violations:
                lines.append("")
                times = f" ({r.count} calls)" if r.count > 1 else ""
                body = r.message.splitlines()
                lines.append(f"  {body[0]}{times}")
                lines.extend("  " + ln for ln in body[1:])
        else:
            lines.append("no call violates a contract.")
        for c in self.conditional:
            lines.append(f"conditional (rejected only on some stacks still possible): {c}")
        lines.append("")
        lines.append(f"guarded call sites ({len(self.sites)}):")
        lines.extend(_table(self.sites))
        if self.not_judged:
            lines.append("")
            lines.append("value rules not judged (fake tensors have no values):")
            lines.extend(f"  {t}" for t in self.not_judged)
        lines.append("")
        lines.append(f"peak device memory: {_size(self.peak_bytes)} (the live npu tensors at "
                     "their most; per device, before the allocator's overhead and the kernels' "
                     "workspace)")
        steps = f"{self.steps} optimizer step(s)" if self.steps else "no optimizer step"
        lines.append(f"ran: {steps}")
        if self.stopped:
            lines.append("")
            lines.append(self.stopped)
        return "\n".join(lines)


def _size(n: int) -> str:
    if n >= _GIB:
        return f"{n / _GIB:,.1f} GiB"
    return f"{n / (1 << 20):,.1f} MiB"


def _table(sites: Sequence[Site]) -> list[str]:
    if not sites:
        return ["  (none: no guarded op was called)"]
    head = ("verdict", "op", "call site", "dir", "calls", "tensors (first call)")
    rows = [(s.verdict, s.op, s.call_site, s.direction[:3], str(s.calls), s.tensors)
            for s in sites]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    out = []
    for r in [head, *rows]:
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
    return out


def _tensor_text(call: Call) -> str:
    from .._lang.dtypes import short_name
    from .._observers.layer import arg_name

    parts = []
    for key, t in call.inputs:
        parts.append(f"{arg_name(call.fn, key)} {short_name(t.dtype)}{tuple(t.shape)}")
    return ", ".join(parts)


class _Sites(Observer):
    """Every guarded call: its site row, and its verdict from the records and warnings."""

    def __init__(self, warned: list[Any]) -> None:
        self.rows: dict[tuple[str, str, str], Site] = {}
        self.warned = warned
        self.lock = threading.Lock()

    def begin(self, call: Call) -> Any:
        from .._engine import records

        return (records.report().total, len(self.warned), _tensor_text(call))

    def end(self, call: Call, state: Any, out: Any) -> None:
        from .._engine import records
        from ..errors import ContractConditionalWarning

        total, nwarn, tensors = state
        verdict = "ok"
        if records.report().total > total:
            verdict = "violation"
        elif any(issubclass(w.category, ContractConditionalWarning)
                 for w in self.warned[nwarn:]):
            verdict = "conditional"
        site, where, fwd_op = call.place()
        from .._observers.layer import module_name

        key = (call.op, str(site) if site else "?", call.direction)
        with self.lock:
            row = self.rows.get(key)
            if row is None:
                mod = module_name(where)[0] if where is not None else None
                self.rows[key] = Site(call.op, key[1], call.direction, 1, tensors, verdict, mod)
                return
            row.calls += 1
            if verdict == "violation" or (verdict == "conditional" and row.verdict == "ok"):
                row.verdict = verdict


def _targets_text() -> str:
    from .._lang import targets as _t

    chosen, origin = _t.declared()
    if not chosen:
        return "this environment (no targets declared: the emulation's versions, CANN and " \
               "the chip unknown; declare them with --targets, OPCONTRACTS_TARGETS or " \
               "[tool.opcontracts] in pyproject.toml)"
    return "; ".join(t.label for t in chosen) + f" (from {origin})"


def _not_judged(ops: Sequence[str]) -> list[str]:
    from .._engine import registry
    from .._lang.values import describe

    out = []
    for op in sorted(set(ops)):
        try:
            c = registry.resolve(op)
        except Exception:  # noqa: BLE001 - an op with no contract has no value rules
            continue
        if c is None:
            continue
        for name, arg in c.args.items():
            if arg.values is not None:
                out.append(f"{op}: {name}: {describe(arg.values)}")
    return out


class preflight:  # noqa: N801 - a context manager, read like opcontracts.mode
    """Run the block on fake tensors on the emulated npu device, every guarded call judged.

    ``targets``: the stacks to judge on (a string in ``OPCONTRACTS_TARGETS``'s form, a table,
    or a list of them); None: the declared ones.  ``steps``: end the block after this many
    ``optimizer.step()`` calls (None: run it to its end).  ``pf.report`` is the
    :class:`PreflightReport` (filled on exit).
    """

    def __init__(self, targets: str | Mapping[str, str] | Sequence[str | Mapping[str, str]]
                 | None = None, *, steps: int | None = None) -> None:
        if steps is not None and steps < 1:
            raise ValueError(f"preflight: steps must be at least 1, got {steps}")
        if isinstance(targets, (str, Mapping)):
            targets = [targets]
        self._targets = list(targets) if targets is not None else None
        self._steps = steps
        self.report = PreflightReport()
        self._undo: list[Any] = []
        self._done = 0

    @staticmethod
    def active() -> bool:
        """Whether code runs under a preflight (fake tensors: no values to read)."""
        return _active > 0

    @property
    def peak_bytes(self) -> int:
        return self._device.peak if hasattr(self, "_device") else self.report.peak_bytes

    def __enter__(self) -> preflight:
        global _active
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        _active += 1
        return self

    def _setup(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from .. import emulation
        from .._engine import records
        from .._lang import modes, values
        from .._lang import targets as _t
        from .._observers import layer
        from .preflight_fake import FakeDevice

        undo = self._undo
        if not emulation.installed():
            emulation.install("narrow", device=True)
            undo.append(emulation.uninstall)
        else:
            profile = emulation.current_profile()
            emulation.install(profile.name if profile is not None else "narrow", device=True)
        if self._targets is not None:
            prev = _t.set_targets(*self._targets)
            undo.append(lambda: _t.set_targets(*prev))
        self.report.targets = _targets_text()
        patch_mod = sys.modules.get("opcontracts.patch")
        was_patched = patch_mod is not None and patch_mod.is_applied()
        import opcontracts.patch as patch

        patch.apply()
        if not was_patched:
            undo.append(patch.unpatch)
        was_values = values.set_value_checks(False)  # they would read the fake tensors
        undo.append(lambda: values.set_value_checks(was_values))
        ctx = modes.mode("warn")  # records every violation, raises none
        ctx.__enter__()
        undo.append(lambda: ctx.__exit__(None, None, None))
        catcher = warnings.catch_warnings(record=True)
        self._warned: list[Any] = catcher.__enter__()
        undo.append(self._rewarn)
        undo.append(lambda: catcher.__exit__(None, None, None))
        from ..errors import ContractWarning

        warnings.simplefilter("always", ContractWarning)  # every call's verdict, not the first
        self._sites = _Sites(self._warned)
        layer.attach(self._sites, who="opcontracts preflight")
        undo.append(lambda: layer.detach(self._sites))
        handle = register_optimizer_step_post_hook(self._stepped)
        undo.append(handle.remove)
        self._before = {r.key: r.count for r in records.report().records}
        self._device = FakeDevice()
        self._device.__enter__()
        undo.append(lambda: self._device.__exit__(None, None, None))

    def _stepped(self, *_: Any) -> None:
        self._done += 1
        if self._steps is not None and self._done >= self._steps:
            raise _StepsDone

    def _rewarn(self) -> None:
        """The script's own warnings, shown after the fact (the contracts' are the report's)."""
        from ..errors import ContractWarning

        self._user_warnings = [w for w in self._warned
                               if not issubclass(w.category, ContractWarning)]

    def _teardown(self) -> None:
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - put back all the rest
                print(f"opcontracts preflight: restoring: {exc}", file=sys.stderr)
        for w in getattr(self, "_user_warnings", ()):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)

    def _collect(self) -> None:
        from .._engine import records

        rep = self.report
        rep.peak_bytes = self._device.peak
        rep.steps = self._done
        rep.violations = []
        for r in records.report().records:
            n = r.count - self._before.get(r.key, 0)
            if n > 0:
                r.count = n
                rep.violations.append(r)
        rep.sites = sorted(self._sites.rows.values(),
                           key=lambda s: (s.verdict == "ok", s.call_site, s.op))
        rep.conditional = sorted({f"{s.op} at {s.call_site}" for s in rep.sites
                                  if s.verdict == "conditional"})
        rep.not_judged = _not_judged([s.op for s in rep.sites])

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        global _active
        _active -= 1
        try:
            self._collect()
        finally:
            self._teardown()
        if exc is None or isinstance(exc, _StepsDone):
            return True
        from .preflight_reads import explain

        message = explain(exc)
        if message is not None:
            self.report.stopped = message
            raise PreflightStop(message, self.report) from None
        return False
