"""Enforcement modes: ``strict``, ``warn``, ``fix``, ``off``.

The mode in effect is a ``_State`` (a default plus per-op overrides) held in a ``ContextVar``,
so ``mode()`` contexts are local to their thread and asyncio task (like numpy's ``errstate``),
while ``set_mode()`` outside any context changes the process-wide state every thread sees.
Wrappers read it with one ``ContextVar.get`` and, when no per-op override exists, one attribute
load: ``current_state()`` is the whole cost of ``off`` mode.

Backward on a device runs on the autograd engine's worker thread, where the ``mode()`` of the
thread that called ``backward()`` is not set (a ContextVar belongs to its thread).  torch
(>= 2.12) hands that thread's ``contextvars`` context to the worker threads of each backward
(``torch.autograd.graph._engine_run_backward`` stashes ``copy_context()`` in the engine's
thread-local state).  While some ``mode()`` context is active in the process, a thread
without one of its own reads :class:`_Launcher`, which takes the mode from that stashed
context (the caller of the backward being run) and falls back to the process-wide state; with
no context active it reads the process-wide state directly, as before: nothing costs more
when ``mode()`` is not used.
"""

from __future__ import annotations

import enum
import functools
import os
import threading
from collections.abc import Callable, Mapping
from contextlib import ContextDecorator
from contextvars import ContextVar, Token
from types import MappingProxyType
from typing import Any, TypeVar

from ..errors import SettingError

__all__ = ["Mode", "set_mode", "get_mode", "mode", "current_state", "mode_for", "check_setting"]


class Mode(str, enum.Enum):
    STRICT = "strict"
    WARN = "warn"
    FIX = "fix"
    OFF = "off"

    def __str__(self) -> str:
        return self.value


STRICT, WARN, FIX, OFF = Mode.STRICT, Mode.WARN, Mode.FIX, Mode.OFF
_EMPTY: Mapping[str, Mode] = MappingProxyType({})


def parse_mode(value: str | Mode, *, where: str = "mode") -> Mode:
    if isinstance(value, Mode):
        return value
    try:
        return Mode(str(value).strip().lower())
    except ValueError:
        raise SettingError(
            f"{where}: unknown mode {value!r}; expected one of strict, warn, fix, off"
        ) from None


class _State:
    """Immutable: a new one is made on every change, so readers never see half an update."""

    __slots__ = ("default", "by_op")

    def __init__(self, default: Mode, by_op: Mapping[str, Mode] = _EMPTY) -> None:
        self.default = default
        self.by_op = by_op

    def for_op(self, op: str) -> Mode:
        return self.by_op.get(op, self.default) if self.by_op else self.default

    def with_mode(self, m: Mode, op: str | None) -> _State:
        if op is None:
            return _State(m, self.by_op)
        d = dict(self.by_op)
        d[op] = m
        return _State(self.default, MappingProxyType(d))


_setting_error: list[str] = []  # the message of a bad OPCONTRACTS_MODE, if any


def _initial() -> _State:
    """The starting mode, from ``OPCONTRACTS_MODE``.  A value that is not a mode stops the
    start-up of a job: falling back to ``warn`` would let a CI typo
    (``OPCONTRACTS_MODE=stirct``) silently weaken checking.  ``import opcontracts`` itself
    still works (so ``opcontracts env`` can show what is wrong); every way of checking calls
    raises ``SettingError`` naming the variable: ``import opcontracts.patch``, creating a guard
    (``@enforce``, the patch's), ``get_mode()`` (``check_setting``)."""
    raw = os.environ.get("OPCONTRACTS_MODE", "").strip()
    if not raw:
        return _State(WARN)
    try:
        return _State(parse_mode(raw, where="OPCONTRACTS_MODE"))
    except SettingError as exc:
        _setting_error.append(str(exc))
        return _State(WARN)  # never used to check a call: check_setting() raises first


def check_setting() -> None:
    """Raise ``SettingError`` if ``OPCONTRACTS_MODE`` (or another setting that decides what is
    checked, ``OPCONTRACTS_VALUES``) held a value that cannot be used."""
    if _setting_error:
        raise SettingError("; ".join(_setting_error))


def report_setting_error(message: str) -> None:
    """A setting read from the environment cannot be used: ``check_setting`` raises it."""
    if message not in _setting_error:
        _setting_error.append(message)


_process_state = _initial()  # set_mode() outside any context
_lock = threading.Lock()
_ctx: ContextVar[_State | None] = ContextVar("opcontracts_mode", default=None)


def _launch_state() -> _State:
    """The mode of the thread that launched the backward this thread is running, or the
    process-wide mode when it is not running one (or its launcher had no context)."""
    if _in_tls("context"):
        s = _from_tls("context").get(_ctx)
        if s is not None:
            return s  # type: ignore[no-any-return]
    return _process_state


class _Launcher(_State):
    """What a thread without a ``mode()`` context reads while one is active somewhere: a
    ``_State`` whose two attributes are resolved per read (two thread-local lookups)."""

    __slots__ = ()

    def __init__(self) -> None:  # no state of its own: it reads the launcher's
        pass

    @property
    def default(self) -> Mode:  # type: ignore[override]
        return _launch_state().default

    @property
    def by_op(self) -> Mapping[str, Mode]:  # type: ignore[override]
        return _launch_state().by_op


_LAUNCHER = _Launcher()
_active = 0  # mode() contexts entered and not yet exited, all threads together
# What a thread without a context of its own reads (guards read this name on every call):
# the process-wide state, or _LAUNCHER while a context is active and torch hands the
# launcher's context to the engine's threads.
_global_state: _State = _process_state


