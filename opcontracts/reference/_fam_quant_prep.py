"""References of the quantisation-preparation ops: what code runs on weights and scales before
a quantised matmul (``npu_quantize``, ``npu_trans_quant_param``,
``npu_convert_weight_to_int4pack``) and the storage-format cast (``npu_format_cast``).

Sources, per op (op-plugin master ``docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md``, its glue
``op_plugin/ops/opapi/*KernelNpuOpApi.cpp`` and the goldens of op-plugin's own tests):

* ``npu_trans_quant_param``: the scale's fp32 bits cut to FP19 (``& 0xFFFFE000``, R_INT-rounded
  first with ``round_mode`` 1) in bits 0-31, bit 46 set; an offset rounded, clamped to
  [-256, 255] and its 9 bits stored at bits 37-45; int64 out, a 1-D scale broadcast against the
  offset;
* ``npu_quantize``: ``div_mode`` True (aclnnQuantize): per channel along ``axis``,
  ``round(x / scale) + zero_point`` saturated to the output type (the golden is
  ``torch.quantize_per_channel(...).int_repr()``); ``div_mode`` False (aclnnAscendQuant):
  ``round(x * scale + offset)`` saturated to int8 (``torch.qint8``) or int4 packed eight to an
  int32 (``torch.quint4x2``), a 1-D scale on the last axis unless ``axis`` < -1;
* ``npu_convert_weight_to_int4pack``: int32 values in [-8, 7], eight packed per int32 along the
  last axis, the first in the lowest nibble;
* ``npu_format_cast``: an NPU storage format (ND, NZ, NC1HWC0, ...) changes the memory layout,
  never the values; the emulation keeps the values in ND, so the cast returns a copy (the
  format is the storage's: ``emulation/_formats``);
* ``npu_dtype_cast``: the tensor in ``dtype`` (torch_npu 2.14.0 doc: ``[0, 0.5, -1.]`` to int32
  is ``[0, 0, -1]``, a cast as ``Tensor.to``); ``dtype`` a ScalarType number or torch_npu's
  float8 numbers (291, 292); its own hifloat8 / float4 types and an ``input_dtype`` that
  reinterprets the input are not emulated (``NotImplementedError``).

Rounding is half-to-even (``torch.round``), as the goldens' ``np.round`` and ``torch``'s
quantisers round.  fp8 and hifloat8 outputs are not emulated (``NotImplementedError``).
"""

from __future__ import annotations

from typing import Any

import torch

from ._entry import Reference
from ._matmul import FP8_TYPES, SCALAR_TYPES

__all__ = ["REFERENCES", "cast_dtype", "int4_pack", "npu_convert_weight_to_int4pack",
           "npu_dtype_cast", "npu_format_cast", "npu_quantize", "npu_trans_quant_param"]

_F32 = torch.float32
Example = tuple[tuple[Any, ...], dict[str, Any]]
_OPP = "op-plugin master docs/zh/custom_APIs/torch_npu/torch_npu-"

# the ScalarType numbers an ``int dtype`` argument carries (torch.quint8 -> 13, ...)
_OUT = {
    torch.quint8: torch.uint8, torch.qint8: torch.int8, torch.qint32: torch.int32,
    torch.uint8: torch.uint8, torch.int8: torch.int8, torch.int32: torch.int32,
}


def _dtype(value: Any) -> torch.dtype | None:
    """The torch dtype of an ``int dtype`` argument (a dtype, or its ScalarType number)."""
    if isinstance(value, torch.dtype):
        return value
    for dtype in (*_OUT, torch.quint4x2):
        if _scalar_type(dtype) == value:
            return dtype
    return None


def _scalar_type(dtype: torch.dtype) -> int:
    """``dtype``'s ScalarType number (what the dispatcher hands an ``int dtype`` argument)."""
    order = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
             "complex32", "complex64", "complex128", "bool", "qint8", "quint8", "qint32",
             "bfloat16", "quint4x2"]
    name = str(dtype).removeprefix("torch.")
    return order.index(name) if name in order else -1


