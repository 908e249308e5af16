"""The machinery behind ``import opcontracts.patch``: find targets, wrap them, undo it.

Kinds of target (a dotted path in a contract's ``targets``):

* a module attribute (``torch_npu.npu_swiglu``, ``mindspeed.ops.gmm.npu_gmm``): a function or
  an ``OpOverloadPacket``;
* an op packet in a ``torch.ops`` namespace (``torch.ops.npu.npu_swiglu``,
  ``torch.ops.atb._npu_paged_attention``: ``namespaces`` says what fills each);
* a class attribute (``pkg.mod.Class.method``), including ``staticmethod``/``classmethod``;
* a ``torch.autograd.Function`` subclass (``pkg.mod.MyFunction``): its ``apply`` is guarded.

Only modules already in ``sys.modules`` are touched: the patch never imports anything (importing
torch_npu without CANN fails and can break ``import torch``).  Targets in modules not imported yet
are *pending*: an import hook on ``sys.meta_path`` wraps the loader of exactly the modules on a
pending target's path and patches them the moment they finish executing, before the importer's
``from x import f`` runs.  Unrelated imports cost one set lookup.

Every change is recorded as (owner, attribute, original object) so ``unpatch`` restores the
originals ``is``-identically.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._engine import registry
from .._engine.compile import CompiledContract
from .._engine.enforce import compiled_for, make_guard, params_of
from .._engine.sweep import holding
from . import namespaces, packets
from .kernels import SLOTS, KernelGuards, reached_from_cpp

__all__ = ["Patcher", "PatchRecord"]

log = logging.getLogger("opcontracts.patch")

_MISSING = object()


@dataclass
class PatchRecord:
    """One change made by the patch."""

    target: str
    op: str
    kind: str  # function | packet | method | staticmethod | classmethod | autograd.Function | alias
    owner: Any = field(repr=False)
    attr: str
    original: Any = field(repr=False)  # the raw object found in owner.__dict__ (or _MISSING)
    where: str = ""

    def restore(self) -> None:
        if self.kind == "packet":  # guarded in place: the object stays, its call is undone
            packets.unguard(self.original)
            return
        if self.original is _MISSING:
            try:
                delattr(self.owner, self.attr)
            except AttributeError:
                pass
            # a torch.ops namespace lists the packets it created; one it no longer holds must
            # go from that list too, or torch's walks over the namespace (torch.export's
            # decomposition table, built by aot_eager and inductor) fail on the name
            listed = getattr(self.owner, "_dir", None) \
                if isinstance(self.owner, torch._ops._OpNamespace) else None
            if isinstance(listed, list):
                listed[:] = [n for n in listed if n != self.attr]
        else:
            setattr(self.owner, self.attr, self.original)


def _owner_name(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return repr(owner)


def _may_appear(module: types.ModuleType, attr: str) -> bool:
    """Whether ``module.attr`` may still appear: the module is still executing (its import is
    under way), or ``attr`` names a submodule that is not imported yet (found on the module's
    ``__path__`` without importing it)."""
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return True
    if getattr(module, "__path__", None) is None:
        return False  # not a package: no submodules
    try:
        return importlib.util.find_spec(f"{module.__name__}.{attr}") is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _is_autograd_function(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, torch.autograd.Function)


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the module it just executed."""

    def __init__(self, loader: Any, patcher: Patcher) -> None:
        self._loader = loader
        self._patcher = patcher

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        # restore the real loader so reloads and introspection see it
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if spec is not None and getattr(spec, "_initializing", False):
            # the module has executed: what it lacks now, it lacks (importlib clears the flag
            # itself a moment later, after this method returns)
            spec._initializing = False
        try:
            module.__loader__ = self._loader
        except AttributeError:  # pragma: no cover
            pass
        self._patcher.on_import(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_filename, ...
        return getattr(self._loader, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """A meta-path finder that only answers for modules on a pending target's path."""

    def __init__(self, patcher: Patcher) -> None:
        self._patcher = patcher
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._patcher.watched:  # unrelated imports: one set lookup
            return None
        if getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.on = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, self._patcher)
        return spec


class Patcher:
    """Holds the state of one patch: records, pending targets, the import hook."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.records: list[PatchRecord] = []
        self.guards: dict[int, tuple[Any, Callable[..., Any]]] = {}  # id(original) -> (original, guard)
        self.guard_ids: set[int] = set()
        self.pending: dict[str, str] = {}  # target path -> op name
        self.missing: dict[str, str] = {}  # target path -> why, reported once
        self.watched: frozenset[str] = frozenset()
        self.hook: _ImportHook | None = None
        self.active = False
        self.kernels = KernelGuards()  # backward ops, guarded at the dispatcher
        # torch.ops namespaces filled by torch.ops.load_library (torch.ops.atb), not an import
        self.libraries = namespaces.LibraryWatch(self._on_library_loaded)

    # ------------------------------------------------------------------ public-ish
    def apply(self, targets: Iterable[tuple[str, Iterable[str]]]) -> None:
        """Guard ``(op, targets)`` pairs; contracts are resolved by op name on first call."""
        with self.lock:
            self.active = True
            for op, paths in targets:
                for t in paths:
                    if not self._already_patched(t):
                        self.pending[t] = op
            self._retry_pending()
            self._install_hook()

    def unpatch(self) -> None:
        with self.lock:
            self.kernels.remove_all()
            for rec in reversed(self.records):
                rec.restore()
            self._unbind_late_aliases()
            self.records.clear()
            self.guards.clear()
            self.guard_ids.clear()
            self.pending.clear()
            self.missing.clear()
            self.watched = frozenset()
            self.libraries.remove()
            if self.hook is not None:
                try:
                    sys.meta_path.remove(self.hook)
                except ValueError:
                    pass
                self.hook = None
            self.active = False

    def _unbind_late_aliases(self) -> None:
        """Names bound to a guard after the patch (``from x import f`` in a module imported
        later) have no record: put the original back in them too, so no guard outlives
        ``unpatch()``.  One walk over the loaded modules' namespaces, at unpatch only."""
        originals = {id(g): o for o, g in self.guards.values()}
        if not originals:
            return
        for _modname, _mod, d in holding([g for _, g in self.guards.values()],
                                          skip_prefix="opcontracts"):
            for name, value in list(d.items()):
                o = originals.get(id(value))
                if o is not None:
                    d[name] = o

    def on_import(self, name: str) -> None:
        with self.lock:
            if self.active:
                if name == packets.DYNAMO:
                    packets.register_with_dynamo()
                self._retry_pending()

    def _on_library_loaded(self) -> None:
        """``torch.ops.load_library`` loaded a library: its namespace's ops may be there now."""
        with self.lock:
            if self.active:
                self._retry_pending()

    # ------------------------------------------------------------------ internals
    def _already_patched(self, target: str) -> bool:
        """A live record for ``target``: its owner still holds our guard.  A record whose guard
        is gone (the emulation's uninstall destroys the ``torch.ops.npu`` packets and whatever
        was set on them) is dropped, so a later ``apply()`` guards the new object."""
        live = False
        for r in list(self.records):
            if r.target != target:
                continue
            cur = getattr(r.owner, r.attr, None)
            # ours, or a layer someone put over ours (functools.wraps copies the marker)
            if id(cur) in self.guard_ids or getattr(cur, "__opcontracts_patched__", False):
                live = True
            else:
                self.records.remove(r)
        return live

    def _install_hook(self) -> None:
        watched: set[str] = set()
        for t in self.pending:
            parts = t.split(".")
            for i in range(1, len(parts)):
                watched.add(".".join(parts[:i]))
        if any(t.startswith("torch.ops.") for t in self.pending):
            watched.add("torch_npu")  # importing torch_npu registers the npu ops
        dynamo = packets.dynamo_pending()
        if dynamo:
            watched.add(packets.DYNAMO)  # packets guarded in place: dynamo must know them
        self.watched = frozenset(watched)
        self.libraries.sync(self.pending)
        if (self.pending or dynamo) and self.hook is None:
            self.hook = _ImportHook(self)
            sys.meta_path.insert(0, self.hook)
        elif not (self.pending or dynamo) and self.hook is not None:
            try:
                sys.meta_path.remove(self.hook)
            except ValueError:
                pass
            self.hook = None

    def _retry_pending(self) -> None:
        done: list[str] = []
        new_originals: dict[int, tuple[Any, Callable[..., Any]]] = {}
        for target, op in list(self.pending.items()):
            status = self._try_patch(target, op, new_originals)
            if status is None:
                done.append(target)
                self.missing.pop(target, None)
            elif status == "pending":
                self.missing.pop(target, None)  # waiting for its module, not missing
            elif target not in self.missing:
                self.missing[target] = status
                log.debug("opcontracts: target %s of %s not found: %s", target, op, status)
        for t in done:
            self.pending.pop(t, None)
        if new_originals:
            self._rebind_aliases(new_originals)
        self._install_hook()

    def _resolve_owner(self, target: str) -> tuple[Any, str, str] | str:
        """(owner object, attribute, owner module name) or a reason string."""
        parts = target.split(".")
        for i in range(len(parts) - 1, 0, -1):
            modname = ".".join(parts[:i])
            mod = sys.modules.get(modname)
            if mod is None:
                continue
            owner: Any = mod
            for j, p in enumerate(parts[i:-1]):
                try:
                    owner = getattr(owner, p)
                except (AttributeError, RuntimeError):
                    if isinstance(owner, types.ModuleType) and _may_appear(owner, p):
                        return "pending"  # a submodule not imported yet, or still executing
                    path = ".".join(parts[i:i + j + 1])
                    return f"{modname} has no attribute path {path}"
            return owner, parts[-1], modname
        return "pending"

    def _try_patch(self, target: str, op: str,
                   new_originals: dict[int, tuple[Any, Callable[..., Any]]]) -> str | None:
        res = self._resolve_owner(target)
        if isinstance(res, str):
            return res
        owner, attr, _modname = res
        try:
            raw = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        except Exception:  # pragma: no cover - exotic owners
            raw = _MISSING
        try:
            current = getattr(owner, attr)
        except (AttributeError, RuntimeError):
            if isinstance(owner, torch._ops._OpNamespace):
                if "torch_npu" not in sys.modules:
                    return "pending"  # torch.ops.npu / .atb before torch_npu registers them
                # kept pending: an import (npu) or a loaded library (atb) may still add it
                return namespaces.missing_op(owner.name, attr)
            if isinstance(owner, types.ModuleType) and _may_appear(owner, attr):
                return "pending"
            # kept pending too (a module may still set it later), but listed as not found
            return f"{_owner_name(owner)} has no attribute {attr!r}"
        if isinstance(current, torch._ops.OpOverloadPacket) and reached_from_cpp(op):
            self._guard_kernel(target, op, current)
            return None
        if id(current) in self.guard_ids:
            # already ours: rebound earlier, or copied from a patched object (torch_npu's
            # stand-in module copies torch.ops.npu attributes when it is imported after the
            # patch). Without a record of its own, unpatch would leave the guard here.
            if not isinstance(owner, type) and not any(
                    r.owner is owner and r.attr == attr for r in self.records):
                self.records.append(PatchRecord(target, op, "alias", owner, attr,
                                                getattr(current, "__wrapped__", raw),
                                                _owner_name(owner)))
            return None
        if getattr(current, "__opcontracts_patched__", False):
            return None
        if _is_autograd_function(current) and getattr(
                getattr(current.__dict__.get("apply"), "__func__", None),
                "__opcontracts_patched__", False):
            return None
        try:
            guard, kind, to_set, orig_callable = self._make(owner, attr, raw, current, op)
        except Exception as exc:  # a bad target must never break the job
            return f"cannot guard {target}: {exc}"
        if kind.startswith("autograd"):
            return None  # the class stays where it is; its apply was guarded in _make
        if kind == "packet":
            # the same object everywhere it is bound: no attribute to set, no alias to rebind
            packets.guard_in_place(current, guard)
            self.records.append(PatchRecord(target, op, kind, owner, attr, current,
                                            _owner_name(owner)))
            self.guard_ids.add(id(guard))
            return None
        setattr(owner, attr, to_set)
        self.records.append(PatchRecord(target, op, kind, owner, attr, raw, _owner_name(owner)))
        self.guard_ids.add(id(guard))
        if kind == "function":
            self.guards[id(orig_callable)] = (orig_callable, guard)
            new_originals[id(orig_callable)] = (orig_callable, guard)
        return None

    def _guard_kernel(self, target: str, op: str, packet: torch._ops.OpOverloadPacket) -> None:
        """A backward op: guarded at the dispatcher (``kernels``), whatever name led here;
        its packet and the attributes holding it stay as they are."""
        qualified = packet._qualified_op_name
        if self.kernels.installed(qualified):
            return
        guard = self._guard_for(self.kernels.below(packet.default), op, params_from=packet.default)
        slot = self.kernels.install(packet, guard)
        self.records.append(PatchRecord(target, op, "kernel", SLOTS, slot, _MISSING, qualified))
        self.guard_ids.add(id(guard))

    def _guard_for(self, original: Any, op: str, params_from: Any = None,
                   drop_first: bool = False) -> Callable[..., Any]:
        hit = self.guards.get(id(original))
        if hit is not None and hit[0] is original:
            return hit[1]
        src = params_from if params_from is not None else original

        def factory() -> CompiledContract | None:
            # runs on the guard's first call and after each change to what applies: validate
            # the contract, compile the checker (None: no contract applies here)
            contract = registry.resolve(op)
            if contract is None:
                return None
            params = params_of(src, contract)
            if drop_first and params and params[0].name in ("ctx", "_ctx"):
                params = params[1:]  # autograd.Function.forward(ctx, ...)
            return compiled_for(contract, params)

        guard = make_guard(original, op=op, factory=factory)
        guard.__opcontracts_patched__ = True  # type: ignore[attr-defined]
        if isinstance(original, torch._ops.OpOverloadPacket):
            # code that reaches through the packet (torch_npu.npu_x.default) keeps working
            for name in original.overloads():
                setattr(guard, name, getattr(original, name))
            guard.overloads = original.overloads  # type: ignore[attr-defined]
            # torch's walks over an op namespace call this (the decomposition table that
            # aot_eager and inductor build: "'CustomDecompTable' object is not a mapping")
            if hasattr(original, "op_overloads"):
                guard.op_overloads = original.op_overloads  # type: ignore[attr-defined]
            guard._qualified_op_name = original._qualified_op_name  # type: ignore[attr-defined]
            guard.__module__ = getattr(original, "__module__", None) or "torch.ops"
        return guard

    def _make(self, owner: Any, attr: str, raw: Any, current: Any, op: str
              ) -> tuple[Callable[..., Any], str, Any, Any]:
        if _is_autograd_function(current):
            fn_cls = current
            apply_raw = fn_cls.__dict__.get("apply", _MISSING)
            guard = self._guard_for(fn_cls.apply, op, params_from=fn_cls.forward, drop_first=True)
            self.records.append(PatchRecord(f"{_owner_name(fn_cls)}.apply", op,
                                            "autograd.Function", fn_cls, "apply", apply_raw,
                                            _owner_name(fn_cls)))
            self.guard_ids.add(id(guard))
            fn_cls.apply = staticmethod(guard)
            # the class itself stays bound where it was: nothing to set on the owner
            return guard, "autograd.Function(apply)", current, current
        if isinstance(owner, type):
            if isinstance(raw, staticmethod):
                guard = self._guard_for(raw.__func__, op)
                return guard, "staticmethod", staticmethod(guard), raw.__func__
            if isinstance(raw, classmethod):
                func = raw.__func__
                guard = self._guard_for(func, op)
                return guard, "classmethod", classmethod(guard), func
            if raw is _MISSING:
                raise TypeError(f"{attr} is inherited, not defined on {owner.__qualname__}")
            guard = self._guard_for(raw, op)
            return guard, "method", guard, raw
        if isinstance(current, torch._ops.OpOverloadPacket):
            # guarded in place (``packets``): the guard calls a shadow of the packet
            guard = self._guard_for(packets.shadow_of(current), op)
            return guard, "packet", current, current
        if not callable(current):
            raise TypeError(f"{attr} is a {type(current).__name__}, not callable")
        guard = self._guard_for(current, op)
        return guard, "function", guard, current

    def _rebind_aliases(self, originals: dict[int, tuple[Any, Callable[..., Any]]]) -> None:
        """Rebind names bound by ``from x import f`` before the patch, in every loaded module
        (what MindSpeed's patch manager does and msprobe does not)."""
        for modname, mod, d in holding([o for o, _ in originals.values()],
                                       skip_prefix="opcontracts"):
            for name, value in list(d.items()):
                hit = originals.get(id(value))
                if hit is None or hit[0] is not value:
                    continue
                guard = hit[1]
                d[name] = guard
                self.records.append(PatchRecord(f"{modname}.{name}", guard.__opcontracts_op__,  # type: ignore[attr-defined]
                                                "alias", mod, name, value, modname))

    def patched_list(self) -> list[PatchRecord]:
        with self.lock:
            return list(self.records)
