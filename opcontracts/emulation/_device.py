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
  ``.cpu()``); ``aten::set_`` to a storage (the npu tensor takes the npu storage as it is);
* ``torch.UntypedStorage(n, device="npu")`` (``storage.clone()``, ``copy.deepcopy``): host
  memory under an npu storage, as above (a Python backend has no allocator to give torch);
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
before it.  Several devices: ``OPCONTRACTS_EMULATE_DEVICES`` / ``install(devices=N)`` (tensors on
``npu:1`` and up are made through DLPack, ``_new_on``); an index beyond the count is refused
as torch_npu refuses it.  Not emulated: streams and events, pinned memory (``pin_memory()``
gives a host copy), ``torch.save`` of npu tensors, resizing an npu storage in place
(``untyped_storage().resize_``), npu generators.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.library import Library

from . import _autocast, _backward_engine, _cpu_gaps, _gemm_accum, _npu_api, _philox

__all__ = ["DEFAULT_SOC", "SOC_ENV", "call_on_cpu", "drop_op_kernels", "install", "installed", "module",
           "register_op_kernels", "reported_soc", "reserve", "soc_setting", "to_cpu_view", "to_npu",
           "uninstall"]

DEVICE_TYPE = "npu"
DEFAULT_SOC = "Ascend910B3"  # an A2 training chip (torch_npu.npu.get_device_name() on an 800T A2)
SOC_ENV = "OPCONTRACTS_EMULATE_SOC"  # the SoC a device installed with device=True reports

_lock = threading.RLock()
# the SoC reported; the current device; whether the device was used since install (torch_npu's
# lazy init runs at the first use: is_initialized() is False before it); how many devices
_state: dict[str, Any] = {"soc": DEFAULT_SOC, "current": 0, "initialized": False, "count": 1}
_libs: list[Library] = []      # aten kernels and the fallback, while installed
_op_libs: list[Library] = []   # kernels of the emulated npu ops
_CPU = torch.device("cpu")
_SET = torch.ops.aten.set_.source_Storage_storage_offset
_SET_WHOLE = torch.ops.aten.set_.source_Storage
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


# -- tensors ---------------------------------------------------------------------------------

def _point(npu: torch.Tensor, cpu: torch.Tensor) -> None:
    """Make ``npu`` (an npu tensor) view ``cpu``'s memory with ``cpu``'s sizes and strides."""
    storage = cpu.untyped_storage()
    npu_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), npu.device, storage.nbytes())
    npu_storage._opcontracts_cpu = storage  # type: ignore[attr-defined]  # the memory lives as long as the npu storage
    # the CPU kernel of set_ only moves the storage pointer and the metadata; it runs on any
    # TensorImpl (the npu one has no storage yet)
    _SET.redispatch(_CPU_KEYS, npu, npu_storage, cpu.storage_offset(), cpu.size(), cpu.stride())


def to_npu(cpu: torch.Tensor, index: int = 0) -> torch.Tensor:
    """An npu tensor on ``npu:index`` over ``cpu``'s memory (no copy)."""
    npu = torch._C._acc.create_empty_tensor((0,), cpu.dtype) if index == 0 else _new_on(index, cpu.dtype)
    _point(npu, cpu)
    return npu


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_DLPACK_DEVICE = 8      # offsetof(DLTensor, device): after the data pointer
_DL_EXT_DEV = 12        # kDLExtDev: torch reads it as PrivateUse1


