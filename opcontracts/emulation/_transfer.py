"""``torch_npu.contrib.transfer_to_npu``: CUDA code run on the npu device, unmodified.

Importing torch_npu's ``transfer_to_npu`` rewires torch so that a script written for CUDA runs
on the NPU: ``"cuda"`` device strings (and ``torch.device("cuda")``, and integer devices in
``.to()``) given to torch's factory functions, ``Tensor.to`` / ``new_*``, ``Module.to``,
``torch.autocast``, ``with torch.device(...)``, ``torch.cuda.device`` and DDP become ``"npu"``;
``torch.cuda.*`` is the npu device module's functions (``torch.cuda.is_available()`` is True,
``torch.cuda.synchronize``, streams, events, memory statistics, random state...);
``Tensor.cuda`` / ``Module.cuda`` are ``.npu``; ``Tensor.is_cuda`` is ``is_npu``;
``torch.cuda.CUDAGraph`` is ``NPUGraph``; an ``nccl`` backend in ``init_process_group`` becomes
``hccl``; ``torch.jit.script`` returns its argument unscripted (with a warning).

The emulation applies the same patches to the emulated device, with one difference: there is no
``hccl`` backend on a CPU machine, so ``nccl`` becomes ``gloo``.  Every patch is recorded and
undone by ``emulation.uninstall()`` (:func:`restore`), so it never outlives the emulation.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["apply", "applied", "restore"]

TORCH_FACTORIES = (
    "logspace", "randint", "hann_window", "rand", "full_like", "ones_like", "rand_like", "randperm",
    "arange", "frombuffer", "normal", "empty_strided", "empty_like", "scalar_tensor", "tril_indices",
    "bartlett_window", "ones", "sparse_coo_tensor", "randn", "kaiser_window", "tensor",
    "triu_indices", "as_tensor", "zeros", "randint_like", "full", "eye", "empty", "blackman_window",
    "zeros_like", "range", "sparse_csr_tensor", "randn_like", "from_file", "linspace",
    "hamming_window", "load", "set_default_device", "get_device_module",
    "sparse_compressed_tensor",
)
"""torch functions whose device arguments are rewritten (torch_npu's ``torch_fn_white_list``,
less the private ones)."""

TENSOR_METHODS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor",
                  "new_zeros", "to", "pin_memory")
MODULE_METHODS = ("to", "to_empty")
CUDA_FUNCTIONS = (
    "get_device_properties", "get_device_name", "get_device_capability", "set_device",
    "synchronize", "mem_get_info", "memory_stats", "memory_summary", "memory_allocated",
    "max_memory_allocated", "reset_max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_max_memory_cached", "reset_peak_memory_stats",
    "default_stream", "current_stream", "set_per_process_memory_fraction",
)
DEVICE_KWARGS = ("device", "device_type", "map_location", "device_id")

_lock = threading.RLock()
_undo: list[tuple[Any, str, Any, bool]] = []  # (owner, name, original, had it)


def applied() -> bool:
    """Whether the patches are in place."""
    return bool(_undo)


def _set(owner: Any, name: str, value: Any) -> None:
    had = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
    original = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
    _undo.append((owner, name, original, had))
    setattr(owner, name, value)


def restore() -> None:
    """Undo every patch :func:`apply` made, newest first."""
    with _lock:
        while _undo:
            owner, name, original, had = _undo.pop()
            if had:
                setattr(owner, name, original)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass


# -- rewriting device arguments -----------------------------------------------------------------

def _device(value: Any, ints: bool) -> Any:
    if isinstance(value, str) and "cuda" in value:
        return value.replace("cuda", "npu")
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("npu" if value.index is None else f"npu:{value.index}")
    if ints and isinstance(value, int) and not isinstance(value, bool):
        return f"npu:{value}"
    if isinstance(value, dict):
        return {(k.replace("cuda", "npu") if isinstance(k, str) else k):
                (v.replace("cuda", "npu") if isinstance(v, str) else v) for k, v in value.items()}
    return value


def _rewrite(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its device arguments rewritten (positional integers too for ``to`` /
    ``to_empty``; keyword integers always), as transfer_to_npu's wrapper does."""
    ints = getattr(fn, "__name__", "") in ("to", "to_empty")

    @functools.wraps(fn)
    def npu_device_args(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_device(a, ints) for a in args)
        for key in DEVICE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = _device(kwargs[key], True)
        ids = kwargs.get("device_ids")
        if isinstance(ids, (list, tuple)):
            kwargs["device_ids"] = type(ids)(_device(i, ints) for i in ids)
        return fn(*args, **kwargs)
    npu_device_args.__opcontracts_transfer__ = True  # type: ignore[attr-defined]
    return npu_device_args