def _engine_hands_context() -> bool:
    """Whether this torch stashes the caller's context for backward (torch >= 2.12); binds
    the two lookups ``_launch_state`` makes."""
    global _in_tls, _from_tls
    import torch  # imported already by anyone who runs a backward

    has = getattr(torch._C, "_is_key_in_tls", None)
    get = getattr(torch._C, "_get_obj_in_tls", None)
    if has is None or get is None:
        return False
    _in_tls, _from_tls = has, get
    return True


def _not_in_tls(key: str) -> bool:
    return False


_in_tls: Callable[[str], bool] = _not_in_tls
_from_tls: Callable[[str], Any] = _not_in_tls
_hands_context: bool | None = None  # decided when the first context is entered


def _count(delta: int) -> None:
    """One more (fewer) active context; publish what contextless threads read."""
    global _active, _global_state, _hands_context
    with _lock:
        if _hands_context is None:
            _hands_context = _engine_hands_context()
        _active += delta
        _global_state = _LAUNCHER if _active and _hands_context else _process_state


def _set_process_state(state: _State) -> None:
    """Change the process-wide state (under _lock)."""
    global _process_state, _global_state
    _process_state = state
    if _global_state is not _LAUNCHER:
        _global_state = state


class _CompileView:
    """The mode as ``torch.compile`` sees it.

    Dynamo cannot trace ``ContextVar.get`` (a graph break), so compiled code reads this plain
    object instead; dynamo guards on what it reads, so changing the mode recompiles.  It is the
    mode of the thread that last changed it: compiled code does not see per-thread contexts.
    """

    def __init__(self) -> None:
        self.default: Mode = _process_state.default
        self.by_op: dict[str, Mode] = dict(_process_state.by_op)


COMPILE_VIEW = _CompileView()


def _sync() -> None:
    s = current_state()
    COMPILE_VIEW.default = s.default
    COMPILE_VIEW.by_op = dict(s.by_op)


def current_state() -> _State:
    s = _ctx.get()
    return (_launch_state() if _global_state is _LAUNCHER else _process_state) if s is None else s


def mode_for(op: str) -> Mode:
    """The mode that applies to ``op`` here and now."""
    return current_state().for_op(op)


def get_mode(op: str | None = None) -> str:
    """The current mode (for ``op`` when given) as a string."""
    check_setting()
    s = current_state()
    return (s.default if op is None else s.for_op(op)).value


def set_mode(mode: str | Mode, *, op: str | None = None) -> str:
    """Set the mode; returns the previous one (for ``op`` when given).

    Inside a ``mode()`` context this changes that context only; elsewhere it changes the
    process-wide mode seen by every thread that has not entered a context of its own.
    """
    m = parse_mode(mode)
    s = _ctx.get()
    if s is not None:
        prev = s.default if op is None else s.for_op(op)
        _ctx.set(s.with_mode(m, op))
        _sync()
        return prev.value
    with _lock:
        prev = _process_state.default if op is None else _process_state.for_op(op)
        _set_process_state(_process_state.with_mode(m, op))
    _sync()
    return prev.value


def clear_overrides() -> None:
    """Drop every per-op override (process-wide and in the current context)."""
    s = _ctx.get()
    if s is not None:
        _ctx.set(_State(s.default))
    with _lock:
        _set_process_state(_State(_process_state.default))
    _sync()


F = TypeVar("F", bound=Callable[..., Any])

# the (mode object, token) pairs entered in this context, innermost last: context-local like
# the state itself, so the token an exit resets is always one its own context created
_entered: ContextVar[tuple[tuple[mode, Token[_State | None]], ...]] = ContextVar(
    "opcontracts_mode_entered", default=())


class mode(ContextDecorator):  # noqa: N801 - reads like numpy.errstate
    """Use a mode for a block or a function: ``with opcontracts.mode("strict"): ...`` or
    ``@opcontracts.mode("fix")``.

    Without ``op``, the block's mode replaces per-op overrides too (the innermost scope wins);
    with ``op``, only that op's mode changes.  Contexts nest and are local to the thread or
    asyncio task that entered them.
    """

    def __init__(self, mode: str | Mode, *, op: str | None = None) -> None:
        self.mode = parse_mode(mode)
        self.op = op

    def __enter__(self) -> mode:
        cur = current_state()
        new = _State(self.mode) if self.op is None else cur.with_mode(self.mode, self.op)
        token = _ctx.set(new)
        _entered.set(_entered.get() + ((self, token),))
        _count(+1)
        _sync()
        return self

    def __exit__(self, *exc: object) -> None:
        # the innermost entry of this object in *this* context (task, thread): one object
        # entered by two overlapping asyncio tasks resets each task's own token
        stack = _entered.get()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is self:
                _entered.set(stack[:i] + stack[i + 1:])
                _ctx.reset(stack[i][1])
                _count(-1)
                break
        else:  # pragma: no cover - exit without enter
            raise RuntimeError(f"{self!r} exited in a context that did not enter it")
        _sync()

    def _recreate_cm(self) -> mode:
        # a fresh instance per decorated call: concurrent calls never share a token stack
        return type(self)(self.mode, op=self.op)

    def __call__(self, func: F) -> F:  # type: ignore[override]
        import inspect

        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def awrapper(*a: Any, **k: Any) -> Any:
                with self._recreate_cm():
                    return await func(*a, **k)
            return awrapper  # type: ignore[return-value]
        return super().__call__(func)

    def __repr__(self) -> str:
        extra = f", op={self.op!r}" if self.op else ""
        return f"opcontracts.mode({self.mode.value!r}{extra})"