def _new_on(index: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty npu tensor on ``npu:index`` (index >= 1).  torch's Python device guard makes
    every new tensor of a Python backend ``npu:0`` and a tensor's device cannot change later, so
    the tensor is made by DLPack: an empty CPU tensor's capsule, its device rewritten to
    (kDLExtDev, index), read back by torch as a PrivateUse1 tensor on that index."""
    capsule = torch._C._to_dlpack(torch.empty(0, dtype=dtype))
    device = (ctypes.c_int32 * 2).from_address(_capsule_pointer(capsule, b"dltensor") + _DLPACK_DEVICE)
    device[0], device[1] = _DL_EXT_DEV, index
    return torch._C._from_dlpack(capsule)


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


def _wrap(value: Any, index: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return to_npu(value, index) if value.device.type == "cpu" else value
    if isinstance(value, (list, tuple)):
        return type(value)(_wrap(v, index) for v in value)
    return value


def _indices(value: Any, found: set[int]) -> None:
    """The device indices of the npu tensors in ``value`` (an argument), into ``found``."""
    if isinstance(value, torch.Tensor):
        if value.device.type == DEVICE_TYPE:
            found.add(value.device.index or 0)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _indices(v, found)


def _result_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """With several devices: the index an op's results go to (the ``device=`` argument's, else
    its npu arguments', else the current device); arguments on two devices are refused as
    torch refuses them."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == DEVICE_TYPE:
        return _device_index(device)
    found: set[int] = set()
    for v in args:
        _indices(v, found)
    for v in kwargs.values():
        _indices(v, found)
    if len(found) > 1:
        first, second = sorted(found)[:2]
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two "
                           f"devices, npu:{first} and npu:{second}!")
    return found.pop() if found else int(_state["current"])


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
    index = _result_index(args, kwargs) if _state["count"] > 1 else 0
    cpu_args = tuple(_unwrap(v) for v in args)
    cpu_kwargs = {k: _unwrap(v) for k, v in kwargs.items()} if kwargs else kwargs
    try:
        out = _gemm_accum.run(op, cpu_args, cpu_kwargs)  # float16 products: fp32 accumulation
        if out is None:
            out = op(*cpu_args, **cpu_kwargs)
    except (RuntimeError, NotImplementedError) as exc:
        # the CPU kernel refused what the NPU takes: a Python number in a Tensor argument, a
        # dtype the CPU has no kernel for (_cpu_gaps)
        out = _cpu_gaps.retry(op, cpu_args, cpu_kwargs, exc)
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
        return _result(returns[0], out, written, to_device, index)
    return tuple(_result(r, v, written, to_device, index) for r, v in zip(returns, out, strict=True))


def _result(alias: str | None, value: Any, written: dict[str, Any], to_device: bool,
            index: int) -> Any:
    if alias is not None and alias in written:
        return written[alias]  # an in-place or out= op returns its own (npu) argument
    return _wrap(value, index) if to_device else value


def _fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    return call_on_cpu(op, args, kwargs)


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None,
                   device: Any = None, pin_memory: Any = None) -> torch.Tensor:
    index = _device_index(device)
    _mark_initialized()
    return to_npu(torch.empty_strided(size, stride, dtype=dtype), index)


def _empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None,
           pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
    index = _device_index(device)
    _mark_initialized()
    return to_npu(torch.empty(size, dtype=dtype,
                              memory_format=memory_format or torch.contiguous_format), index)


def _shallow_copy_compatible(self: torch.Tensor, other: torch.Tensor) -> bool:
    """torch_npu's rule: two dense tensors, each on the CPU or the npu, are compatible."""
    dense = (self.layout == torch.strided and other.layout == torch.strided
             and self.device.type in _DENSE and other.device.type in _DENSE)
    return dense or torch._C._dispatch_keys(self) == torch._C._dispatch_keys(other)


_DENSE = ("cpu", DEVICE_TYPE)


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    return torch.empty_like(self).copy_(self)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    _unwrap(dst).copy_(_unwrap(src))
    return dst


# -- storages made by torch itself ------------------------------------------------------------
# ``torch.UntypedStorage(nbytes, device="npu")`` asks the device's allocator, which a Python
# backend cannot give torch (the C++ call dereferences a null allocator: the process dies of a
# segmentation fault).  torch makes storages that way in ``storage.clone()``, hence in
# ``copy.deepcopy`` of every npu tensor and of a module holding npu parameters.  On torch_npu
# the NPU caching allocator serves it; here the storage's memory is host memory, as every npu
# tensor's is.

