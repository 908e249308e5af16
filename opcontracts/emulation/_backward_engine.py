"""The autograd engine as the emulated device needs it: never an abort, several devices.

**An exception a Python hook raises on the device's backward thread.**  The engine runs the
backward of npu tensors on its worker thread for the device, as on an NPU.  A Python hook
called there (a saved-tensors unpack hook, so ``torch.utils.checkpoint(use_reentrant=False)``
recomputing the forward; a tensor or node hook) that raises leaves its exception pending on
that thread while C++ unwinds; the engine's stream guard for the node then asks torch's Python
device guard (``torch._C._acc.DeviceGuard``) its device type, a Python call made with an
exception pending, which fails inside a ``noexcept`` destructor: ``std::terminate``, exit 134,
"terminate called without an active exception".  (torch_npu's guard is C++ and never calls
Python there; Python ``autograd.Function.backward`` errors are unaffected, torch stores them
first.)  So the device guard takes a pending exception (:func:`take_pending`: a C-API call
through ``ctypes.pythonapi`` raises it), the unwinding finishes, and ``backward()`` (which then
fails with a SystemError, the engine's exception having lost its Python error) raises the
hook's own exception instead (:class:`_Engine`).

**Several devices.**  torch sizes the engine's device queues from the Python device guard's
device count, fixed at 1 for a Python backend: a backward touching ``npu:1`` would fail an
internal assert.  With several devices emulated, backward runs on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``), every device alike.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.variable import Variable

__all__ = ["install", "take_pending", "uninstall"]

_lock = threading.Lock()
_pending: list[BaseException] = []
# any C-API function called through ctypes.pythonapi: ctypes checks the thread's error
# indicator after the call and raises what is pending there
_probe = ctypes.pythonapi.Py_IsInitialized
_probe.restype = ctypes.c_int
_probe.argtypes = []


def take_pending() -> None:
    """Take the exception pending on this thread, if any, for :class:`_Engine` to raise."""
    try:
        _probe()
    except BaseException as exc:  # noqa: BLE001  # whatever the hook raised
        with _lock:
            _pending.append(exc)


def _take() -> BaseException | None:
    with _lock:
        return _pending.pop() if _pending else None


class _Engine(torch._C._ImperativeEngine):  # type: ignore[misc]
    """torch's engine (one C++ engine behind every instance), whose ``run_backward`` raises a
    hook's exception taken on the worker thread, and runs on the calling thread when several
    devices are emulated."""

    single_thread: Callable[[], bool] = staticmethod(lambda: False)  # type: ignore[assignment]

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self.single_thread():
                with torch.autograd.set_multithreading_enabled(False):
                    return super().run_backward(*args, **kwargs)
            return super().run_backward(*args, **kwargs)
        except SystemError:
            raised = _take()
            if raised is None:
                raise
            raise raised.with_traceback(raised.__traceback__) from None


_saved: list[Any] = []  # the engine replaced, while installed


def install(single_thread: Callable[[], bool]) -> None:
    """Make :class:`_Engine` torch's engine (``Variable._execution_engine``, which
    ``backward()`` and ``torch.autograd.grad`` call)."""
    if _saved:
        return
    engine = _Engine()
    engine.single_thread = single_thread  # type: ignore[method-assign]
    _saved.append(Variable._execution_engine)
    Variable._execution_engine = engine  # type: ignore[attr-defined]


def uninstall() -> None:
    if not _saved:
        return
    original = _saved.pop()
    if isinstance(Variable._execution_engine, _Engine):
        Variable._execution_engine = original  # type: ignore[attr-defined]