def int4_pack(values: torch.Tensor) -> torch.Tensor:
    """Values in [-8, 7] (any integer dtype), eight per int32 along the last axis, the first in
    the lowest nibble (op-plugin's test golden for npu_convert_weight_to_int4pack)."""
    v = values.to(torch.int64) & 0xF
    shape = v.shape
    v = v.reshape(*shape[:-1], shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    packed = (v << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """int32 weight (k, n) of int4 values -> int32 (k, n // 8), eight values per element."""
    if weight.size(-1) % 8:
        raise RuntimeError("npu_convert_weight_to_int4pack: the last dimension of weight must be "
                           f"a multiple of 8, got {weight.size(-1)}")
    return int4_pack(weight)


def _fp19_bits(scale: torch.Tensor, round_mode: int) -> torch.Tensor:
    bits = scale.to(_F32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if round_mode == 1:  # R_INT: round the 13 dropped bits to nearest, ties to even
        bits = bits + 0xFFF + ((bits >> 13) & 1)
        bits = bits & 0xFFFFFFFF
    return bits & 0xFFFFE000


def npu_trans_quant_param(scale: torch.Tensor, offset: torch.Tensor | None = None,
                          round_mode: int | None = 0) -> torch.Tensor:
    """fp32 scale (and offset) packed into int64 (see the module docstring)."""
    mode = 0 if round_mode is None else round_mode
    if mode not in (0, 1):
        raise RuntimeError(f"round_mode must be 0 or 1. but now is {mode}")
    out = _fp19_bits(scale, mode) | (1 << 46)
    if offset is None:
        return out
    off = torch.round(offset.to(_F32)).clamp(-256, 255).to(torch.int64) & 0x1FF
    if scale.dim() == 1:
        size = max(scale.size(0), offset.reshape(-1).size(0))
        out, off = out.expand(size), off.reshape(-1).expand(size)
    return (out & 0x4000FFFFFFFF) | (off << 37)


def _along(t: torch.Tensor, axis: int, ndim: int) -> torch.Tensor:
    """A 1-D ``t`` shaped to broadcast along ``axis`` of an ``ndim``-D tensor."""
    if t.dim() != 1 or ndim == 0:
        return t
    shape = [1] * ndim
    shape[axis % ndim] = t.numel()
    return t.reshape(shape)


def npu_quantize(self: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                 dtype: Any, axis: int = 1, div_mode: bool = True) -> torch.Tensor:
    """Per-channel quantisation (see the module docstring)."""
    want = _dtype(dtype)
    x = self.to(_F32)
    if div_mode:
        if want not in _OUT:
            raise NotImplementedError(f"npu_quantize: dtype {dtype!r} (fp8 / hifloat8 outputs) "
                                      "is not emulated")
        out = _OUT[want]
        info = torch.iinfo(out)
        q = torch.round(x / _along(scales.to(_F32), axis, x.dim()))
        if zero_points is not None:
            q = q + _along(zero_points.to(_F32), axis, x.dim())
        return q.clamp(info.min, info.max).to(out)
    ax = axis if axis < -1 else -1
    q = x * _along(scales.to(_F32), ax, x.dim())
    if zero_points is not None:
        q = q + _along(zero_points.to(_F32), ax, x.dim())
    q = torch.round(q)
    if want == torch.quint4x2:
        if x.size(-1) % 8:
            raise RuntimeError("Input shape last dim must be divded by 8")
        return int4_pack(q.clamp(-8, 7))
    if want != torch.qint8:
        raise NotImplementedError(f"npu_quantize: div_mode=False with dtype {dtype!r} is not "
                                  "emulated (torch.qint8 and torch.quint4x2 are)")
    return q.clamp(-128, 127).to(torch.int8)


def npu_format_cast(self: torch.Tensor, acl_format: Any, *, customize_dtype: int | None = None,
                    input_dtype: int | None = None) -> torch.Tensor:
    """A storage-format change: the same values (the emulation stores every format as ND)."""
    return self.clone()


# the dtype numbers a cast takes: c10::ScalarType's (bool too) and torch_npu's float8 codes
_CAST_TYPES: dict[int, torch.dtype] = {**SCALAR_TYPES, 11: torch.bool, **FP8_TYPES}


def cast_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype a cast's ``dtype`` argument names (a torch.dtype or its number)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    want = _CAST_TYPES.get(int(dtype))
    if want is None:
        raise NotImplementedError(f"npu_dtype_cast: dtype {int(dtype)} (torch_npu's hifloat8 or "
                                  "float4 types) is not emulated")
    return want


def npu_dtype_cast(self: torch.Tensor, dtype: Any, input_dtype: Any = None) -> torch.Tensor:
    """``self`` cast to ``dtype`` (a new tensor, as ``Tensor.to(copy=True)``)."""
    if input_dtype is not None and cast_dtype(input_dtype) != self.dtype:
        raise NotImplementedError("npu_dtype_cast: input_dtype other than the tensor's own "
                                  "(torch_npu's hifloat8 / float4 containers) is not emulated")
    return self.to(cast_dtype(dtype), copy=True)


# --------------------------------------------------------------------------- examples
def _quantize_example(g: torch.Generator) -> Example:
    x = torch.randn(4, 8, generator=g)
    return (x, torch.rand(8, generator=g) + 0.5, torch.zeros(8, dtype=torch.int32),
            _scalar_type(torch.qint8)), {"axis": 1}


def _trans_quant_param_example(g: torch.Generator) -> Example:
    return (torch.rand(8, generator=g) + 1.0,), {}


def _int4pack_example(g: torch.Generator) -> Example:
    return (torch.randint(-8, 8, (16, 32), generator=g, dtype=torch.int32),), {}


def _dtype_cast_example(g: torch.Generator) -> Example:
    return (torch.tensor([0.0, 0.5, -1.0, 2.75]), _scalar_type(torch.int32)), {}


def _format_cast_example(g: torch.Generator) -> Example:
    return (torch.randn(4, 16, generator=g), 29), {}


REFERENCES: tuple[Reference, ...] = (
    Reference("npu_quantize", npu_quantize, example=_quantize_example,
              source=f"{_OPP}npu_quantize.md; op-plugin QuantizeKernelNpuOpApi.cpp"),
    Reference("npu_trans_quant_param", npu_trans_quant_param, example=_trans_quant_param_example,
              source=f"{_OPP}npu_trans_quant_param.md"),
    Reference("npu_convert_weight_to_int4pack", npu_convert_weight_to_int4pack,
              example=_int4pack_example,
              source=f"{_OPP}npu_convert_weight_to_int4pack.md; op-plugin "
                     "test_npu_convert_weight_to_int4pack.py (the packing golden)"),
    Reference("npu_dtype_cast", npu_dtype_cast, example=_dtype_cast_example,
              source="torch_npu 2.14.0 _op_plugin_docs.py (npu_dtype_cast)"),
    Reference("npu_format_cast", npu_format_cast, example=_format_cast_example,
              source=f"{_OPP}npu_format_cast.md (a storage format, not the values)"),
)
