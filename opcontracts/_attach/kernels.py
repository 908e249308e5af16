"""Guards at the dispatcher, for the ops no Python name leads to: backward kernels.

torch_npu's autograd nodes (``Npu*Backward0``, generated from op-plugin's ``derivatives.yaml``)
call their grad kernels from C++ (``at_npu::native::custom_ops::npu_moe_token_unpermute_grad_v2``),
so a guard on the ``torch.ops.npu`` attribute never sees a backward call.  The dispatcher does:
for each guarded backward op the patch registers a Python kernel at the ``BackendSelect`` key of
that op (``torch.library.Library(ns, "IMPL")``), a key in every call's key set (torch's default
TLS include set) that sits below autograd and the Python modes and above the backend, and that
torch_npu registers nothing at for these ops.  The kernel hands the call to a *slot*: an
attribute of ``SLOTS`` holding the same guard ``make_guard`` builds for an attribute target,
which calls the op on below ``BackendSelect`` (``redispatch`` with the key set the dispatcher
passed in).  So a backward call is checked in the mode in effect on the thread that runs it,
and the observer layer (sentinel, compare, recorder) wraps the slot as it wraps any patched
attribute (the slot's ``PatchRecord``), seeing backward kernels as it would on an NPU.

Which ops: those whose name says C++ calls them from a backward node (``*_grad``,
``*_grad_v2``, ``*_backward``: op-plugin's naming, the same ``wheel verify`` reads).  The
public op's packet and attribute are left to the attribute patch (a kernel guard there would
check each call twice).  Cost: one Python kernel call and a ``redispatch`` per call of a guarded
backward op, whether or not a contract applies (``benchmarks/bench_kernel_guard.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SLOTS", "KernelGuards", "reached_from_cpp", "slot_name"]

_BACKWARD_SUFFIXES = ("_grad", "_grad_v2", "_backward")


def reached_from_cpp(op: str) -> bool:
    """Whether ``op`` (a contract's op name) is a backward kernel, called by C++ autograd nodes."""
    return op.endswith(_BACKWARD_SUFFIXES)


class _Slots:
    """Where the kernel guards live: one attribute per guarded op (``slot_name``)."""


SLOTS = _Slots()


def slot_name(qualified: str) -> str:
    """The ``SLOTS`` attribute of ``ns::op``."""
    return qualified.replace("::", "__")


class _Tls(threading.local):
    def __init__(self) -> None:
        self.keysets: list[Any] = []


class KernelGuards:
    """The kernels registered at ``BackendSelect`` (one ``Library`` per namespace)."""

    def __init__(self) -> None:
        self._libs: dict[str, torch.library.Library] = {}
        self._ops: dict[str, torch._ops.OpOverload] = {}  # qualified name -> default overload
        self._tls = _Tls()

    def installed(self, qualified: str) -> bool:
        return qualified in self._ops

    def below(self, overload: torch._ops.OpOverload) -> Callable[..., Any]:
        """``overload`` called below ``BackendSelect``, with the key set of the call being
        guarded: what the slot's guard wraps."""
        tls = self._tls
        after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)

        def call_below(*args: Any, **kwargs: Any) -> Any:
            return overload.redispatch(tls.keysets[-1] & after, *args, **kwargs)

        call_below.__name__ = overload._opname
        call_below.__qualname__ = overload._opname
        call_below.__signature__ = None  # type: ignore[attr-defined]
        return call_below

    def install(self, packet: torch._ops.OpOverloadPacket, guard: Callable[..., Any]) -> str:
        """Route every call of ``packet``'s default overload through ``SLOTS.<slot>`` (set to
        ``guard``); returns the slot's name."""
        overload = packet.default
        qualified = packet._qualified_op_name
        ns, name = qualified.split("::", 1)
        slot = slot_name(qualified)
        setattr(SLOTS, slot, guard)
        tls = self._tls

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            # the whole cost before the guard: a list push/pop and one attribute read
            tls.keysets.append(keyset)
            try:
                return getattr(SLOTS, slot)(*args, **kwargs)
            finally:
                tls.keysets.pop()

        lib = self._libs.get(ns)
        if lib is None:
            lib = self._libs[ns] = torch.library.Library(ns, "IMPL")
        lib.impl(name, kernel, "BackendSelect", with_keyset=True)
        self._ops[qualified] = overload
        return slot

    def remove_all(self) -> None:
        """Drop every kernel (``Library._destroy``) and slot."""
        for lib in self._libs.values():
            lib._destroy()
        self._libs.clear()
        for qualified in self._ops:
            SLOTS.__dict__.pop(slot_name(qualified), None)
        self._ops.clear()
