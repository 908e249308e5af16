"""Guarding an op packet in place: ``torch.ops.npu.X`` stays the same ``OpOverloadPacket``.

Code that needs the packet itself breaks when it is replaced by a function: torch_npu's
inductor calls ``register_lowering(torch.ops.npu.npu_grouped_matmul)`` on first use (after the
patch), ``torch.library.register_fake`` and the decomposition tables walk the namespace, and
``torch_npu.npu_x is torch.ops.npu.npu_x`` is what torch_npu's own modules rely on.  So the
patch keeps the object and changes what calling it does:

* the packet's class becomes ``GuardedPacket``, a subclass whose ``__call__`` runs the guard
  (``OpOverloadPacket`` has no ``__slots__``: the swap keeps the object, its cached
  ``OpOverload``s, ``isinstance`` and every name bound to it, so no alias sweep is needed);
* the guard calls a *shadow*: a plain packet of the same op holding the very same
  ``OpOverload`` objects (the original ``__call__`` would run the guard again);
* under ``torch.compile`` dynamo would put a packet in the graph unchecked (it tells torch
  ops by ``isinstance``), so the packet is registered with dynamo as a polyfilled callable
  whose traceable function is the guard: dynamo inlines the guard exactly as it inlines a
  patched function (``_engine/traced.py``), and the guard's call of the shadow is the graph's
  node.  This is dynamo's internal table (``trace_rules._polyfilled_function_ids``, torch >=
  2.5): it is filled when dynamo is loaded (at once if it is, else by the patch's import hook
  when ``torch._dynamo`` finishes loading); where it is missing the call compiles unchecked,
  with one warning.

``unguard`` swaps the class back and takes the registration out.
"""

from __future__ import annotations

import inspect
import linecache
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GuardedPacket", "guard_in_place", "unguard", "shadow_of", "register_with_dynamo",
           "dynamo_pending", "set_guard", "DYNAMO"]

DYNAMO = "torch._dynamo"  # the module whose loading completes what dynamo needs

_Packet = torch._ops.OpOverloadPacket
_lock = threading.Lock()
_guarded: dict[int, _Packet] = {}  # id -> packet, for dynamo's table
_registered: set[int] = set()
_warned = False


class GuardedPacket(_Packet):
    """An ``OpOverloadPacket`` whose call runs its guard (``_oc_guard``, on the instance)."""

    __opcontracts_patched__ = True

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        # one instance-dict read on top of the packet's own call
        return self._oc_guard(*args, **kwargs)

    def __getattr__(self, key: str) -> Any:
        # only for names the instance and class lack (never on the call path): the guard's
        # own attributes (its contract, memo, op name, ``__wrapped__``) read through the
        # packet as they read through a patched function
        if key.startswith("__opcontracts") or key == "__wrapped__":
            traced = self.__dict__.get("_oc_traced")
            if traced is not None:
                return getattr(traced, key)
        return super().__getattr__(key)


def shadow_of(packet: _Packet) -> _Packet:
    """A plain packet for ``packet``'s op, sharing its ``OpOverload`` objects (lowerings and
    fakes are keyed on those), named as it is (FX prints a graph's node by its module)."""
    name = packet._qualified_op_name.split("::", 1)[1]
    shadow = _Packet(packet._qualified_op_name, name, packet._op, packet._overload_names)
    for overload in packet.overloads():
        setattr(shadow, overload, getattr(packet, overload))
    shadow.__module__ = packet.__module__
    return shadow


def guard_in_place(packet: _Packet, guard: Callable[..., Any]) -> None:
    """Make calling ``packet`` run ``guard`` (which calls ``shadow_of(packet)``)."""
    packet._oc_guard = guard  # type: ignore[attr-defined]
    packet._oc_traced = guard  # type: ignore[attr-defined]  # what dynamo traces
    _TRACED[id(packet)] = guard
    try:  # what inspect.signature reports: the op's parameters, as for a patched function
        packet.__signature__ = inspect.signature(guard)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    packet.__class__ = GuardedPacket
    with _lock:
        _guarded[id(packet)] = packet
    if DYNAMO in sys.modules:
        register_with_dynamo()


def set_guard(packet: GuardedPacket, guard: Callable[..., Any]) -> None:
    """Put another callable in front (the observer layer's wrapper); compiled code keeps
    tracing the guard registered with dynamo."""
    packet._oc_guard = guard  # type: ignore[attr-defined]