def _wrap(owner: Any, names: tuple[str, ...]) -> None:
    for name in names:
        fn = getattr(owner, name, None)
        if fn is not None:
            _set(owner, name, _rewrite(fn))


def _backend(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``nccl`` -> ``gloo`` (hccl on the NPU; no hccl on a CPU machine), ``cuda`` -> ``npu``."""

    def swap(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("nccl", "gloo").replace("cuda", "npu")
        return value

    @functools.wraps(fn)
    def gloo_backend(*args: Any, **kwargs: Any) -> Any:
        args = tuple(swap(a) if i == 0 else a for i, a in enumerate(args))
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        return fn(*args, **kwargs)
    return gloo_backend


def _unscripted(obj: Any, *args: Any, **kwargs: Any) -> Any:
    return obj


def apply() -> None:
    """Patch torch as ``torch_npu.contrib.transfer_to_npu`` does (once; needs the device).
    All or nothing: a patch that fails undoes the ones made before it."""
    with _lock:
        if _undo:
            return
        try:
            _apply()
        except BaseException:
            restore()
            raise


def _apply() -> None:
    import torch.utils._device  # noqa: F401 - DeviceContext (not imported by torch itself)

    npu = sys.modules.get("torch_npu.npu")
    if npu is None:
        raise RuntimeError(
            "torch_npu.contrib.transfer_to_npu needs the emulated npu device: run the script "
            "with `opcontracts run --emulate`, or call opcontracts.emulation.install(device=True)")
    warnings.warn("opcontracts emulation: torch_npu.contrib.transfer_to_npu: cuda devices and "
                  "torch.cuda.* are the emulated npu device now", ImportWarning, stacklevel=2)
    # torch.cuda.*: the device module's public names
    for name in dir(npu):
        if not name.startswith("_") and name not in ("config", "matmul", "conv", "utils"):
            _set(torch.cuda, name, getattr(npu, name))
    _wrap(torch.cuda, CUDA_FUNCTIONS)
    amp = getattr(npu, "amp", None)
    if amp is not None:
        _set(torch.cuda, "amp", amp)
    _set(torch.cuda.device, "__init__", _rewrite(torch.cuda.device.__init__))
    _set(torch.cuda, "CUDAGraph", npu.NPUGraph)
    # torch.*, Tensor.*, Module.*
    _wrap(torch, TORCH_FACTORIES)
    _wrap(torch.Tensor, TENSOR_METHODS)
    _wrap(torch.nn.Module, MODULE_METHODS)
    _set(torch.Tensor, "cuda", torch.Tensor.npu)  # type: ignore[attr-defined]
    _set(torch.Tensor, "is_cuda", torch.Tensor.is_npu)  # type: ignore[attr-defined]
    _set(torch.nn.Module, "cuda", torch.nn.Module.npu)  # type: ignore[attr-defined]
    _set(torch.amp.autocast_mode.autocast, "__init__",
         _rewrite(torch.amp.autocast_mode.autocast.__init__))
    _set(torch.utils._device.DeviceContext, "__init__",
         _rewrite(torch.utils._device.DeviceContext.__init__))
    _set(torch.nn.parallel.DistributedDataParallel, "__init__",
         _rewrite(torch.nn.parallel.DistributedDataParallel.__init__))
    # torch.distributed: nccl -> the CPU backend
    if torch.distributed.is_available():
        _set(torch.distributed, "init_process_group",
             _rewrite(_backend(torch.distributed.init_process_group)))
        _set(torch.distributed, "is_nccl_available", lambda: True)
    # torch.jit.script: unscripted, as transfer_to_npu leaves it
    warnings.warn("torch.jit.script and torch.jit.script_method will be disabled by "
                  "transfer_to_npu, which currently does not support them.", RuntimeWarning,
                  stacklevel=2)
    _set(torch.jit, "script", _unscripted)
    _set(torch.jit, "script_method", _unscripted)
