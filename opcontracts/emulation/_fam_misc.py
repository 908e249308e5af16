"""Emulated ops of torch_npu's smaller fused ops: activations, the masked softmax, layer norm for
inference, the reshape-transpose, the in-place scatter, sign packing, block and dual-axis MX
quantisation, the weight-only quantised matmul.  One ``EmulatedOp`` entry per op (see
``_family``); their references (the kernels' math) live in ``opcontracts.reference._fam_misc``.

Schemas are torch_npu 2.14.0's (the wheel digest); ``dtypes`` are the sources' (the contracts'
first table), the kernel's assumed dtype first.  Arguments whose documented dtypes have no name
here or span many kinds (``npu_confusion_transpose``'s self, ``npu_scatter_nd_update_``'s self,
updates and indices (the docs' int32 / int64: another integer is rejected by aclnn's dtype check,
not misread, and the contract rejects it before), ``npu_layer_norm_eval``, the weight-only matmul's int8 / int32 weight) are left
unrestricted: the emulated kernel reads each dtype as what it is.

``_npu_dropout_gen_mask`` draws a dropout bit mask at ``(seed, offset)``: the kernel's layout,
the emulation's bits (``opcontracts.reference._dropout``).

``npu_scatter_nd_update_`` writes into ``self`` and returns it, as its schema says
(``Tensor(a!) self -> Tensor(a!)``): ``writes="self"``.

Backward: op-plugin's ``derivatives.yaml`` gives ``npu_gelu``, ``npu_silu``,
``npu_confusion_transpose`` and ``npu_scaled_masked_softmax`` backward kernels (``*_backward``).
``npu_gelu``'s node calls ``npu_gelu_backward`` as the C++ node does (through the overload
captured at install: ``_captured``), an emulated op with its own dtype profile and contract;
the other three train through autograd of the reference (``AUTOGRAD``), the same gradient.  The
other ops have no derivative entry; they get no autograd kernel (torch's fallback warns).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..reference._matmul import FP8_TYPES
from ._captured import call
from ._family import AUTOGRAD, NO_DERIVATIVE, EmulatedOp

__all__ = ["OPS"]

FLOATS = ("bf16", "fp16", "fp32")
_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"
_DERIV = "op-plugin op_plugin/config/derivatives.yaml"


# --------------------------------------------------------------------------- fakes
def _gelu_fake(self: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    return self.new_empty(self.shape)


def _gelu_backward_fake(grad_output: torch.Tensor, self: torch.Tensor, *,
                        approximate: str = "none") -> torch.Tensor:
    """The glue's output: the broadcast shape, the result type (op_plugin_functions.yaml)."""
    shape = torch.broadcast_shapes(grad_output.shape, self.shape)
    return self.new_empty(shape, dtype=torch.result_type(grad_output, self))


def _gelu_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """``NpuGeluBackward0`` (saves ``self``): ``npu_gelu_backward(grad, self, approximate)``
    (op-plugin ``derivatives.yaml``), the backward kernel with its own dtype profile."""
    return {"self": call("npu_gelu_backward", grads, inputs["self"],
                         approximate=inputs["approximate"])}


def _silu_fake(self: torch.Tensor) -> torch.Tensor:
    return self.new_empty(self.shape)


def _confusion_transpose_fake(self: torch.Tensor, perm: Sequence[int], shape: Sequence[int],
                              transpose_first: bool) -> torch.Tensor:
    if transpose_first:
        return self.new_empty(tuple(shape))
    return self.new_empty(tuple(shape[p] for p in perm))


def _scaled_masked_softmax_fake(x: torch.Tensor, mask: torch.Tensor, scale: float = 1,
                                fixed_triu_mask: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape)


def _layer_norm_eval_fake(input: torch.Tensor, normalized_shape: Sequence[int],
                          weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                          eps: float = 1e-5) -> torch.Tensor:
    return input.new_empty(input.shape)


def _scatter_nd_update_fake(self: torch.Tensor, indices: torch.Tensor,
                            updates: torch.Tensor) -> torch.Tensor:
    return self


