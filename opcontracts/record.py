"""Record a golden run: what every guarded call received, written as a contract file.

``opcontracts run --record golden.toml train.py`` (or ``Recorder`` in code) watches every
guarded call (and the callables named with ``--record-target mod.fn``) and keeps, per op and
argument, the dtypes and ranks of the tensors seen, whether ``None`` was seen, and the constant
arguments (bool, int, float, str) when they took at most ``max_values`` values.  ``write()``
turns that into one ``[[contract]]`` per op:

* ``dtype``: the dtypes seen (most frequent first), ``rank``: the ranks seen, ``list = true``
  for tensor lists, ``optional = true`` when the argument was ``None`` or left out;
* ``allowed``: the values of a constant argument passed in every call (TOML has no null, so an
  argument seen as ``None`` gets no ``allowed``);
* ``source``: the script, the date and the versions (opcontracts, torch, torch_npu, CANN,
  MindSpeed, SoC); ``when = {torch = ">=0"}``: always true, it only keeps the recorded contract
  *next to* the shipped one for the same op (contracts with the same ``when`` replace each
  other; different ones that apply are merged into the strictest reading).

A later run with ``OPCONTRACTS_CONTRACTS=golden.toml`` then flags every call that drifts from
the golden run (a router switched to fp32, a tensor that lost a dimension, a flag flipped), on
top of the shipped rules.  Sizes are not recorded (they change with the batch); integer
arguments that follow the batch size may need their ``allowed`` line deleted by hand.

The recorder is an observer of the layer over the patch's guards (``_observers.layer``): off, nothing is
installed; on, each guarded call costs the layer's dispatch and one pass over its arguments.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ._engine.callsite import warn_at_caller
from ._jsonout import replace_text
from ._observers import layer
from ._observers.contract_out import dumps_contracts, stack_text, utc_now
from ._observers.layer import Call, Observer

__all__ = ["Recorder"]

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.float64: "fp64", torch.int64: "int64", torch.int32: "int32",
          torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
_CONST = (bool, int, float, str)


def _dtype_name(d: torch.dtype) -> str:
    return _SHORT.get(d, str(d).removeprefix("torch."))


@dataclass
class _Arg:
    """What one argument of one op received over the run."""

    dtypes: dict[str, int] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
    tensor_list: bool = False
    tensor: bool = False
    none: int = 0            # calls that passed None
    passed: int = 0          # calls that passed it at all
    values: list[Any] | None = field(default_factory=list)  # None: too many values to pin
    other: bool = False      # something else (a list of ints, an object): no rule


@dataclass
class _Op:
    calls: int = 0
    args: dict[str, _Arg] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


_var_cache: weakref.WeakKeyDictionary[Any, tuple[tuple[str, ...], bool]] = \
    weakref.WeakKeyDictionary()


def _names(fn: Any) -> tuple[tuple[str, ...], bool]:
    """The parameters a contract can name (not ``*args`` / ``**kwargs``), in order, and
    whether ``fn`` takes either (then positions past the names and unknown keywords are not
    recorded: a contract could not name them)."""
    try:
        return _var_cache[fn]
    except (KeyError, TypeError):
        pass
    names = layer.param_names(fn)
    var: set[str] = set()
    try:
        var = {p.name for p in inspect.signature(fn).parameters.values()
               if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    except (TypeError, ValueError):
        pass
    out = (tuple(n for n in names if n not in var), bool(var))
    try:
        _var_cache[fn] = out
    except TypeError:  # not weak-referenceable: not cached
        pass
    return out


class Recorder(Observer):
    """Keep what every guarded call received; ``write(path, script=...)`` as a contract file.
    A context manager, or ``enable()`` / ``disable()``; ``watch`` names targets without a
    contract to record too (``{op: "module.function"}``)."""

    def __init__(self, *, max_values: int = 16, watch: dict[str, str] | None = None,
                 record_violations: bool = False) -> None:
        self.max_values = max_values
        self.watch = dict(watch or {})
        self.record_violations = record_violations
        """keep the calls that violate the contract that applies (``--record-violations``);
        by default each is warned about and left out, so a golden file never pins a dtype the
        shipped rules reject"""
        self.violations: dict[str, int] = {}
        """calls left out (or, with ``record_violations``, kept) per op: they broke a contract"""
        self._ops: dict[str, _Op] = {}
        self.targets: dict[str, list[str]] = {}
        """op -> targets for the written contracts, beside those the patch guards"""
        self._lock = threading.Lock()
        self._enabled = False

    def enable(self) -> Recorder:
        if self.watch:
            layer.watch(self.watch, source="opcontracts.record")
        layer.attach(self, who="opcontracts.record")
        self._enabled = True
        return self

    def disable(self) -> Recorder:
        if self._enabled:
            layer.detach(self)
            self._enabled = False
        return self

    def __enter__(self) -> Recorder:
        return self.enable()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.disable()

    # ----------------------------------------------------------------- recording
    def _violates(self, call: Call) -> bool:
        """Whether the call breaks the contract its guard enforces (the shipped rules and any
        user's file loaded; warned about); a call the checker cannot judge counts as conforming."""
        from ._engine.enforce import compiled_of

        assert call.args is not None and call.kwargs is not None
        try:
            cc = compiled_of(call.fn)
            raw = cc.check(*call.args, **call.kwargs) if cc is not None else None
        except Exception:  # noqa: BLE001 - recording must never fail the call
            return False
        if raw is None:
            return False
        rule = raw.rule
        self.violations[call.op] = self.violations.get(call.op, 0) + 1
        what = "recorded anyway (--record-violations)" if self.record_violations \
            else "left out of the golden run (--record-violations keeps it)"
        site = call.site
        warn_at_caller(f"opcontracts.record: a call of {call.op} breaks its contract "
                      f"({rule.arg or '-'}: {rule.kind}, expected {rule.expected}) at "
                      f"{site if site is not None else '?'}: {what}",
                      RuntimeWarning)
        return True

    def begin(self, call: Call) -> Any:
        assert call.args is not None and call.kwargs is not None
        if self._violates(call) and not self.record_violations:
            return None
        names, var = _names(call.fn)
        self.add(call.op, names, call.args, call.kwargs, var=var)
        return None  # nothing to do after the call

    def add(self, op: str, names: Sequence[str], args: Sequence[Any],
            kwargs: Mapping[str, Any], *, var: bool = False) -> None:
        """Record one call of ``op`` (``names``: the parameters a contract can name, in order,
        which the positional ``args`` bind to; ``var``: the function also takes ``*args`` or
        ``**kwargs``, whose values no contract can name and which are not recorded): what every
        guarded call does, and what ``opcontracts record --from-dump`` does for each call an
        msprobe dump holds (meta tensors in the recorded dtypes and shapes)."""
        bound: dict[str, Any] = {}
        for i, v in enumerate(args):
            if i < len(names):  # beyond them: *args, which no contract argument can name
                bound[names[i]] = v
        bound.update((k, v) for k, v in kwargs.items() if not var or k in names)
        with self._lock:
            rec = self._ops.setdefault(op, _Op())
            rec.calls += 1
            for name in names:
                if name not in rec.args:
                    rec.args[name] = _Arg()
                    rec.order.append(name)
            for name, v in bound.items():
                a = rec.args.get(name)
                if a is None:
                    a = rec.args[name] = _Arg()
                    rec.order.append(name)
                self._see(a, v)

    def _see(self, a: _Arg, v: Any) -> None:
        a.passed += 1
        if v is None:
            a.none += 1
        elif isinstance(v, torch.Tensor):
            a.tensor = True
            n = _dtype_name(v.dtype)
            a.dtypes[n] = a.dtypes.get(n, 0) + 1
            a.ranks.add(v.dim())
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
            a.tensor = a.tensor_list = True
            for x in v:
                n = _dtype_name(x.dtype)
                a.dtypes[n] = a.dtypes.get(n, 0) + 1
                a.ranks.add(x.dim())
        elif isinstance(v, _CONST):
            if a.values is not None:
                if not any(type(v) is type(x) and v == x for x in a.values):
                    a.values.append(v)
                if len(a.values) > self.max_values:
                    a.values = None
        else:
            a.other = True

    # ----------------------------------------------------------------- output
    def calls(self) -> dict[str, int]:
        """Recorded calls per op."""
        with self._lock:
            return {op: r.calls for op, r in self._ops.items()}

    def contracts(self, *, script: str | None = None,
                  origin: str | None = None) -> list[dict[str, Any]]:
        """The recorded contracts as plain data (what ``write`` writes); ``origin`` says what
        was recorded instead of ``opcontracts run --record: script SCRIPT``."""
        targets = self._targets()
        origin = origin or f"opcontracts run --record: script {script or '?'}"
        source = f"recorded by {origin}, {utc_now()}, {stack_text()}"
        out = []
        with self._lock:
            for op in sorted(self._ops):
                rec = self._ops[op]
                args: dict[str, dict[str, Any]] = {}
                for name in rec.order:
                    rule = self._rule(rec.args[name], rec.calls)
                    if rule:
                        args[name] = rule
                out.append({"op": op, "targets": targets.get(op, []), "source": source,
                            "when": {"torch": ">=0"},
                            "doc": f"golden run: {rec.calls} call(s) of {op}", "args": args})
        return out

    def _rule(self, a: _Arg, calls: int) -> dict[str, Any]:
        absent = calls - a.passed
        if a.tensor and not a.other and not (a.values and len(a.values)):
            rule: dict[str, Any] = {}
            if a.tensor_list:
                rule["list"] = True
            rule["dtype"] = [d for d, _ in sorted(a.dtypes.items(), key=lambda kv: -kv[1])]
            if not a.tensor_list:
                rule["rank"] = sorted(a.ranks)
            if a.none or absent:
                rule["optional"] = True
            return rule
        if a.tensor or a.other:
            return {}  # mixed kinds: nothing safe to pin
        if a.values and not a.none and not absent:
            return {"allowed": list(a.values)}
        return {}

    def _targets(self) -> dict[str, list[str]]:
        import sys

        out: dict[str, list[str]] = {}
        patch = sys.modules.get("opcontracts.patch")
        if patch is not None:
            for rec in patch.patched():
                if rec.kind != "alias":
                    out.setdefault(rec.op, [])
                    if rec.target not in out[rec.op]:
                        out[rec.op].append(rec.target)
        for op, path in self.watch.items():
            out.setdefault(op, [path])
        for op, paths in self.targets.items():
            out.setdefault(op, list(paths))
        return out

    def write(self, path: str | Path, *, script: str | None = None,
              origin: str | None = None) -> Path:
        """Write the contract file (folders created); returns its path."""
        p = Path(path)
        if p.parent != Path(""):
            p.parent.mkdir(parents=True, exist_ok=True)
        calls = self.calls()
        what = origin or f"`opcontracts run --record` from {script or '?'}"
        header = [
            f"Golden run recorded by {what} on "
            f"{utc_now()}: {sum(calls.values())} guarded call(s) of {len(calls)} op(s).",
            "Use it with OPCONTRACTS_CONTRACTS=<this file>: a later run flags every call whose "
            "dtypes, ranks or",
            "constant arguments differ from this run, on top of the shipped rules (a user's "
            "contract adds to them).",
        ]
        left = {op: n for op, n in self.violations.items()}
        if left:
            header.append(("Calls that broke a contract were recorded too (--record-violations): "
                           if self.record_violations else
                           "Calls that broke a contract were left out: ")
                          + ", ".join(f"{op} ({n})" for op, n in sorted(left.items())) + ".")
        replace_text(p, dumps_contracts(self.contracts(script=script, origin=origin), header))
        return p