_storage_new: list[Any] = []  # the StorageBase constructor, while the npu one is in place


def _untyped_storage_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    make = _storage_new[0] if _storage_new else torch._C.StorageBase.__new__
    device = kwargs.get("device")
    if device is None or torch.device(device).type != DEVICE_TYPE:
        return make(cls, *args, **kwargs)
    index = _device_index(device)
    _mark_initialized()
    cpu = make(cls, *args, **{**kwargs, "device": _CPU})
    npu = torch._C._construct_storage_from_data_pointer(
        cpu.data_ptr(), torch.device(DEVICE_TYPE, index), cpu.nbytes())
    npu._opcontracts_cpu = cpu  # type: ignore[attr-defined]  # the memory lives as long as the npu storage
    return npu


def _patch_storage() -> None:
    if not _storage_new:
        _storage_new.append(torch.UntypedStorage.__dict__.get("__new__", torch._C.StorageBase.__new__))
        torch.UntypedStorage.__new__ = _untyped_storage_new  # type: ignore[method-assign,assignment]


def _unpatch_storage() -> None:
    if _storage_new:
        original = _storage_new.pop()
        if original is torch._C.StorageBase.__new__:
            del torch.UntypedStorage.__new__
        else:
            torch.UntypedStorage.__new__ = original  # type: ignore[method-assign]


def _set_storage(self: torch.Tensor, source: Any) -> torch.Tensor:
    return _SET_WHOLE.redispatch(_CPU_KEYS, self, source)  # type: ignore[no-any-return]


def _set_storage_offset(self: torch.Tensor, source: Any, storage_offset: Any, size: Any,
                        stride: Any = ()) -> torch.Tensor:
    return _SET.redispatch(_CPU_KEYS, self, source, storage_offset, size, stride)  # type: ignore[no-any-return]


def _register_kernels() -> list[Library]:
    aten = Library("aten", "IMPL")
    aten.impl("empty_strided", _empty_strided, "PrivateUse1")
    aten.impl("empty.memory_format", _empty, "PrivateUse1")
    aten.impl("_copy_from", _copy_from, "PrivateUse1")
    # an npu tensor set to an npu storage (storage.clone(), deepcopy, torch.load's rebuild): the
    # CPU kernel of set_ only moves the storage pointer and the metadata, on any TensorImpl
    aten.impl("set_.source_Storage", _set_storage, "PrivateUse1")
    aten.impl("set_.source_Storage_storage_offset", _set_storage_offset, "PrivateUse1")
    # CPU and npu tensors are shallow-copy compatible, as torch_npu makes them: Module.to("npu")
    # keeps the Parameter objects (param.data = npu tensor), so an optimizer built before sees
    # the parameters it updates
    for key in ("AutogradPrivateUse1", "PrivateUse1"):
        aten.impl("_has_compatible_shallow_copy_type", _shallow_copy_compatible, key)
    # pin_memory() (a DataLoader's pin_memory=True, transformers' Trainer's default) asks the
    # accelerator's host allocator, which a Python backend cannot give: host memory is a copy
    aten.impl("_pin_memory", _pin_memory, "CPU")
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

DEVICES_ENV = "OPCONTRACTS_EMULATE_DEVICES"
MAX_DEVICES = 64


def devices_setting(value: str | None = None) -> int:
    """The number of npu devices to emulate: ``value``, else ``OPCONTRACTS_EMULATE_DEVICES``,
    else 1.  Raises SettingError naming the variable on anything but a whole number from 1 to
    ``MAX_DEVICES``."""
    from ..errors import SettingError

    raw = os.environ.get(DEVICES_ENV) if value is None else value
    if raw is None or not raw.strip():
        return 1
    text = raw.strip()
    count = int(text) if text.isdigit() else 0
    if not 1 <= count <= MAX_DEVICES:
        where = DEVICES_ENV if value is None else "devices"
        raise SettingError(f"{where}={raw!r}: expected the number of npu devices to emulate, a "
                           f"whole number from 1 to {MAX_DEVICES} (e.g. {DEVICES_ENV}=8)")
    return count


