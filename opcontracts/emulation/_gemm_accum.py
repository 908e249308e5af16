"""float16 matrix products on the emulated device, computed as the NPU computes them.

The NPU's cube unit multiplies float16 matrices with float32 accumulation and rounds each
output element once, to float16.  The CPU's own float16 ``mm`` is a slow path (no MKL kernel
for float16: about 40 times the float32 time) and is no more faithful.  So the device's
fallback computes ``aten::mm``, ``bmm``, ``addmm`` and ``baddbmm`` of float16 npu tensors in
float32 on the CPU and rounds the result once to float16.  (bfloat16 products already run on
the CPU's bfloat16 GEMM, which accumulates in float32 and rounds once: unchanged.)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GEMMS", "run"]

_aten = torch.ops.aten
GEMMS = frozenset({_aten.mm, _aten.bmm, _aten.addmm, _aten.baddbmm})
"""The products the fallback computes this way, functional and ``out=`` (as the device sees
``torch.bmm``: its ``out`` overload)."""


def _half(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float16


def run(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op`` on CPU tensors: None when it is not a float16 product (the caller runs it),
    else its result computed in float32 and rounded once to float16 (into ``out`` if given)."""
    if op.overloadpacket not in GEMMS or op._overloadname not in ("default", "out"):
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    out = kwargs.get("out")
    if not tensors or not all(_half(a) for a in tensors) or (out is not None and not _half(out)):
        return None
    wide = tuple(a.float() if _half(a) else a for a in args)
    rest = {k: v for k, v in kwargs.items() if k != "out"}
    result = op.overloadpacket.default(*wide, **rest).to(torch.float16)
    if out is None:
        return result
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out.copy_(result)
