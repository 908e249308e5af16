"""The emulated ``npu`` device: torch's PrivateUse1 backend, renamed ``npu``, over CPU memory.

An NPU tensor here is a plain ``torch.Tensor`` whose device is ``npu:0`` (``type(x) is
torch.Tensor``, ``x.is_npu``, ``x.device.type == "npu"``, as on the NPU) and whose storage
points at CPU memory: the storage is built on the CPU storage's data pointer
(``torch._C._construct_storage_from_data_pointer``) and holds that CPU storage as a Python
attribute, which torch keeps for as long as the storage lives (storage PyObject
preservation).  Views, ``detach()`` and ``Parameter`` share the storage, so they share the
memory, as on a device.  Kernels, registered through ``torch.library`` for ``PrivateUse1``:

* ``aten::empty_strided``, ``aten::empty.memory_format``: allocate on CPU, hand out an npu
  tensor over it; ``aten::_copy_from``: copies between the devices (``.to("npu")``,
  ``.cpu()``);
* every other ATen op: one boxed fallback on the global ``_`` namespace (:func:`call_on_cpu`):
  each npu argument is seen as a CPU tensor over the same memory, the op runs on CPU, tensor
  results come back as npu tensors (a mutated argument is returned as itself; an ``out=``
  argument the CPU kernel resized is pointed at its new memory);
* the emulated ``torch.ops.npu`` ops: the same :func:`call_on_cpu`, so their CPU kernels (the
  references under the active profile) compute and their results are npu tensors.

Because the tensors are on a device that is not the CPU, the autograd engine runs their
backward on its device worker thread, as on an NPU: hooks, ``autograd.Function.backward``
and the kernels of backward run on a thread other than the one that called ``backward()``.

What cannot be undone (torch allows it once per process): renaming PrivateUse1 to ``npu``,
the generated ``Tensor.npu`` / ``Tensor.is_npu`` / ``Module.npu`` methods, the Python device
hooks and guard, and ``torch.npu`` (``torch.compile`` asks a renamed backend for its module).
:func:`uninstall` removes the kernels and ``torch_npu.npu``; after it
``torch.npu.is_available()`` is False, ``device_count()`` 0, and creating an npu tensor fails
("Could not run 'aten::empty.memory_format' with arguments from the 'npu' backend"); tensors
made before keep their memory but no op runs on them.  The engine's queues for the device are
sized at the process's first backward: :func:`reserve` (the once-per-process part) must come
before it.  Not emulated: several devices (``device_count() == 1``), streams and events, pinned
memory, ``torch.save`` of npu tensors, resizing an npu storage in place
(``untyped_storage().resize_``), npu generators.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.library import Library

from . import _npu_api

__all__ = ["DEFAULT_SOC", "call_on_cpu", "drop_op_kernels", "install", "installed", "module",
           "register_op_kernels", "reported_soc", "reserve", "to_cpu_view", "to_npu", "uninstall"]

DEVICE_TYPE = "npu"
DEFAULT_SOC = "Ascend910B3"  # an A2 training chip (torch_npu.npu.get_device_name() on an 800T A2)

_lock = threading.RLock()
# the SoC reported; the current device; whether the device was used since install (torch_npu's
# lazy init runs at the first use: is_initialized() is False before it)
_state: dict[str, Any] = {"soc": DEFAULT_SOC, "current": 0, "initialized": False}
_libs: list[Library] = []      # aten kernels and the fallback, while installed
_op_libs: list[Library] = []   # kernels of the emulated npu ops
_CPU = torch.device("cpu")
_SET = torch.ops.aten.set_.source_Storage_storage_offset
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


# -- tensors ---------------------------------------------------------------------------------

def _npu_device() -> torch.device:
    return torch.device(DEVICE_TYPE, 0)


def _point(npu: torch.Tensor, cpu: torch.Tensor) -> None:
    """Make ``npu`` (an npu tensor) view ``cpu``'s memory with ``cpu``'s sizes and strides."""
    storage = cpu.untyped_storage()
    npu_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), _npu_device(), storage.nbytes())
    npu_storage._opcontracts_cpu = storage  # type: ignore[attr-defined]  # the memory lives as long as the npu storage
    # the CPU kernel of set_ only moves the storage pointer and the metadata; it runs on any
    # TensorImpl (the npu one has no storage yet)
    _SET.redispatch(_CPU_KEYS, npu, npu_storage, cpu.storage_offset(), cpu.size(), cpu.stride())


def to_npu(cpu: torch.Tensor) -> torch.Tensor:
    """An npu tensor over ``cpu``'s memory (no copy)."""
    npu = torch._C._acc.create_empty_tensor((0,), cpu.dtype)
    _point(npu, cpu)
    return npu


