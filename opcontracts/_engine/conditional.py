"""Calls whose verdict depends on a version nobody declared: warned once, not raised, not cast.

The guard enforces the strictest reading of an op's contracts (``readings``): a call it
accepts is accepted on every stack still possible, so nothing here runs for it.  A call it
rejects comes here from ``violations._violated`` (slow path) and is judged on each reading:

- rejected on every reading of some stack judged: a violation, as before (``decided`` says
  which reading, for the message's ``reading:`` line);
- rejected on some readings only: *conditional*.  Every mode warns once per call site
  (``ContractConditionalWarning``, naming the readings that reject and what would decide) and
  runs the call as it came: strict mode does not raise, fix mode does not cast.

A call site seen conditional learns the call's metadata (``memo``): a repeat with the same
tensors' metadata and constants warns (deduplicated by the warnings machinery) and runs
without the careful check and the readings.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._lang import values as _values
from .._lang import versions as _versions
from ..errors import ContractConditionalWarning, source_text
from . import memo
from . import registry as _registry
from .callsite import CallSite, find_call_site
from .compile import CompiledContract, RawViolation, compile_contract

if TYPE_CHECKING:
    from .readings import Resolution, Verdict

__all__ = ["judge", "repeat", "warn_conditional", "reading_note", "reset"]

_SITE_CAPACITY = 8  # call metadata learnt per call site
_lock = threading.Lock()
# (contract key, code, line) -> (message, site, warnings registry, learnt checks by call form:
# a check learnt for ``f(a, b, probs=p)`` cannot be called as ``f(a, b, p)``, ``memo.form``)
_sites: dict[tuple[Any, ...],
             tuple[str, CallSite | None, dict[Any, Any], dict[Any, tuple[Any, ...]]]] = {}


# (op, argument) -> the fields whose being unknown made it conditional, for the end of a run
# (kept across ``reset``: the pytest plugin's summary covers the whole session)
_seen: dict[tuple[str, str | None], str] = {}


def reset() -> None:
    with _lock:
        _sites.clear()


def summary() -> list[str]:
    """Lines for the end of a run (the pytest plugin's summary): the conditional calls seen,
    by op and argument; none when there were none."""
    with _lock:
        seen = dict(_seen)
    if not seen:
        return []
    what = ", ".join(f"{op} '{arg}' ({unknown})" for (op, arg), unknown in list(seen.items())[:5])
    more = f" and {len(seen) - 5} more" if len(seen) > 5 else ""
    return [f"{len(seen)} conditional call(s), rejected only on stacks a version unknown here "
            f"allows: {what}{more}; not violations: declare the target to decide "
            "(opcontracts.set_targets, OPCONTRACTS_TARGETS, [tool.opcontracts]; docs/targets.md)"]


def resolution(cc: CompiledContract) -> Resolution | None:
    """The registry's resolution ``cc`` was compiled from, when its readings can disagree."""
    res = _registry.resolution_of(cc.origin)
    return res if res is not None and res.split else None


def judge(cc: CompiledContract, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Verdict | None:
    """The call on every reading of ``cc``'s resolution; None when there is one reading (or the
    readings cannot judge this call): the strict verdict stands."""
    res = resolution(cc)
    if res is None:
        return None
    return res.judge(cc.params, args, kwargs, compile_contract)


def repeat(cc: CompiledContract, code: Any, line: int, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> bool:
    """A repeat of a conditional call already judged at this site: warn (once, by the warnings
    machinery) and say True; the caller runs the call."""
    entry = _sites.get((cc.key, code, line))
    if entry is None or (cc.has_values and _values.ENABLED[0]):
        return False
    for same in entry[3].get(memo.form(args, kwargs), ()):
        if same(*args, **kwargs):
            _emit(entry[0], entry[1], entry[2])
            return True
    return False


def _emit(message: str, site: CallSite | None, registry: dict[Any, Any]) -> None:
    if site is None:
        warnings.warn(message, ContractConditionalWarning, stacklevel=5)
    else:
        warnings.warn_explicit(message, ContractConditionalWarning, site.filename, site.lineno,
                               module=site.module, registry=registry)


def _unknown_text(res: Resolution) -> str:
    names = list(res.unknown) or ["a version"]
    return " and ".join(names) + (" unknown" if res.unknown else "")


def how_to_decide(res: Resolution, fields: tuple[str, ...] | None = None) -> str:
    """What a user sets so the verdict is decided (the variables name ``fields``, by default
    every field unknown)."""
    names = res.unknown if fields is None else fields
    example = _example(names)
    pins = [v for n in names if (v := _versions.ENV_VARS.get(n))]
    text = (f"set the target: OPCONTRACTS_TARGETS=\"{example}\", [tool.opcontracts] targets in "
            f"pyproject.toml, or opcontracts.set_targets({example.replace(',', ', ')})")
    if pins:
        text += " (or " + ", ".join(pins) + " on the machine itself)"
    return text


def _example(names: tuple[str, ...]) -> str:
    return ",".join(f"{n}={'Ascend910B3' if n == 'soc' else 'X'}" for n in names) or "cann=X"


def _conditions(label: str) -> list[str]:
    """A reading's label cut at its top-level ``and``: ``soc A and cann <8.0.0`` ->
    ``["soc A", "cann <8.0.0"]`` (a negated group in parentheses stays whole)."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(label):
        ch = label[i]
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and label.startswith(" and ", i):
            out.append(label[start:i])
            i += 5
            start = i
            continue
        i += 1
    out.append(label[start:])
    return [c.strip() for c in out if c.strip()]


def _common(labels: list[str]) -> list[str]:
    """The conditions every label has (in the first one's order): what the readings share."""
    if not labels:
        return []
    rest = [set(_conditions(x)) for x in labels[1:]]
    return [c for c in _conditions(labels[0]) if all(c in r for r in rest)]


def _field_of(condition: str) -> str | None:
    words = condition.removeprefix("not ").lstrip("(").split()
    return words[0] if words and words[0] in _versions.FIELDS else None


def _where(labels: list[str]) -> tuple[str, list[str]]:
    """Where the readings hold, short: their common conditions, else the first two and a
    count; and the conditions that text names (to find the fields that decide)."""
    labels = list(dict.fromkeys(labels))
    common = _common(labels)
    if common:
        return " and ".join(common), common
    more = f" (or {len(labels) - 2} more)" if len(labels) > 2 else ""
    return "; ".join(labels[:2]) + more, [c for x in labels for c in _conditions(x)]


def warn_conditional(verdict: Verdict, cc: CompiledContract,
                     actual: Callable[[RawViolation], str], caller: Any,
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Warn about a conditional call at the caller's line, and learn it for repeats."""
    res = verdict.resolution
    site = find_call_site(caller)
    first = verdict.rejected[0][1]
    arg = first.rule.arg if first.index is None else f"{first.rule.arg}[{first.index}]"
    rejecting = [r for r, _ in verdict.rejected]
    where, named = _where([r.label or "every stack" for r in rejecting])
    deciding = tuple(f for f in res.unknown if any(_field_of(c) == f for c in named)) \
        or res.unknown
    on = ""
    if res.targets and len({r.stack for r in rejecting}) == 1:
        on = f" on {res.stack_label(rejecting[0].stack)}"
    unknown = " and ".join(deciding) or "a version"
    # the first line says what decides and how to decide it; the details follow, short
    lines = [f"{cc.contract.op}: argument '{arg}' {actual(first)}: rejected only where "
             f"{where}{on}, and {unknown} {'is' if len(deciding) < 2 else 'are'} unknown here: "
             f"conditional until a target decides (OPCONTRACTS_TARGETS=\"{_example(deciding)}\")"]
    by_expected: dict[str, list[str]] = {}
    for r, raw in verdict.rejected:
        by_expected.setdefault(raw.rule.expected, []).append(_reading_name(res, r))
    total = len(rejecting) + len(verdict.accepted)
    for expected, names in by_expected.items():
        text, _ = _where(names)
        count = f" ({len(names)} of {total} readings)" if len(names) > 1 else ""
        lines.append(f"  rejected:  {text}{count}: expected {expected}")
    if verdict.accepted:
        text, _ = _where([_reading_name(res, r) for r in verdict.accepted])
        lines.append(f"  accepted:  {text}")
    lines.append(f"  source:    {source_text(first.rule.source, first.rule.layer)}")
    if site is not None:
        lines.append(f"  call site: {site}")
    lines.append("  verdict:   conditional: not raised (strict), not cast (fix), run as it came")
    lines.append(f"  to decide: {how_to_decide(res, deciding)}")
    message = "\n".join(lines)
    key = (cc.key, caller.f_code, caller.f_lineno)
    with _lock:
        old = _sites.get(key)
        registry = old[2] if old is not None else {}
        learnt = dict(old[3]) if old is not None else {}
        shape = memo.form(args, kwargs)
        have = learnt.get(shape, ())
        if len(have) < _SITE_CAPACITY and (have or len(learnt) < memo.SHAPES) \
                and not (cc.has_values and _values.ENABLED[0]):
            same = memo.learn(args, any(r.kind == "contiguous" for r in cc.rules), kwargs)
            if same is not None:
                learnt[shape] = have + (same,)
        if len(_sites) >= 4096:
            _sites.pop(next(iter(_sites)), None)
        _sites[key] = (message, site, registry, learnt)
        if len(_seen) < 4096:
            _seen[(cc.contract.op, arg)] = ", ".join(res.unknown) or "targets"
    _emit(message, site, registry)


def _reading_name(res: Resolution, r: Any) -> str:
    label = r.label or "every stack"
    return f"{res.stack_label(r.stack)}: {label}" if res.targets else label


def reading_note(verdict: Verdict) -> str:
    """A violation's ``readings:`` line: which reading decided, among how many."""
    res = verdict.resolution
    assert verdict.decided is not None
    r, _ = verdict.decided
    n = len(res.readings)
    if res.targets:
        stack = res.stack_label(r.stack)
        more = f" (as read where {r.label})" if r.label else ""
        return f"rejected on {stack}{more}"
    return (f"{_unknown_text(res)}: rejected on each of the {n} readings "
            f"({'; '.join(x.label for x in res.readings)}); the message shows the strictest, "
            f"which the fix satisfies on all of them (a declared target shows its own rule: "
            f"OPCONTRACTS_TARGETS, see docs/targets.md)")
