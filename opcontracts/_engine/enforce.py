"""The wrapper factory shared by the decorator and the patch, and what happens on a violation.

Hot path of a guarded call (see ``make_guard``)::

    state = ContextVar.get() or the process-wide state    # ~40 ns
    mode  = state.default (or a per-op override)           # one attribute load when none
    off?  -> original(*args, **kwargs)
    a check learnt from an earlier conforming call matches?  # ``_engine.memo``: ~230 ns, 3 tensors
          -> original(*args, **kwargs)
    fast(*args, **kwargs)                                  # generated, CPython binds the names
    True? -> learn its signature (bounded), original(*args, **kwargs)

Everything else (building the exception, finding the call site, warning, casting) is on the
slow path in ``_violated`` and runs only when a rule failed.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._lang import modes as _modes
from .._lang import targets
from .._lang import versions as _versions
from ..errors import ContractViolation
from . import conditional, memo
from . import registry as _registry
from .callsite import find_call_site
from .compile import BY_TOKEN, CompiledContract, Param, compile_contract
from .violations import (
    _actual,
    _Bound,
    _evict_oldest,
    _pins_strides,
    _values_switch,
    _violated,
    violation_from_raw,
)

__all__ = ["make_guard", "params_of", "violation_from_raw", "check_call", "explain_call",
           "compiled_for"]



# --------------------------------------------------------------------------- signatures
def _schema_params(schema: Any) -> list[Param]:
    out = []
    for a in schema.arguments:
        has = bool(a.has_default_value())
        out.append(Param(a.name, "KEYWORD_ONLY" if a.kwarg_only else "POSITIONAL_OR_KEYWORD",
                         a.default_value if has else None, has))
    return out


def params_of(fn: Any, contract: Any = None) -> list[Param] | None:
    """The parameter list of ``fn``: from a dispatcher schema for ``torch.ops`` objects,
    from ``inspect.signature`` otherwise.  A ``(*args, **kwargs)`` function (a generic
    wrapper) takes the contract's ``signature`` or its argument names in order."""
    if isinstance(fn, torch._ops.OpOverloadPacket):
        names = fn.overloads()
        ov = getattr(fn, "default", None) if "default" in names else (
            getattr(fn, names[0]) if names else None)
        if ov is not None:
            params = _schema_params(ov._schema)
            if "out" in names and ov is not fn.out:  # a call with the out tensors binds too
                have = {p.name for p in params}
                params += [Param(a.name, "KEYWORD_ONLY", None, True)
                           for a in fn.out._schema.arguments if a.name not in have]
            return params
    elif isinstance(fn, torch._ops.OpOverload):
        return _schema_params(fn._schema)
    else:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            params = [Param(p.name, p.kind.name,
                            None if p.default is p.empty else p.default, p.default is not p.empty)
                      for p in sig.parameters.values()]
            named = {p.name for p in params if p.kind not in ("VAR_POSITIONAL", "VAR_KEYWORD")}
            varargs = any(p.kind in ("VAR_POSITIONAL", "VAR_KEYWORD") for p in params)
            if contract is None or not varargs or all(a in named for a in contract.args):
                return params
    if contract is None:
        return None
    return [Param(n) for n in (contract.signature or tuple(contract.args))]


def _inspect_signature(params: Sequence[Param]) -> inspect.Signature:
    return inspect.Signature([
        inspect.Parameter(p.name, getattr(inspect.Parameter, p.kind)) for p in params
    ])


# --------------------------------------------------------------------------- the guard
# Lazy guards by token, for code traced by torch.compile (it names a guard's contract by a
# constant token); weak, so an unpatched guard is freed with everything its closure holds.
_tokens = itertools.count()
# Every guard that follows the registry (patched targets, ``enforce("op")``): told to forget
# its contract and its memo when what applies changes (see ``_on_registry_change``).
_FOLLOWING: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()

# True only while dynamo traces (it folds the call to a constant); in eager a bare `return False`
# (~18 ns, against ~50 ns for torch.compiler.is_compiling, which also asks TorchScript)
_is_dynamo_compiling: Callable[[], bool] = getattr(
    torch.compiler, "is_dynamo_compiling", getattr(torch.compiler, "is_compiling", lambda: False))


def _unguarded(*args: Any, **kwargs: Any) -> bool:
    """The optimistic check of a guard whose contract does not apply (or cannot be built)."""
    return True