def to_cpu_view(npu: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over ``npu``'s memory (no copy)."""
    storage = npu.untyped_storage()
    cpu_storage = getattr(storage, "_opcontracts_cpu", None)
    if cpu_storage is None:  # an empty tensor made by torch itself (no memory)
        cpu_storage = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), _CPU, storage.nbytes())
    return torch.empty(0, dtype=npu.dtype).set_(
        cpu_storage, npu.storage_offset(), npu.size(), npu.stride())


def _unwrap(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return to_cpu_view(value) if value.device.type == DEVICE_TYPE else value
    if isinstance(value, torch.device):
        return _CPU if value.type == DEVICE_TYPE else value
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    return value


def _wrap(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return to_npu(value) if value.device.type == "cpu" else value
    if isinstance(value, (list, tuple)):
        return type(value)(_wrap(v) for v in value)
    return value


def _alias(info: Any) -> str | None:
    """The alias set a schema argument or return writes to (``Tensor(a!)``: ``"a"``)."""
    if info is None or not info.is_write or not info.before_set:
        return None
    return str(next(iter(info.before_set)))


class _Plan:
    """What :func:`call_on_cpu` needs of an op's schema, read once per op (a schema's
    ``arguments`` are new Python objects on every access)."""

    __slots__ = ("returns", "written")

    def __init__(self, op: torch._ops.OpOverload) -> None:
        schema = op._schema
        # (position, name, alias set) of each argument the op writes to
        self.written = tuple((i, a.name, alias) for i, a in enumerate(schema.arguments)
                             if (alias := _alias(a.alias_info)) is not None)
        # per return, the alias set it shares with a written argument (None: a new tensor)
        self.returns = tuple(_alias(r.alias_info) for r in schema.returns)


_plans: dict[torch._ops.OpOverload, _Plan] = {}


def _repoint_resized(original: Any, view: Any) -> None:
    """After an op wrote into ``view`` (the CPU view of the npu ``original``): if the CPU
    kernel resized it (an ``out=`` argument), point ``original`` at the new memory."""
    if not isinstance(original, torch.Tensor) or original.device.type != DEVICE_TYPE:
        return
    if (view.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
            or view.size() != original.size() or view.stride() != original.stride()
            or view.storage_offset() != original.storage_offset()):
        _point(original, view)


def call_on_cpu(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``op`` on CPU views of its npu arguments; results as npu tensors (an argument the
    op writes to and returns is returned as itself)."""
    plan = _plans.get(op)
    if plan is None:
        plan = _plans[op] = _Plan(op)
    cpu_args = tuple(_unwrap(v) for v in args)
    cpu_kwargs = {k: _unwrap(v) for k, v in kwargs.items()} if kwargs else kwargs
    out = op(*cpu_args, **cpu_kwargs)
    written: dict[str, Any] = {}
    for i, name, alias in plan.written:
        original = args[i] if i < len(args) else kwargs.get(name)
        written[alias] = original
        _repoint_resized(original, cpu_args[i] if i < len(args) else cpu_kwargs.get(name))
    device = kwargs.get("device")
    to_device = device is None or torch.device(device).type == DEVICE_TYPE
    returns = plan.returns
    if not returns:
        return None
    if len(returns) == 1:
        return _result(returns[0], out, written, to_device)
    return tuple(_result(r, v, written, to_device) for r, v in zip(returns, out, strict=True))


def _result(alias: str | None, value: Any, written: dict[str, Any], to_device: bool) -> Any:
    if alias is not None and alias in written:
        return written[alias]  # an in-place or out= op returns its own (npu) argument
    return _wrap(value) if to_device else value


def _fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    return call_on_cpu(op, args, kwargs)


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None,
                   device: Any = None, pin_memory: Any = None) -> torch.Tensor:
    _state["initialized"] = True
    return to_npu(torch.empty_strided(size, stride, dtype=dtype))


def _empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None,
           pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
    _state["initialized"] = True
    return to_npu(torch.empty(size, dtype=dtype,
                              memory_format=memory_format or torch.contiguous_format))


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    _unwrap(dst).copy_(_unwrap(src))
    return dst


def _register_kernels() -> list[Library]:
    aten = Library("aten", "IMPL")
    aten.impl("empty_strided", _empty_strided, "PrivateUse1")
    aten.impl("empty.memory_format", _empty, "PrivateUse1")
    aten.impl("_copy_from", _copy_from, "PrivateUse1")
    every = Library("_", "IMPL")
    every.fallback(_fallback, dispatch_key="PrivateUse1")
    return [aten, every]


def _backend_ops() -> list[tuple[str, torch._ops.OpOverload]]:
    """Every ``npu::`` op overload with a backend kernel (CPU or CompositeExplicitAutograd):
    the emulated ops that compute.  Ops registered only above the backends (an autograd-only
    public op calling its internal ``_npu_*`` op, a CompositeImplicitAutograd one) keep their
    structure: their inner op gets the device's kernel."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():  # "npu::name" or "npu::name.overload"
        namespace, _, name = qualified.partition("::")
        if namespace != DEVICE_TYPE:
            continue
        has = functools.partial(torch._C._dispatch_has_kernel_for_dispatch_key, qualified)
        if (has("CPU") or has("CompositeExplicitAutograd")) and not has("PrivateUse1"):
            packet, _, overload = name.partition(".")
            found.append((name, getattr(getattr(torch.ops.npu, packet), overload or "default")))
    return found


def register_op_kernels() -> None:
    """PrivateUse1 kernels (:func:`call_on_cpu`) for every emulated op that has a backend
    kernel (``_backend_ops``): their CPU kernels compute, inputs and results are npu tensors.
    Replaces the kernels an earlier call registered (the ops may have been registered anew)."""
    drop_op_kernels()
    lib = Library(DEVICE_TYPE, "IMPL")
    for name, op in _backend_ops():
        lib.impl(name, _op_kernel(op), "PrivateUse1")
    with _lock:
        _op_libs.append(lib)


def _op_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return call_on_cpu(op, args, kwargs)
    kernel.__name__ = f"npu_device_{op._opname}"
    return kernel


def drop_op_kernels() -> None:
    """Remove the kernels :func:`register_op_kernels` added (before the ops go)."""
    with _lock:
        while _op_libs:
            _op_libs.pop()._destroy()


# -- torch.npu -------------------------------------------------------------------------------

def _check_index(device: Any) -> int:
    if device is None:
        return int(_state["current"])
    index = device.index if isinstance(device, torch.device) else (
        torch.device(device).index if isinstance(device, str) else int(device))
    index = 0 if index is None else index
    if not 0 <= index < 1:
        raise RuntimeError(f"npu device {index} is not available: the emulated npu has one "
                           "device (npu:0)")
    return index


def _build_module() -> types.ModuleType:
    mod = types.ModuleType("torch_npu.npu", "opcontracts' emulated npu device module "
                           "(torch.npu and torch_npu.npu)")

    def is_available() -> bool:
        return installed()

    def device_count() -> int:
        return 1 if installed() else 0

    def current_device() -> int:
        return int(_state["current"])

    def set_device(device: Any) -> None:
        _state["current"] = _check_index(device)
        _state["initialized"] = True

    def synchronize(device: Any = None) -> None:
        _check_index(device)  # the CPU has finished every kernel when it returns

    def get_device_name(device: Any = None) -> str:
        _check_index(device)
        return str(_state["soc"])

    def is_initialized() -> bool:
        return installed() and bool(_state["initialized"])

    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)  # npu kernels run on the CPU generator

    def noop_seed_all(seed: int) -> None:
        pass  # torch.manual_seed calls this after seeding the CPU generator, which npu ops use

    for fn in (is_available, device_count, current_device, set_device, synchronize,
               get_device_name, is_initialized, manual_seed):
        fn.__module__ = mod.__name__
        setattr(mod, fn.__name__, fn)
    mod.manual_seed_all = noop_seed_all  # type: ignore[attr-defined]
    mod._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    mod._lazy_init = lambda: None  # type: ignore[attr-defined]
    mod.__opcontracts_emulation__ = True  # type: ignore[attr-defined]  # a stand-in (_standins.MARKER)
    _npu_api.extend(mod)  # config, rng state, memory, streams, events, graphs (_npu_api)
    return mod


_module: types.ModuleType | None = None


def module() -> types.ModuleType | None:
    """The device module (``torch.npu``) while installed."""
    return _module if installed() else None


class _Hooks(torch._C._acc.PrivateUse1Hooks):  # type: ignore[misc]
    def is_available(self) -> bool:
        return installed()

    def has_primary_context(self, dev_id: int) -> bool:
        return installed()

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):  # type: ignore[misc]
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


def reported_soc() -> str:
    """The SoC ``get_device_name()`` reports."""
    return str(_state["soc"])


def installed() -> bool:
    return bool(_libs)


def reserve() -> None:
    """Name PrivateUse1 ``npu`` and register the device's hooks and guard: the part of
    :func:`install` torch allows once per process, without the kernels or ``torch.npu``.

    torch's autograd engine sizes its per-device queues once, at the process's first backward
    (``Engine::start_device_threads``): a device registered after that has no worker thread and
    its backward fails.  A process that runs backward before it installs the device (a test
    suite) calls this first.  Raises RuntimeError when PrivateUse1 is already another backend.
    """
    global _module
    with _lock:
        if _module is not None:
            return
        name = torch._C._get_privateuse1_backend_name()
        if name != "privateuseone":
            raise RuntimeError(
                f"opcontracts.emulation: cannot emulate the npu device, torch's PrivateUse1 "
                f"backend is already {name!r} in this process")
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        mod = _build_module()
        _setup_privateuseone_for_python_backend(
            DEVICE_TYPE, backend_module=mod, hook=_Hooks(), device_guard=_Guard())
        _module = mod  # torch.npu from now on (torch.compile asks a renamed backend for it)


def install(soc: str = DEFAULT_SOC) -> None:
    """Register the ``npu`` device (idempotent; again only changes the SoC it reports).

    Raises RuntimeError when PrivateUse1 is already another backend (it can be named once),
    and when this process ran a backward before the device was reserved (see :func:`reserve`).
    """
    with _lock:
        _state["soc"] = soc  # opcontracts.set_versions() re-detects a SoC changed here
        if _libs:
            return
        reserve()
        assert _module is not None
        _libs.extend(_register_kernels())
        sys.modules["torch_npu.npu"] = _module
        parent = sys.modules.get("torch_npu")
        if parent is not None:
            parent.npu = _module  # type: ignore[attr-defined]
        try:
            _probe_engine()
        except BaseException:
            uninstall()
            raise
        _state["initialized"] = False  # the probe is not the user's first use


def _probe_engine() -> None:
    """One backward on the device: fails when the engine has no queue for it."""
    t = to_npu(torch.zeros(1)).requires_grad_()
    try:
        t.sum().backward()
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        raise RuntimeError(
            "opcontracts.emulation.install(device=True): this process ran a backward before the "
            "npu device was registered, and torch's autograd engine sizes its device queues once "
            "(at the first backward), so backward on npu tensors cannot run.  Install the "
            "emulation before the first backward (opcontracts run --emulate does), or call "
            "opcontracts.emulation.reserve_device() at the start of the process") from None


def uninstall() -> None:
    """Remove the kernels and ``torch_npu.npu`` (see the module docstring for what stays)."""
    with _lock:
        drop_op_kernels()
        while _libs:
            _libs.pop()._destroy()
        if _module is None:
            return
        if sys.modules.get("torch_npu.npu") is _module:
            del sys.modules["torch_npu.npu"]
        parent = sys.modules.get("torch_npu")
        if parent is not None and getattr(parent, "npu", None) is _module:
            delattr(parent, "npu")