def _sign_bits_pack_fake(self: torch.Tensor, size: int) -> torch.Tensor:
    n = -(-self.numel() // 8)
    return self.new_empty((size, n // size), dtype=torch.uint8)


def _sign_bits_unpack_fake(input: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    return input.new_empty((size, input.numel() * 8 // size), dtype=dtype)


def _dynamic_block_quant_fake(x: torch.Tensor, *, min_scale: float = 0.0,
                              round_mode: str = "rint", dst_type: int = 1,
                              row_block_size: int = 1, col_block_size: int = 128,
                              dst_type_max: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    scale = list(x.shape)
    scale[-2] = math.ceil(scale[-2] / row_block_size)
    scale[-1] = math.ceil(scale[-1] / col_block_size)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(scale, dtype=torch.float32)


def _dual_axis_fake(input: torch.Tensor, *, round_mode: str = "rint", dst_type: int = 296,
                    scale_alg: int = 0, dst_type_max: float | None = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = list(input.shape)
    fp8 = FP8_TYPES.get(dst_type)
    if fp8 is None:  # FP4: two codes per uint8 along the last axis
        y_shape, y_dtype = [*shape[:-1], shape[-1] // 2], torch.uint8
    else:
        y_shape, y_dtype = shape, fp8
    s1 = [*shape[:-1], (-(-shape[-1] // 32) + 1) // 2, 2]
    s2 = [*shape[:-2], (-(-shape[-2] // 32) + 1) // 2, shape[-1], 2]
    return (input.new_empty(y_shape, dtype=y_dtype), input.new_empty(s1, dtype=torch.uint8),
            input.new_empty(y_shape, dtype=y_dtype), input.new_empty(s2, dtype=torch.uint8))


def _weight_quant_bmm_fake(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                           antiquant_offset: torch.Tensor | None = None,
                           quant_scale: torch.Tensor | None = None,
                           quant_offset: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None, antiquant_group_size: int = 0,
                           inner_precise: int = 0, weight_dtype: int | None = None
                           ) -> torch.Tensor:
    n = weight.size(1) * 8 if weight.dtype == torch.int32 else weight.size(1)
    dtype = torch.int8 if quant_scale is not None else x.dtype
    return x.new_empty((x.size(0), n), dtype=dtype)


def _gen_mask_fake(self: torch.Tensor, size: Sequence[int], p: float, seed: int, offset: int,
                   *, parallel: bool | None = True, sync: bool | None = None) -> torch.Tensor:
    numels = math.prod(int(s) for s in size)
    return self.new_empty(((numels + 127) // 128 * 16,), dtype=torch.uint8)


# --------------------------------------------------------------------------- the entries
OPS: tuple[EmulatedOp, ...] = (
    EmulatedOp("npu_gelu", fake=_gelu_fake, dtypes={"self": FLOATS}, backward=_gelu_backward,
               source=f"op-plugin torch_npu-npu_gelu.md (Atlas A2); {_DERIV}"),
    EmulatedOp("npu_gelu_backward", fake=_gelu_backward_fake,
               dtypes={"grad_output": FLOATS, "self": FLOATS},
               source=f"{_DERIV} (npu_gelu); op-plugin torch_npu-npu_gelu.md (Atlas A2: the "
                      "forward's dtypes)"),
    EmulatedOp("npu_silu", fake=_silu_fake, dtypes={"self": ("fp16", "fp32")},
               backward=AUTOGRAD, source=f"{_DOCS}; {_DERIV}"),
    # the same kernel in place (``writes``); no derivative entry in op-plugin
    EmulatedOp("npu_silu_", fake=_silu_fake, dtypes={"self": ("fp16", "fp32")},
               backward=NO_DERIVATIVE, writes="self", source=f"{_DOCS} (npu_silu)"),
    EmulatedOp("npu_confusion_transpose", fake=_confusion_transpose_fake, backward=AUTOGRAD,
               source=f"{_DOCS}; {_DERIV}"),
    EmulatedOp("npu_scaled_masked_softmax", fake=_scaled_masked_softmax_fake,
               dtypes={"x": ("fp16", "fp32", "bf16"), "mask": ("bool",)}, backward=AUTOGRAD,
               source=f"{_DOCS}; {_DERIV}"),
    EmulatedOp("npu_layer_norm_eval", fake=_layer_norm_eval_fake, source=_DOCS),
    # no derivative entry in op-plugin: a backward through the in-place update raises
    EmulatedOp("npu_scatter_nd_update_", fake=_scatter_nd_update_fake, backward=NO_DERIVATIVE,
               writes="self", source=_DOCS),
    EmulatedOp("npu_sign_bits_pack", fake=_sign_bits_pack_fake,
               dtypes={"self": ("fp32", "fp16")}, source=_DOCS),
    # input: uint8 bytes of packed signs; int8 holds the same bytes (read alike)
    EmulatedOp("npu_sign_bits_unpack", fake=_sign_bits_unpack_fake, source=_DOCS),
    EmulatedOp("npu_dynamic_block_quant", fake=_dynamic_block_quant_fake,
               dtypes={"x": ("bf16", "fp16")}, source=_DOCS),
    EmulatedOp("npu_dynamic_mx_quant_with_dual_axis", fake=_dual_axis_fake,
               dtypes={"input": ("bf16", "fp16")}, source=_DOCS),
    EmulatedOp("npu_weight_quant_batchmatmul", fake=_weight_quant_bmm_fake,
               dtypes={"x": ("fp16", "bf16"), "weight": ("int8",)},
               source=f"{_DOCS} (int8 weight)"),
    # the only overload is ``.Tensor``; no derivative (a mask)
    EmulatedOp("_npu_dropout_gen_mask", fake=_gen_mask_fake,
               source="op-plugin DropoutGenMaskKernelNpuOpApi.cpp"),
)