def unguard(packet: _Packet) -> None:
    with _lock:
        _guarded.pop(id(packet), None)
        _TRACED.pop(id(packet), None)
        registered = id(packet) in _registered
        _registered.discard(id(packet))
    if type(packet) is GuardedPacket:
        packet.__class__ = _Packet  # type: ignore[assignment]
    packet.__dict__.pop("_oc_guard", None)
    packet.__dict__.pop("_oc_traced", None)
    packet.__dict__.pop("__signature__", None)
    if registered:
        tables = _dynamo_tables()
        if tables is not None:
            ids, handlers = tables
            try:
                ids.remove(id(packet))
            except KeyError:  # pragma: no cover - dynamo dropped it already
                pass
            handlers.pop(packet, None)


def dynamo_pending() -> bool:
    """Packets guarded while dynamo is not loaded: the import hook must watch for it."""
    with _lock:
        return bool(_guarded) and len(_registered) < len(_guarded)


class _Polyfill:
    """What dynamo's table holds for a packet: traced as its trampoline (``_trampoline``)."""

    def __init__(self, packet: _Packet, traced: Callable[..., Any]) -> None:
        self.packet = packet
        self.__torch_dynamo_polyfill__ = traced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never traced
        return self.packet(*args, **kwargs)


def _dynamo_tables() -> tuple[Any, dict[Any, Any]] | None:
    try:
        from torch._dynamo import trace_rules
        from torch._dynamo.variables.functions import PolyfilledFunctionVariable

        ids = trace_rules._polyfilled_function_ids
        handlers = PolyfilledFunctionVariable._get_polyfill_handlers()
        ids.add, ids.remove  # noqa: B018 - the API this relies on
    except (ImportError, AttributeError):
        return None
    return ids, handlers


# The guards dynamo traces, by packet id.  Dynamo builds a polyfill's function without a
# *source* (where it came from), and a function built so has its closure cells built as
# constants: a guard's cells (its compiled contract, its lock) cannot be.  So the polyfill is a
# trampoline reading the guard from this module's globals: a global has a source, and the
# guard is traced as a patched function read from its module is (cells read, guarded on).
# The guard itself, not a wrapper the observer layer may put in front (observers do not run
# under compile).
_TRACED: dict[int, Callable[..., Any]] = {}


def _trampoline(packet: _Packet) -> Callable[..., Any]:
    key = id(packet)
    name = packet._qualified_op_name.replace("::", "_")
    src = f"def {name}(*args, **kwargs):\n    return _TRACED[{key}](*args, **kwargs)\n"
    filename = f"<opcontracts packet {packet._qualified_op_name}>"
    ns: dict[str, Any] = {}
    exec(compile(src, filename, "exec"), globals(), ns)  # globals: `_TRACED` has a source
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    return ns[name]  # type: ignore[no-any-return]


def _skip_call_frame() -> None:
    """Dynamo must never compile ``GuardedPacket.__call__`` as a frame of its own (it does
    after a graph break inside the guard, e.g. strict's raise): there ``self`` is the
    polyfilled packet, whose attributes dynamo cannot read.  Skipped, the frame runs eagerly
    and the guard's frame below it is compiled, as a patched function's is."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - older torch: the polyfill inlines, nothing breaks
        return
    skip_code(GuardedPacket.__call__.__code__)


def register_with_dynamo() -> None:
    """Register every guarded packet not registered yet (dynamo is loaded)."""
    global _warned
    with _lock:
        todo = [p for i, p in _guarded.items() if i not in _registered]
    if not todo:
        return
    tables = _dynamo_tables()
    if tables is None:
        if not _warned:
            _warned = True
            warnings.warn("opcontracts: this torch's dynamo has no polyfill table "
                          "(torch >= 2.5 has it): guarded torch.ops packets called inside "
                          "torch.compile are not checked there (eager calls are)",
                          RuntimeWarning, stacklevel=2)
        with _lock:
            _registered.update(id(p) for p in todo)
        return
    ids, handlers = tables
    _skip_call_frame()
    for packet in todo:
        handlers[packet] = _Polyfill(packet, _trampoline(packet))
        ids.add(id(packet))
        with _lock:
            _registered.add(id(packet))
