"""What a guard does while ``torch.compile`` traces it.

Dynamo traces the guard like any Python function, so the guard switches to this path when
``torch.compiler.is_compiling()``:

* the mode comes from ``_lang.modes.COMPILE_VIEW`` (``ContextVar.get`` is a graph break);
* the optimistic checker is traced: dtype and static-shape comparisons fold to constants under
  dynamo's own guards, so a conforming call adds nothing to the compiled code;
* on a violation, ``_decide`` runs *at trace time* as plain Python (``assume_constant_result``):
  it rebuilds the arguments as meta tensors (dtype, shape and strides: ``contiguous`` rules
  read them), runs the careful checker, records the violation,
  warns (``warn``: emitted from eager Python, once per compilation and call site, never from
  inside the graph where ``warnings.warn`` would break it) and returns a constant plan;
* ``strict``: the plan calls a ``torch.compiler.disable``-d function that raises the very same
  ``ContractViolation`` eagerly (a graph break, only on a violating call); under
  ``fullgraph=True`` the violation is raised at trace time as dynamo's ``UserError`` with the
  ``ContractViolation`` as its ``__cause__``;
* ``fix``: the plan lists the casts (``violations.plan_fix``, the eager planner, run on the meta
  tensors); ``.to(dtype)`` is traced into the graph.  An integer narrowing depends on the
  values, which tracing does not have: that call is fixed eagerly by a ``torch.compiler.disable``-d
  function (a graph break, only on such a call).

When the meta tensors conform although the traced check failed (they lost what a rule read,
such as a device), the call is decided eagerly on the real tensors, as outside compile (a graph
break on that call only): a rule is never skipped because tracing cannot answer it.

Value checks need data and are not run under compile.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch

from .._lang import modes
from ..errors import ContractFixWarning, ContractViolation, ContractWarning
from . import conditional
from .callsite import find_call_site
from .compile import BY_KEY, BY_TOKEN, FAST_BY_KEY, OP_BY_KEY
from .violations import (
    NeedsValues,
    Repair,
    _actual,
    _Bound,
    _record_and_message,
    _violated,
    _warn,
    fixed_message,
    plan_fix,
    violation_from_raw,
)

__all__ = ["call"]

_counter = itertools.count()
_pending: dict[int, ContractViolation] = {}


def _meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):  # strides too: `contiguous` rules read them
        return ("T", v.dtype, tuple(v.shape), tuple(v.stride()))
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return ("L", tuple(_meta(x) for x in v), isinstance(v, tuple))
    if v is None or isinstance(v, (bool, int, float, str)):
        return ("C", v)
    return ("?", type(v).__name__)


def _rebuild(m: Any) -> Any:
    kind = m[0]
    if kind == "T":
        return torch.empty_strided(m[2], m[3], dtype=m[1], device="meta")
    if kind == "L":
        items = [_rebuild(x) for x in m[1]]
        return tuple(items) if m[2] else items
    if kind == "C":
        return m[1]
    return object()


def _fullgraph() -> bool:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # pragma: no cover - internals moved: behave as without fullgraph
        return False


def _decide(key: int, mode: str, arg_metas: tuple[Any, ...], kw_metas: tuple[Any, ...]) -> tuple[Any, ...]:
    """Runs as plain Python at trace time; returns a constant plan for the traced code."""
    cc = BY_KEY[key]
    args = [_rebuild(m) for m in arg_metas]
    kwargs = {k: _rebuild(m) for k, m in kw_metas}
    raw = cc.check(*args, **kwargs)
    m = modes.parse_mode(mode)
    if raw is None:
        # the traced optimistic check failed, but the rebuilt meta tensors conform: they lost
        # what the rule read (a device, say).  Decide on the real tensors, eagerly (a graph
        # break on this call only), never by calling through unchecked.
        return ("eager",)
    verdict = conditional.judge(cc, tuple(args), kwargs)  # readings that disagree: as in eager
    if verdict is not None and verdict.decided is None:
        if verdict.conditional:
            conditional.warn_conditional(verdict, cc, _actual, sys._getframe(1), tuple(args), kwargs)
        return ("call",)
    b = _Bound(cc, tuple(args), kwargs)
    if m is modes.FIX:
        try:
            repairs = plan_fix(cc, b, raw)
        except NeedsValues:  # an integer narrowing: only the values can say
            return ("eager",)
    else:
        repairs = [Repair(raw, b.get(raw.rule.partner), None, None)]
    site = find_call_site(sys._getframe(1))
    names = [p.name for p in cc.params]
    plan: list[tuple[Any, ...]] = []
    for r in repairs:
        exc = violation_from_raw(r.raw, site, r.partner)
        if m is modes.WARN:
            msg, _ = _record_and_message(exc, site, m, False)
            _warn(exc, site, msg, ContractWarning)
            return ("call",)
        if r.new is None:
            _record_and_message(exc, site, m, False)
            if _fullgraph():
                from torch._dynamo.exc import UserError, UserErrorType

                raise UserError(UserErrorType.INVALID_INPUT, str(exc)) from exc
            token = next(_counter)
            _pending[token] = exc
            return ("raise", token)
        msg, _ = _record_and_message(exc, site, m, True)
        _warn(exc, site, f"{fixed_message(cc, r, exc)} (under torch.compile)\n{msg}",
              ContractFixWarning)
        name = r.raw.rule.arg
        where: Any = names.index(name) if name in names and names.index(name) < len(args) else name
        target = None if r.raw.rule.kind == "contiguous" else r.new.dtype  # None: .contiguous()
        plan.append((where, r.raw.index, target))
    return ("fix", tuple(plan))


def _apply_step(args: list[Any], kwargs: dict[str, Any], step: tuple[Any, ...]) -> None:
    where, index, target = step
    container: Any = args if isinstance(where, int) else kwargs
    v = container[where]
    if index is None:
        container[where] = v.contiguous() if target is None else v.to(target)
    else:
        items = list(v)
        items[index] = items[index].contiguous() if target is None else items[index].to(target)
        container[where] = type(v)(items) if isinstance(v, tuple) else items


def _raise(token: int) -> None:
    raise _pending[token]


def _eager(key: int, mode: str, fn: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Any:
    """The decision made eagerly, on the real tensors (a graph break, only on such a call),
    exactly as outside torch.compile: a ``fix`` repair that depends on the values, or a rule
    that the meta tensors rebuilt at trace time cannot answer."""
    return _violated(modes.parse_mode(mode), BY_KEY[key], fn, args, kwargs, depth=1)


def _build(token: int, generation: int) -> int:
    """Trace time: the key of a following guard's contract, validated and compiled now if no
    call built it yet (plain Python, not traced); -1 when no contract applies.  The registry's
    ``generation`` is an argument so that dynamo guards on it: a change to what applies
    recompiles the code that baked the key in."""
    guard = BY_TOKEN.get(token)
    cc = guard.__opcontracts_build__() if guard is not None else None  # type: ignore[attr-defined]
    return cc.key if cc is not None else -1


# Decorated at import (this module is imported only once torch.compile is tracing a guard):
# applying dynamo's decorators inside traced code would itself be a graph break.
import torch._dynamo  # noqa: E402

_decide_c = torch._dynamo.assume_constant_result(_decide)
_raise_c = torch.compiler.disable(_raise)
_eager_c = torch.compiler.disable(_eager)
_build_c = torch._dynamo.assume_constant_result(_build)


def lazy(token: int, generation: int) -> int:
    """The key of a following guard's contract, built at trace time if no eager call built
    it; -1 when none applies."""
    return _build_c(token, generation)  # type: ignore[no-any-return]


def call(key: int, fn: Callable[..., Any], args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> Any:
    """The traced guard: ``key`` names the compiled contract (see ``_engine.compile.BY_KEY``)."""
    view = modes.COMPILE_VIEW
    op = OP_BY_KEY[key]
    m = view.by_op.get(op, view.default) if view.by_op else view.default
    if m is modes.OFF:
        return fn(*args, **kwargs)
    if FAST_BY_KEY[key](*args, **kwargs) is True:
        return fn(*args, **kwargs)
    plan = _decide_c(key, m.value, tuple(_meta(a) for a in args),
                     tuple((k, _meta(v)) for k, v in kwargs.items()))
    if plan[0] == "raise":
        _raise_c(plan[1])
    elif plan[0] == "eager":
        return _eager_c(key, m.value, fn, args, kwargs)
    elif plan[0] == "fix":
        new_args, new_kwargs = list(args), dict(kwargs)
        for step in plan[1]:
            _apply_step(new_args, new_kwargs, step)
        return fn(*new_args, **new_kwargs)
    return fn(*args, **kwargs)
