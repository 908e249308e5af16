"""``torchair.ge`` and ``torchair.register_fx_node_ge_converter``: the GE graph API that code
registering its own ops with torchair imports.

A JIT-built op (MindSpeed's ``op_builder/*_builder.py``) registers, when its builder is made,
a converter that writes the op into a GE graph: ``@register_fx_node_ge_converter(
torch.ops.mindspeed.npu_gmm.Tensor)`` over a function that reads ``DataType.DT_BF16`` and
calls ``ge.Const`` / ``ge.Cast`` / ``ge.custom_op``.  torchair keeps the converter for its GE
backend; the emulated torchair runs captured graphs eagerly, so a converter is recorded
(:func:`converters`) and never called.  ``DataType`` holds GE's data type numbers (torchair's
``DataType``, GE's ``graph/types.h``); ``Format`` the tensor formats; the graph-building
functions raise the not-emulated error if a converter is ever run.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

__all__ = ["DATA_TYPES", "converters", "fill_ge", "register_fx_node_ge_converter"]

DATA_TYPES: dict[str, int] = {
    "DT_FLOAT": 0, "DT_FLOAT16": 1, "DT_INT8": 2, "DT_INT32": 3, "DT_UINT8": 4, "DT_INT16": 6,
    "DT_UINT16": 7, "DT_UINT32": 8, "DT_INT64": 9, "DT_UINT64": 10, "DT_DOUBLE": 11,
    "DT_BOOL": 12, "DT_STRING": 13, "DT_DUAL_SUB_INT8": 14, "DT_DUAL_SUB_UINT8": 15,
    "DT_COMPLEX64": 16, "DT_COMPLEX128": 17, "DT_QINT8": 18, "DT_QINT16": 19, "DT_QINT32": 20,
    "DT_QUINT8": 21, "DT_QUINT16": 22, "DT_RESOURCE": 23, "DT_STRING_REF": 24, "DT_DUAL": 25,
    "DT_VARIANT": 26, "DT_BF16": 27, "DT_UNDEFINED": 28, "DT_INT4": 29, "DT_UINT1": 30,
    "DT_INT2": 31, "DT_UINT2": 32, "DT_COMPLEX32": 33, "DT_MAX": 34}
"""GE's data types, as torchair's ``DataType`` numbers them."""

_FORMATS: dict[str, int] = {"FORMAT_NCHW": 0, "FORMAT_NHWC": 1, "FORMAT_ND": 2,
                            "FORMAT_NC1HWC0": 3, "FORMAT_FRACTAL_Z": 4, "FORMAT_FRACTAL_NZ": 29}

_converters: dict[Any, Callable[..., Any]] = {}


def converters() -> dict[Any, Callable[..., Any]]:
    """The GE converters registered in this process (op -> converter); never called here."""
    return dict(_converters)


def register_fx_node_ge_converter(aten_op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """torchair's: a decorator that records ``aten_op``'s GE converter (None: a no-op)."""
    def register(converter: Callable[..., Any]) -> Callable[..., Any]:
        if aten_op is not None:
            _converters[aten_op] = converter
        return converter
    return register


def _graph_only(name: str, not_emulated: Callable[[str, str], str]) -> Callable[..., Any]:
    def build(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(not_emulated(f"torchair.ge.{name}", "function")
                                  + ": GE graphs are not built on the emulation")
    build.__name__ = name
    return build


def fill_ge(module: types.ModuleType, not_emulated: Callable[[str, str], str]) -> None:
    """``torchair.ge``: ``DataType``, ``Format``, ``Tensor``, ``TensorSpec`` and the graph
    builders (``Const``, ``Cast``, ``custom_op``, ...)."""
    data_type = type("DataType", (), {"__doc__": "GE's data types.", **DATA_TYPES})
    fmt = type("Format", (), {"__doc__": "GE's tensor formats.", **_FORMATS})
    tensor = type("Tensor", (), {"__doc__": "A tensor of a GE graph (never made on the emulation)."})
    spec = type("TensorSpec", (), {"__doc__": "The meta of a GE graph tensor."})
    for cls in (data_type, fmt, tensor, spec):
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    builders = [_graph_only(name, not_emulated) for name in ("Const", "Cast", "custom_op")]
    for fn in builders:
        fn.__module__ = module.__name__
        setattr(module, fn.__name__, fn)
    module.__all__ = ["DataType", "Format", "Tensor", "TensorSpec",  # type: ignore[attr-defined]
                      *(fn.__name__ for fn in builders)]
    module.__doc__ = ("opcontracts emulation of torchair.ge: GE's data types and formats; "
                      "converters are recorded, never run (graphs run eagerly).")
