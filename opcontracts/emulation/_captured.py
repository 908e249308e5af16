"""The backward kernels' ``OpOverload``s, captured once when the emulation registers its ops.

torch_npu's generated autograd nodes (``Npu*Backward0``, from op-plugin's ``derivatives.yaml``)
call their grad kernels through ``at_npu::native::custom_ops::...``: C++, through the
dispatcher, with no Python attribute involved.  The emulation's backward formulas call them the
same way: through the ``OpOverload`` captured here at install (``capture``), never through a
``torch.ops.npu.<name>`` attribute, so a wrapper set on that attribute (``opcontracts.patch``)
sees a backward call exactly when it would on an NPU: never.  What does see them is anything at
the dispatcher (a ``TorchDispatchMode``, a kernel registered for the op).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["call", "capture", "clear", "overload"]

_OVERLOADS: dict[str, torch._ops.OpOverload] = {}


def capture(namespace: str, names: tuple[str, ...]) -> None:
    """Capture ``namespace::name.default`` of each of ``names`` (after their definition); an op
    without a default overload (``_npu_dropout_gen_mask.Tensor``), its only one."""
    ns = getattr(torch.ops, namespace)
    for name in names:
        packet = getattr(ns, name)
        overloads = packet.overloads()
        _OVERLOADS[name] = getattr(packet, "default" if "default" in overloads else overloads[0])


def clear() -> None:
    _OVERLOADS.clear()


def overload(name: str) -> torch._ops.OpOverload:
    """The captured default overload of ``name`` (RuntimeError when the emulation is off)."""
    try:
        return _OVERLOADS[name]
    except KeyError:
        raise RuntimeError(f"the emulated op npu::{name} is not registered (the emulation is not "
                           "installed, or this torch_npu release has no such op)") from None


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """Call the captured default overload of ``name``, as a C++ autograd node does."""
    return overload(name)(*args, **kwargs)
