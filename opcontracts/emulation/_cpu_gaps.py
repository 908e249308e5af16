"""What the device's CPU fallback does when a CPU kernel refuses a call the NPU takes.

``_device.call_on_cpu`` runs every ATen op of npu tensors on CPU views.  Two kinds of call
the NPU runs fail there, and are retried (:func:`retry`) only after the CPU kernel refused:

* **a Python number in a Tensor argument**: ``t & 0xF0`` reaches the device as
  ``aten::bitwise_and.Tensor`` with a wrapped number, which the boxed fallback receives as a
  Python int; called with it, the CPU overload refuses ("Expected a value of type 'Tensor'").
  The op's overload taking a ``Scalar`` there (``bitwise_and.Scalar``) is called instead: the
  CPU wraps the number again, with torch's type promotion for numbers.  An op without such an
  overload gets a 0-dim tensor (int64, the default float dtype, bool or complex).
* **a dtype the CPU has no kernel for** (``NotImplementedError: "histogram_cpu" not
  implemented for 'Int'``; ``torch.histc`` on an int tensor, which transformers' MoE experts
  call on any device but the CPU): the arguments of that dtype are computed in a wider dtype
  (int64 then float64 for integers and bool, float32 for float16 / bfloat16, float64 for
  float32), and results in the wider dtype come back in the NPU's (the argument's) dtype;
  arguments the op writes to get the values.  :func:`retried` names the ops this served.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["retried", "retry"]

_NOT_IMPLEMENTED = re.compile(r"not implemented for '(\w+)'")
_DTYPES = {"Bool": torch.bool, "Byte": torch.uint8, "Char": torch.int8, "Short": torch.int16,
           "Int": torch.int32, "Long": torch.int64, "UInt16": torch.uint16,
           "UInt32": torch.uint32, "UInt64": torch.uint64, "Half": torch.float16,
           "BFloat16": torch.bfloat16, "Float": torch.float32}
_WIDER = {torch.float16: (torch.float32,), torch.bfloat16: (torch.float32,),
          torch.float32: (torch.float64,)}
_INTEGRAL = (torch.int64, torch.float64)

_scalar_overloads: dict[tuple[torch._ops.OpOverload, tuple[int, ...]], Any] = {}
_retried: set[str] = set()


def retried() -> list[str]:
    """The ops a dtype gap of the CPU sent to a wider dtype in this process, sorted."""
    return sorted(_retried)


def retry(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
          exc: BaseException) -> Any:
    """Run ``op`` (on CPU arguments) the way the NPU would after its CPU kernel raised
    ``exc``; raises ``exc`` when the refusal is not one of the gaps above."""
    numbers = _number_positions(op, args, kwargs)
    if numbers:
        return _with_scalars(op, args, kwargs, numbers)
    match = _NOT_IMPLEMENTED.search(str(exc))
    gap = _DTYPES.get(match.group(1)) if match else None
    if gap is None:
        raise exc
    wider = _WIDER.get(gap, _INTEGRAL if not gap.is_floating_point else ())
    for dtype in wider:
        try:
            out = _computed_in(op, args, kwargs, gap, dtype)
        except (RuntimeError, NotImplementedError):
            continue
        _retried.add(str(op))
        return out
    raise exc


# -- Python numbers in Tensor arguments --------------------------------------------------------

def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float, complex))


def _number_positions(op: torch._ops.OpOverload, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[int, ...]:
    found = []
    for i, arg in enumerate(op._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if _is_number(value) and _tensor_type(arg.type):
            found.append(i)
    return tuple(found)


def _tensor_type(t: Any) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.TensorType)


def _with_scalars(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                  positions: tuple[int, ...]) -> Any:
    key = (op, positions)
    if key not in _scalar_overloads:
        _scalar_overloads[key] = _scalar_overload(op, positions)
    other = _scalar_overloads[key]
    if other is not None:
        return other(*args, **kwargs)
    names = {op._schema.arguments[i].name for i in positions}
    args = tuple(_as_tensor(v) if i in positions else v for i, v in enumerate(args))
    kwargs = {k: _as_tensor(v) if k in names else v for k, v in kwargs.items()}
    return op(*args, **kwargs)


def _as_tensor(value: Any) -> torch.Tensor:
    return torch.tensor(value)  # int64, the default float dtype, bool, complex


def _scalar_overload(op: torch._ops.OpOverload, positions: tuple[int, ...]) -> Any:
    """The overload of ``op``'s packet taking a Scalar at ``positions`` and otherwise the same
    arguments and returns, or None."""
    schema = op._schema
    namespace, _, name = schema.name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    want = [(a.name, str(a.type)) for a in schema.arguments]
    returns = [str(r.type) for r in schema.returns]
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        other = candidate._schema
        if len(other.arguments) != len(want) or [str(r.type) for r in other.returns] != returns:
            continue
        if all(a.name == n and (isinstance(a.type, torch._C.NumberType) if i in positions
                                else str(a.type) == t)
               for i, (a, (n, t)) in enumerate(zip(other.arguments, want, strict=True))):
            return candidate
    return None


# -- dtypes without a CPU kernel ---------------------------------------------------------------

def _computed_in(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                 gap: torch.dtype, dtype: torch.dtype) -> Any:
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (argument, its wider copy)

    def widen(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype == gap:
            wide = value.to(dtype)
            copies.append((value, wide))
            return wide
        if isinstance(value, (list, tuple)):
            return type(value)(widen(v) for v in value)
        return value

    wide_args = tuple(widen(v) for v in args)
    wide_kwargs = {k: widen(v) for k, v in kwargs.items()}
    out = op(*wide_args, **wide_kwargs)
    written = {id(w): a for a, w in copies if _writes(op, w, wide_args, wide_kwargs)}
    for wide_id, arg in written.items():
        wide = next(w for a, w in copies if id(w) == wide_id)
        if arg.shape != wide.shape:
            arg.resize_(wide.shape)
        arg.copy_(wide)
    return _narrow(out, gap, dtype, written)


def _writes(op: torch._ops.OpOverload, wide: torch.Tensor, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> bool:
    for i, arg in enumerate(op._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is wide:
            return True
    return False


def _narrow(value: Any, gap: torch.dtype, dtype: torch.dtype,
            written: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if id(value) in written:
            return written[id(value)]  # an argument the op wrote to and returns
        return value.to(gap) if value.dtype == dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_narrow(v, gap, dtype, written) for v in value)
    return value
