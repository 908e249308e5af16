"""Emulated ops of the quantisation-preparation family: ``npu_quantize``,
``npu_trans_quant_param``, ``npu_convert_weight_to_int4pack`` and the storage-format cast
``npu_format_cast``, one ``EmulatedOp`` entry per op (see ``_family``); their references live in
``opcontracts.reference._fam_quant_prep``.

Schemas are torch_npu 2.14.0's (the wheel digest).  None has a derivative in torch_npu but
``npu_format_cast`` (op-plugin ``derivatives.yaml``: the gradient passes through), trained
through here by autograd of its reference (a copy).  Dtypes are the torch_npu 2.14.0 docstrings'
(Atlas A2 rows).
"""

from __future__ import annotations

from typing import Any

import torch

from ..reference import _fam_quant_prep as ref
from ._family import AUTOGRAD, EmulatedOp

__all__ = ["OPS"]

FLOATS = ("bf16", "fp16", "fp32")
_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"


def _quantize_fake(self: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                   dtype: Any, axis: int = 1, div_mode: bool = True) -> torch.Tensor:
    want = ref._dtype(dtype)
    if want == torch.quint4x2 and not div_mode:
        return self.new_empty((*self.shape[:-1], self.size(-1) // 8), dtype=torch.int32)
    quantized = {torch.quint8: torch.uint8, torch.qint8: torch.int8, torch.qint32: torch.int32}
    if want is None:
        raise NotImplementedError(f"npu_quantize: dtype {dtype!r} is not emulated")
    out = quantized.get(want, want)
    return self.new_empty(self.shape, dtype=out)


def _trans_quant_param_fake(scale: torch.Tensor, offset: torch.Tensor | None = None,
                            round_mode: int | None = 0) -> torch.Tensor:
    shape: tuple[int, ...] = tuple(scale.shape)
    if scale.dim() == 1 and offset is not None:
        shape = (max(scale.size(0), offset.reshape(-1).size(0)),)
    return scale.new_empty(shape, dtype=torch.int64)


def _int4pack_fake(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    return weight.new_empty((*weight.shape[:-1], weight.size(-1) // 8), dtype=torch.int32)


def _dtype_cast_fake(self: torch.Tensor, dtype: Any, input_dtype: Any = None) -> torch.Tensor:
    return self.new_empty(self.shape, dtype=ref.cast_dtype(dtype))


def _dtype_cast_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """``NpuDtypeCastBackward0`` (keeps no tensor): the gradient cast back to the input's dtype
    (``npu_dtype_cast_backward(grad, self.scalar_type())``, derivatives.yaml)."""
    self = inputs["self"]
    return {"self": grads.to(self.dtype) if self.is_floating_point() else None}


def _format_cast_fake(self: torch.Tensor, acl_format: Any, *, customize_dtype: int | None = None,
                      input_dtype: int | None = None) -> torch.Tensor:
    return self.new_empty(self.shape)


OPS: tuple[EmulatedOp, ...] = (
    # input fp32/fp16/bf16; scales fp32/bf16 (A2, div_mode True) or fp32/fp16/bf16
    EmulatedOp("npu_quantize", fake=_quantize_fake,
               dtypes={"self": FLOATS, "scales": ("fp32", "bf16", "fp16")},
               source=f"{_DOCS} (npu_quantize)"),
    EmulatedOp("npu_trans_quant_param", fake=_trans_quant_param_fake,
               dtypes={"scale": ("fp32",), "offset": ("fp32",)},
               source=f"{_DOCS} (npu_trans_quant_param)"),
    EmulatedOp("npu_convert_weight_to_int4pack", fake=_int4pack_fake,
               dtypes={"weight": ("int32",)},
               source=f"{_DOCS} (npu_convert_weight_to_int4pack)"),
    EmulatedOp("npu_dtype_cast", fake=_dtype_cast_fake, backward=_dtype_cast_backward,
               source=f"{_DOCS} (npu_dtype_cast)"),
    EmulatedOp("npu_format_cast", fake=_format_cast_fake, backward=AUTOGRAD,
               source=f"{_DOCS} (npu_format_cast: the values unchanged)"),
)