def make_guard(fn: Callable[..., Any], cc: CompiledContract | None = None, *,
               op: str | None = None,
               factory: Callable[[], CompiledContract | None] | None = None,
               ) -> Callable[..., Any]:
    """Wrap ``fn`` so each call is checked against ``cc`` in the mode in effect.

    With ``factory`` (what the patch and ``enforce("op")`` use), the guard follows the
    registry: the contract is validated and compiled on the first call that needs a check
    (``import opcontracts.patch`` then costs no pydantic import and no code generation), and
    again after any change to what applies (``register``, ``set_versions``, new contracts, a
    new ``patch.apply()``): the registry tells every such guard to forget its contract and its
    memo, so the hot path tests nothing for it.  The factory returns None when no contract
    applies here: the guard then calls through.  A contract that cannot be built (a malformed
    user file) is a ``RuntimeWarning`` naming it, and the target runs unguarded: a user's file
    never kills the job.
    """
    if cc is None and factory is None:
        raise TypeError("make_guard needs a compiled contract or a factory")
    _modes.check_setting()  # a bad OPCONTRACTS_MODE stops the start-up, not a call
    if factory is not None:
        targets.check()  # so do bad targets (OPCONTRACTS_TARGETS, pyproject.toml)
    if op is None:
        assert cc is not None
        op = cc.contract.op
    get = _modes._ctx.get        # bound method: no attribute lookups per call
    modes = _modes
    OFF = _modes.OFF
    compiling = _is_dynamo_compiling  # folded to True by dynamo, ~18 ns in eager
    violated = _violated
    lock = threading.Lock()
    token = -1
    fast: Callable[..., Any]
    # the signature memo (``_engine.memo``): per call shape, checks of calls already seen to conform
    # (C++ for the tensors' metadata); tuples, replaced whole, so readers need no lock
    seen: dict[Any, tuple[Callable[..., bool], ...]] = {}
    tries: dict[Any, int] = {}  # learning attempts left; 0 once full or hopeless
    values: Sequence[bool] = (False,)  # the value-check switch when the contract has value rules

    def build() -> CompiledContract | None:
        """The contract to check against now, building it when none is (None: none applies)."""
        with lock:
            while fast is bootstrap:
                gen = _registry.GENERATION.value
                built = _build_from(factory, op)
                if gen == _registry.GENERATION.value:  # else it changed meanwhile: again
                    _install(built)
            return cc

    def bootstrap(*args: Any, **kwargs: Any) -> Any:
        build()
        return fast(*args, **kwargs)

    def _install(built: CompiledContract | None) -> None:
        nonlocal cc, fast, values
        cc = built
        if built is None:
            fast, values = _unguarded, (False,)
            guarded.__dict__.pop("__opcontracts__", None)
        else:
            guarded.__opcontracts__ = built  # type: ignore[attr-defined]
            fast = built.fast or _fast_from(built)
            values = _values_switch(built)

    def reset() -> None:
        """Forget the contract and the memo: the next call resolves and builds anew.  Takes no
        lock (the registry calls it holding its own; a build in another thread may be waiting
        for that one): a build that overlaps a change sees the generation move and redoes it."""
        nonlocal fast, cc
        seen.clear()
        tries.clear()
        fast, cc = bootstrap, None

    # a guard given its contract keeps it: its key is an int in a cell, which dynamo reads
    # even where it traces the guard without a source (a guarded packet's polyfill), where a
    # CompiledContract in a cell cannot be wrapped
    fixed_key = cc.key if cc is not None else -1
    if cc is not None:
        fast = cc.fast or _fast_from(cc)
        values = _values_switch(cc)
    else:
        fast = bootstrap

    def guarded(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # pytest shows the caller's frame, not this wrapper
        if compiling():
            from . import traced  # imported only once something is being compiled

            # read only what never changes (a token, a key) or what dynamo should guard on
            # (the registry's generation): a lazy guard's cells change as it builds
            key = traced.lazy(token, _registry.GENERATION.value) if token >= 0 else fixed_key
            return traced.call(key, fn, args, kwargs) if key >= 0 else fn(*args, **kwargs)
        s = get()
        if s is None:
            s = modes._global_state
        m = s.by_op.get(op, s.default) if s.by_op else s.default
        if m is OFF:
            return fn(*args, **kwargs)
        # learnt checks are kept by call shape: how many positional arguments, which keywords
        if not kwargs:  # the common case first: no dict unpacking, an int key
            shape: Any = len(args)
            if not values[0]:
                for same in seen.get(shape, ()):  # C++: same types, dtypes, sizes, devices
                    if same(*args):
                        return fn(*args)
        else:
            shape = (len(args), *kwargs)
            if not values[0]:
                for same in seen.get(shape, ()):
                    if same(*args, **kwargs):
                        return fn(*args, **kwargs)
        try:
            ok = fast(*args, **kwargs)  # the optimistic straight-line check
        except TypeError:  # the arguments do not even bind: let the original say so
            return fn(*args, **kwargs)
        if ok is True:
            if tries.get(shape, 1):
                remember(shape, args, kwargs)
            return fn(*args, **kwargs)
        # a verdict on versions read before a module appeared is never given (cheap when
        # nothing changed; when something did, the registry resets the guards)
        _versions.current()
        c = cc
        if c is None:  # reset since `fast` ran (versions changed): decide on the new contract
            return guarded(*args, **kwargs)
        try:
            return violated(m, c, fn, args, kwargs)
        except ContractViolation as exc:
            if not _raised_by_us(exc):  # from the kernel (a guard inside it): untouched
                raise
            raise exc.with_traceback(None)  # noqa: B904 - your call above broke the contract

    def remember(shape: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Learn a conforming call that no learnt check matched (slow path: ~5-30 us, at most
        ``CAPACITY`` times per call shape, for at most ``SHAPES`` shapes).  A miss once the
        memo is full means the sizes keep changing: the memo would only add its misses to every
        call, so it is dropped for good.  Calls it cannot describe (a list argument) stop the
        attempts after ``2 * CAPACITY``."""
        c = cc
        if values[0] or c is None:
            return
        same = None
        if memo.learnable(args, kwargs):
            if len(seen.get(shape, ())) >= memo.CAPACITY:
                with lock:
                    seen[shape], tries[shape] = (), 0
                return
            if shape not in seen and len(seen) >= memo.SHAPES:
                with lock:
                    tries[shape] = 0
                return
            same = memo.learn(args, _pins_strides(c), kwargs)
        with lock:
            if c is not cc:  # reset while learning: what was learnt is for an old contract
                return
            have = seen.get(shape, ())
            if same is None:
                tries[shape] = tries.get(shape, 2 * memo.CAPACITY) - 1
            elif len(have) < memo.CAPACITY:
                seen[shape] = have + (same,)

    try:
        functools.update_wrapper(guarded, fn)
    except (AttributeError, TypeError):  # pragma: no cover - exotic callables
        pass
    if not hasattr(guarded, "__wrapped__"):
        guarded.__wrapped__ = fn  # type: ignore[attr-defined]
    if isinstance(fn, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        guarded.__name__ = getattr(fn, "__name__", op)
        guarded.__qualname__ = guarded.__name__
        params = params_of(fn)
        if params is not None:
            guarded.__signature__ = _inspect_signature(params)  # type: ignore[attr-defined]
    if cc is not None:
        guarded.__opcontracts__ = cc  # type: ignore[attr-defined]
    if factory is not None:
        token = next(_tokens)
        BY_TOKEN[token] = guarded
        guarded.__opcontracts_reset__ = reset  # type: ignore[attr-defined]
        guarded.__opcontracts_build__ = build  # type: ignore[attr-defined]
        _FOLLOWING.add(guarded)
    guarded.__opcontracts_op__ = op  # type: ignore[attr-defined]
    guarded.__opcontracts_memo__ = seen  # type: ignore[attr-defined]  # for tests and debugging
    return guarded


def _build_from(factory: Callable[[], CompiledContract | None] | None, op: str,
                ) -> CompiledContract | None:
    """Run a guard's factory; None (call through) when nothing applies, or when the contract
    cannot be built (warned once per op and reason: the user's file is wrong, the job is not)."""
    assert factory is not None
    try:
        return factory()
    except _registry.UnknownOpError:
        return None
    except Exception as exc:  # noqa: BLE001 - a contract that cannot be built is not the job's end
        _warn_broken(op, exc)
        return None


_broken_warned: set[tuple[str, str]] = set()


def _warn_broken(op: str, exc: Exception) -> None:
    key = (op, str(exc))
    if key in _broken_warned:
        return
    _broken_warned.add(key)
    site = find_call_site(sys._getframe(1))
    text = (f"opcontracts: the contract of {op} cannot be used, so its targets run unchecked: "
            f"{exc}")
    if site is None:  # pragma: no cover - called from opcontracts itself
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    else:
        warnings.warn_explicit(text, RuntimeWarning, site.filename, site.lineno, module=site.module)


def _raised_by_us(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by ``_violated`` right below the frame catching it: its
    traceback is then cut at the guard, so a strict-mode traceback ends at the user's call
    with one line of ours (the guard's ``raise``), not in two to four of our frames."""
    tb = exc.__traceback__
    nxt = tb.tb_next if tb is not None else None
    return nxt is not None and nxt.tb_next is None and nxt.tb_frame.f_code is _violated.__code__


def _on_registry_change() -> None:
    """The registry changed what applies: every guard that follows it starts over."""
    for g in list(_FOLLOWING):
        reset = getattr(g, "__opcontracts_reset__", None)
        if reset is not None:
            reset()
    _compiled_cache.clear()  # replaced contracts' checkers are freed (and their linecache)


_registry.on_change(_on_registry_change)


def _fast_from(cc: CompiledContract) -> Callable[..., Any]:
    check = cc.check
    return lambda *a, **k: check(*a, **k) is None


def compiled_of(guard: Callable[..., Any]) -> CompiledContract | None:
    """The compiled contract behind a guard, building it for a lazy guard; None if ``guard``
    is not one of ours or no contract applies to it."""
    cc = getattr(guard, "__opcontracts__", None)
    if cc is None:
        build = getattr(guard, "__opcontracts_build__", None)
        cc = build() if build is not None else None
    return cc


_compiled_cache: dict[tuple[Any, ...], CompiledContract] = {}
COMPILED_CACHE_SIZE = 256  # the most recent ones: contracts replaced since are not kept alive


def _default_key(p: Param) -> Any:
    """A parameter's default as part of a cache key: targets that differ only in defaults get
    checkers of their own (a case on a left-out argument reads the default)."""
    v = p.default
    return (p.has_default, v if type(v) in (bool, int, float, str, type(None)) else id(v))


def compiled_for(contract: Any, params: Sequence[Param] | None = None) -> CompiledContract:
    key = (id(contract), None if params is None else
           tuple((p, _default_key(p)) for p in params))
    cc = _compiled_cache.get(key)
    if cc is None or cc.contract is not contract:
        cc = compile_contract(contract, params)
        _evict_oldest(_compiled_cache, COMPILED_CACHE_SIZE)
        _compiled_cache[key] = cc
    return cc


def _raw(cc: CompiledContract, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The careful checker's verdict (a ``RawViolation`` or None); ``TypeError`` naming the
    parameters when the arguments do not bind to them."""
    try:
        return cc.check(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{cc.contract.op}: arguments do not match its parameters "
                        f"({', '.join(p.name for p in cc.params)}): {exc}") from None


def check_call(cc: CompiledContract, args: tuple[Any, ...], kwargs: dict[str, Any], *,
               warn: bool = True) -> None:
    """Raise ``ContractViolation`` if the call does not conform (mode is ignored).  A call
    only some readings reject (a version unknown) is not raised: it is warned about as a guard
    does, unless ``warn`` is False (``probe``'s own trial calls, which it reports itself)."""
    __tracebackhide__ = True
    raw = _raw(cc, args, kwargs)
    if raw is None:
        return
    reading = None
    verdict = conditional.judge(cc, args, kwargs)  # the op's readings disagree: as a guard does
    if verdict is not None:
        if verdict.decided is None:
            if verdict.conditional and warn:
                conditional.warn_conditional(verdict, cc, _actual, sys._getframe(1), args, kwargs)
            return
        reading = conditional.reading_note(verdict)
    site = find_call_site(sys._getframe(1))
    raise violation_from_raw(raw, site, _Bound(cc, args, kwargs).get(raw.rule.partner), reading)


def allowed_only_while_unknown(cc: CompiledContract, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> bool:
    """True when the strict rules reject the call and only a reading of a version not known
    lets it through: ``check_call`` warns (conditional) instead of raising."""
    if _raw(cc, args, kwargs) is None:
        return False
    verdict = conditional.judge(cc, args, kwargs)
    return verdict is not None and verdict.conditional


def explain_call(cc: CompiledContract, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> ContractViolation | None:
    """The ``ContractViolation`` of the first rule of ``cc`` the call breaks, or None, without
    a call site and without the readings (a caller that judges them itself, as ``check-dump``
    does on ``Resolution.judge``).  ``TypeError`` when the arguments do not bind."""
    raw = _raw(cc, args, kwargs)
    if raw is None:
        return None
    return violation_from_raw(raw, None, _Bound(cc, args, kwargs).get(raw.rule.partner))