def soc_setting(value: str | None = None) -> str:
    """The SoC the emulated device reports: ``value``, else ``OPCONTRACTS_EMULATE_SOC``, else
    ``DEFAULT_SOC``.  Raises SettingError naming the variable on a name that is not an Ascend
    chip's as ``torch_npu.npu.get_device_name()`` gives it (``Ascend`` and letters, digits,
    ``_``)."""
    import re

    from ..errors import SettingError

    raw = os.environ.get(SOC_ENV) if value is None else value
    if raw is None or not raw.strip():
        return DEFAULT_SOC
    text = raw.strip()
    if re.fullmatch(r"Ascend[0-9A-Za-z_]+", text) is None:
        where = SOC_ENV if value is None else "soc"
        raise SettingError(f"{where}={raw!r}: expected the name of the Ascend chip the emulated "
                           "device reports, as torch_npu.npu.get_device_name() gives it: "
                           f"Ascend910B3, Ascend910_9392, Ascend950PR, ... (e.g. "
                           f"{SOC_ENV}=Ascend950PR)")
    return text


_queued_calls: list[Callable[[], Any]] = []


def _lazy_call(cb: Callable[[], Any]) -> None:
    """torch_npu's ``torch_npu.npu._lazy_call``: ``cb`` now when the device is initialised,
    else at its initialisation (the first use of the device; MindSpeed's and Megatron's RNG
    trackers queue their ``set_state`` this way)."""
    if _state["initialized"]:
        cb()
    else:
        _queued_calls.append(cb)


def _mark_initialized() -> None:
    """The device's lazy init (torch_npu's ``_lazy_init``): initialised from now on, and the
    calls queued until then run, in order."""
    if _state["initialized"]:
        return
    _state["initialized"] = True
    while _queued_calls:
        _queued_calls.pop(0)()


def _invalid_device(index: int) -> RuntimeError:
    """torch_npu's error for a device the machine does not have (aclrtSetDevice's 107001)."""
    count = int(_state["count"])
    return RuntimeError(
        f"NPU function error: c10_npu::SetDevice(device_id_), error code is 107001 (invalid "
        f"device id {index}: rtSetDevice execute failed, reason=[device id error]). The "
        f"emulation has {count} npu device{'s' if count > 1 else ''} (npu:0 to npu:{count - 1}); "
        f"emulate more with {DEVICES_ENV}=N or opcontracts run --emulate --devices N")


def _device_index(device: Any) -> int:
    """The index ``device`` (an index, "npu:1", a torch.device, None: the current one) names,
    refused as torch_npu refuses it when the emulation has no such device."""
    if device is None:
        return int(_state["current"])
    if isinstance(device, torch.device):
        index = device.index
    elif isinstance(device, str):
        index = torch.device(device).index
    else:
        index = int(device)
    if index is None:
        return int(_state["current"])
    if index < 0:
        raise RuntimeError("device id must be positive!")
    if index >= int(_state["count"]):
        raise _invalid_device(index)
    return index


def _build_module() -> types.ModuleType:
    mod = types.ModuleType("torch_npu.npu", "opcontracts' emulated npu device module "
                           "(torch.npu and torch_npu.npu)")

    def is_available() -> bool:
        return installed()

    def device_count() -> int:
        return int(_state["count"]) if installed() else 0

    def current_device() -> int:
        return int(_state["current"])

    def set_device(device: Any) -> None:
        _state["current"] = _device_index(device)
        _mark_initialized()

    def synchronize(device: Any = None) -> None:
        _device_index(device)  # the CPU has finished every kernel when it returns

    def get_device_name(device: Any = None) -> str:
        _device_index(device)
        return str(_state["soc"])

    def is_initialized() -> bool:
        return installed() and bool(_state["initialized"])

    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)  # npu kernels run on the CPU generator
        _philox.manual_seed(seed)  # the NPU generator's seed, its offset back to 0

    def manual_seed_all(seed: int) -> None:
        # torch.manual_seed calls this after seeding the CPU generator, which npu ops use
        _philox.manual_seed(seed)

    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported() -> bool:
        # the A2 / A3 training chips (Ascend910B*, Ascend910_93*) and later; not the 910A
        soc = str(_state["soc"])
        return soc.startswith(("Ascend910B", "Ascend910_93", "Ascend950"))

    def get_autocast_dtype() -> torch.dtype:
        return torch.get_autocast_dtype(DEVICE_TYPE)

    def set_autocast_dtype(dtype: torch.dtype) -> None:
        torch.set_autocast_dtype(DEVICE_TYPE, dtype)

    def is_autocast_enabled() -> bool:
        return torch.is_autocast_enabled(DEVICE_TYPE)

    def set_autocast_enabled(enabled: bool) -> None:
        torch.set_autocast_enabled(DEVICE_TYPE, enabled)

    for fn in (is_available, device_count, current_device, set_device, synchronize,
               get_device_name, is_initialized, manual_seed, get_amp_supported_dtype,
               is_bf16_supported, get_autocast_dtype, set_autocast_dtype, is_autocast_enabled,
               set_autocast_enabled):
        fn.__module__ = mod.__name__
        setattr(mod, fn.__name__, fn)
    mod.manual_seed_all = manual_seed_all  # type: ignore[attr-defined]
    mod._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    mod._lazy_init = _mark_initialized  # type: ignore[attr-defined]
    mod._lazy_call = _lazy_call  # type: ignore[attr-defined]
    mod.amp = _autocast.amp_module(mod.__name__)  # type: ignore[attr-defined]
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
        # torch's Python device guard asks this on every guard, also while C++ unwinds an
        # exception a Python hook raised on the backward thread, with that exception still
        # pending: it is taken here, or the call would fail inside a noexcept destructor and
        # abort the process (_backward_engine)
        _backward_engine.take_pending()
        return _PRIVATEUSE1


_PRIVATEUSE1 = torch._C._autograd.DeviceType.PrivateUse1


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


def install(soc: str = DEFAULT_SOC, devices: int | None = None) -> None:
    """Register the ``npu`` device (idempotent; again only changes the SoC it reports and the
    number of devices).  ``devices``: how many (``npu:0`` ... ``npu:N-1``); None: the
    ``OPCONTRACTS_EMULATE_DEVICES`` environment variable, else 1 (SettingError when it is not
    a number from 1 to ``MAX_DEVICES``).

    Raises RuntimeError when PrivateUse1 is already another backend (it can be named once),
    and when this process ran a backward before the device was reserved (see :func:`reserve`).
    """
    count = devices_setting() if devices is None else devices_setting(str(devices))
    with _lock:
        _state["soc"] = soc  # opcontracts.set_versions() re-detects a SoC changed here
        _state["count"] = count
        if int(_state["current"]) >= count:
            _state["current"] = 0
        if _libs:
            return
        reserve()
        assert _module is not None
        _libs.extend(_register_kernels())
        _patch_storage()
        _libs.extend(_autocast.register())
        _backward_engine.install(lambda: int(_state["count"]) > 1)
        sys.modules["torch_npu.npu"] = _module
        sys.modules["torch_npu.npu.amp"] = _module.amp
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
        _unpatch_storage()
        _queued_calls.clear()
        _backward_engine.uninstall()
        if _module is None:
            return
        if sys.modules.get("torch_npu.npu") is _module:
            del sys.modules["torch_npu.npu"]
        if sys.modules.get("torch_npu.npu.amp") is _module.amp:
            del sys.modules["torch_npu.npu.amp"]
        parent = sys.modules.get("torch_npu")
        if parent is not None and getattr(parent, "npu", None) is _module:
            delattr(parent, "npu")
