"""Emulated ops of the norm / activation / rotary / loss / quantisation family: one
``EmulatedOp`` entry per op (see ``_family``); their references (the kernels' math) live in
``opcontracts.reference._fam_norm_quant``.

Schemas are torch_npu 2.14.0's (the wheel digest).  ``dtypes`` are what the sources document
for each tensor argument, the kernel's assumed dtype first (an argument in another dtype is
misread as that one); they are the same in every profile: where the sources differ it is per
chip (no bf16 on the Atlas inference cards for add_rms_norm and apply_rotary_pos_emb), and a
narrower profile would misread the bf16 calls every contract here allows.  Arguments whose
documented dtypes span kinds the probe grids keep apart (int32 or floating ``bias`` and int64
or floating ``scale`` of ``npu_quant_matmul``; int32 or bf16 ``x`` of
``npu_dequant_swiglu_quant``) are left unrestricted: the emulated kernel reads each dtype as
what it is.

Backward: only ``npu_cross_entropy_loss`` is trained through here.  Its backward calls
``npu_cross_entropy_loss_backward`` (the ``OpOverload`` captured at install), as torch_npu's
derivative does from C++ (op-plugin ``derivatives.yaml``): the patch's dispatcher guard sees it;
``npu_swiglu``'s backward calls ``npu_swiglu_backward`` the same way (``_backward``).  The
other ops have no derivative in torch_npu (op-plugin's ``derivatives.yaml`` has no entry for
them): ``npu_add_rms_norm`` and ``npu_apply_rotary_pos_emb`` raise on backward, as torch_npu's
tests assert its not-implemented fallback does (``NO_DERIVATIVE``); the quantising and serving
ops get no autograd kernel (None), as the first packs' inference ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from . import _captured
from ._family import NO_DERIVATIVE, EmulatedOp

__all__ = ["OPS"]

FLOATS = ("bf16", "fp16", "fp32")
_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"

_ST_INT8, _ST_FP16, _ST_BF16, _ST_INT32, _ST_QUINT4X2 = 1, 5, 15, 3, 16
_ST_FP8 = {23: torch.float8_e5m2, 24: torch.float8_e4m3fn}
_NPU_FP8 = {291: torch.float8_e5m2, 292: torch.float8_e4m3fn}


# --------------------------------------------------------------------------- fakes
def _add_rms_norm_fake(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                       epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(gamma.dim(), 1)
    rstd = x1.new_empty((*x1.shape[:-n], *([1] * n)), dtype=torch.float32)
    return x1.new_empty(x1.shape), rstd, x1.new_empty(x1.shape)


def _swiglu_backward_fake(grad_output: torch.Tensor, self: torch.Tensor, dim: int = -1
                          ) -> torch.Tensor:
    return self.new_empty(self.shape)


def _rms_norm_backward_fake(dy: torch.Tensor, self: torch.Tensor, gamma: torch.Tensor,
                            rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return self.new_empty(self.shape), gamma.new_empty(gamma.shape)


def _rotary_mul_backward_fake(grad: torch.Tensor, self: torch.Tensor, r1: torch.Tensor,
                              r2: torch.Tensor, rotary_mode: str = "half"
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return self.new_empty(self.shape), r1.new_empty(r1.shape), r2.new_empty(r2.shape)


def _halved(x: torch.Tensor, dim: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = shape[dim] // 2
    return shape


def _clipped_swiglu_fake(x: torch.Tensor, *, group_index: torch.Tensor | None = None,
                         dim: int = -1, alpha: float = 1.702, limit: float = 7.0,
                         bias: float = 1.0, interleaved: bool = True) -> torch.Tensor:
    return x.new_empty(_halved(x, dim))


def _apply_rotary_fake(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, layout: str = "BSND", rotary_mode: str = "half"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape)


def _mrope_fake(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                cos_sin_cache: torch.Tensor, head_size: int, *,
                mrope_section: Sequence[int] | None = None, rotary_mode: str | None = "half",
                cache_mode: str | None = "default") -> tuple[torch.Tensor, torch.Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape)


def _cross_entropy_fake(input: torch.Tensor, target: torch.Tensor,
                        weight: torch.Tensor | None = None, reduction: str = "mean",
                        ignore_index: int = -100, label_smoothing: float = 0.0,
                        lse_square_scale_for_zloss: float = 0.0, return_zloss: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = input.size(0)
    loss_shape = (n,) if reduction == "none" else (1,)
    return (input.new_empty(loss_shape), input.new_empty(input.shape),
            input.new_empty(loss_shape), input.new_empty((n,)))


def _cross_entropy_backward_fake(
        grad_loss: torch.Tensor, log_prob: torch.Tensor, target: torch.Tensor,
        weight: torch.Tensor | None = None, grad_zloss: torch.Tensor | None = None,
        lse_for_zloss: torch.Tensor | None = None, reduction: str = "mean",
        ignore_index: int = -100, label_smoothing: float = 0.0,
        lse_square_scale_for_zloss: float = 0.0) -> torch.Tensor:
    return log_prob.new_empty(log_prob.shape)


def _dynamic_quant_fake(input: torch.Tensor, *, smooth_scales: torch.Tensor | None = None,
                        group_index: torch.Tensor | None = None, dst_type: int | None = None,
                        quant_mode: str = "pertoken", dst_type_max: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The meta kernel's shapes (torch_npu 2.14.0 ``_meta_registrations.py``)."""
    shape = list(input.shape)
    if quant_mode == "pertensor":
        scale = input.new_empty((1,), dtype=torch.float32)
    elif quant_mode == "perchannel":
        scale = input.new_empty((*shape[:-2], shape[-1]), dtype=torch.float32)
    else:
        scale = input.new_empty(shape[:-1], dtype=torch.float32)
    dst = _ST_INT8 if dst_type is None else dst_type
    if dst == _ST_QUINT4X2:
        return input.new_empty((*shape[:-1], shape[-1] // 8), dtype=torch.int32), scale
    return input.new_empty(shape, dtype=_ST_FP8.get(dst, torch.int8)), scale


def _dynamic_quant_asymmetric_fake(
        input: torch.Tensor, *, smooth_scales: torch.Tensor | None = None,
        group_index: torch.Tensor | None = None, dst_type: int | None = None,
        quant_mode: str = "pertoken", dst_type_max: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The meta kernel's shapes (torch_npu 2.14.0 ``_meta_registrations.py``): those of
    ``npu_dynamic_quant``'s, whose meta kernel it repeats line for line, and an offset shaped
    as the scale."""
    y, scale = _dynamic_quant_fake(input, smooth_scales=smooth_scales, group_index=group_index,
                                   dst_type=dst_type, quant_mode=quant_mode,
                                   dst_type_max=dst_type_max)
    return y, scale, scale.new_empty(scale.shape)


def _quant_matmul_fake(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *,
                       offset: torch.Tensor | None = None,
                       pertoken_scale: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, output_dtype: int | None = None,
                       x1_dtype: int | None = None, x2_dtype: int | None = None,
                       pertoken_scale_dtype: int | None = None, scale_dtype: int | None = None,
                       group_sizes: Sequence[int] | None = None,
                       y_scale: torch.Tensor | None = None) -> torch.Tensor:
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    dtype = {_ST_FP16: torch.float16, _ST_BF16: torch.bfloat16}.get(
        _ST_INT8 if output_dtype is None else output_dtype, torch.int8)
    n = x2.size(-1)
    if x2.dtype == torch.int32 and not (x2.dim() >= 2 and x2.stride(-2) == 1
                                        and x2.stride(-1) != 1 and x2.size(-2) > 1):
        n *= 8  # A4W4: (k, n // 8), eight int4 per int32 along n
    return x1.new_empty((*batch, x1.size(-2), n), dtype=dtype)


def _dynamic_mx_quant_fake(input: torch.Tensor, *, axis: int = -1, round_mode: str = "rint",
                           dst_type: int = 296, block_size: int = 32, scale_alg: int | None = 0,
                           dst_type_max: float = 0.0, max_low_bound: float = 0.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The meta kernel's shapes: y like input (fp8) or with the last axis halved (FP4 in
    uint8); mxscale uint8, the block axis ceil(n / block_size) padded to even and halved, a
    trailing 2."""
    shape = list(input.shape)
    ax = axis % input.dim()
    scale_shape = [*shape, 2]
    scale_shape[ax] = (math.ceil(shape[ax] / block_size) + 1) // 2
    mxscale = input.new_empty(scale_shape, dtype=torch.uint8)
    if dst_type in _NPU_FP8:
        return input.new_empty(shape, dtype=_NPU_FP8[dst_type]), mxscale
    return input.new_empty((*shape[:-1], shape[-1] // 2), dtype=torch.uint8), mxscale


def _dequant_swiglu_quant_fake(
        x: torch.Tensor, *, weight_scale: torch.Tensor | None = None,
        activation_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
        quant_scale: torch.Tensor | None = None, quant_offset: torch.Tensor | None = None,
        group_index: torch.Tensor | None = None, activate_left: bool = False,
        quant_mode: int = 0, dst_type: int | None = None, round_mode: int | None = None,
        activate_dim: int | None = None, swiglu_mode: int = 0, clamp_limit: float = 7.0,
        glu_alpha: float = 1.702, glu_bias: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    y_shape = _halved(x, -1 if activate_dim is None else activate_dim)
    return (x.new_empty(y_shape, dtype=torch.int8),
            x.new_empty(y_shape[:-1], dtype=torch.float32))


# --------------------------------------------------------------------------- backward
def _cross_entropy_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """torch_npu's derivative (op-plugin derivatives.yaml, ``output_differentiability: [true,
    false, true, false]``): ``npu_cross_entropy_loss_backward(grads[0], result1, target,
    weight, grads[1], result3, ...)``: the backward kernel on the loss's gradient and the saved
    log_prob, through the ``OpOverload`` captured at install, as the C++ node calls it."""
    grad_loss, _, grad_zloss, _ = grads
    _, log_prob, _, lse = outputs
    grad = _captured.call("npu_cross_entropy_loss_backward",
        grad_loss, log_prob, inputs["target"], inputs["weight"],
        grad_zloss if inputs["return_zloss"] else None, lse, inputs["reduction"],
        inputs["ignore_index"], inputs["label_smoothing"], inputs["lse_square_scale_for_zloss"])
    return {"input": grad}


# --------------------------------------------------------------------------- the entries
OPS: tuple[EmulatedOp, ...] = (
    EmulatedOp("npu_add_rms_norm", fake=_add_rms_norm_fake,
               dtypes={"x1": FLOATS, "x2": FLOATS, "gamma": FLOATS}, backward=NO_DERIVATIVE,
               source="CANN 8.2.RC1 aclnnAddRmsNorm (Atlas A2/A3: FLOAT32, FLOAT16, BFLOAT16)"),
    EmulatedOp("npu_rms_norm_backward", fake=_rms_norm_backward_fake,
               dtypes={"dy": FLOATS, "self": FLOATS, "gamma": FLOATS, "rstd": ("fp32",)},
               source=f"{_DOCS} (npu_rms_norm); torch_npu 2.13.0 Functions.h (NpuRmsNormBackward0)"),
    EmulatedOp("npu_rotary_mul_backward", fake=_rotary_mul_backward_fake,
               dtypes={"grad": FLOATS, "self": FLOATS, "r1": FLOATS, "r2": FLOATS},
               source=f"{_DOCS} (npu_rotary_mul); torch_npu Functions.cpp "
                      "(NpuRotaryMulBackward0)"),
    EmulatedOp("npu_swiglu_backward", fake=_swiglu_backward_fake,
               dtypes={"grad_output": FLOATS, "self": FLOATS},
               source=f"{_DOCS} (npu_swiglu); MindSpeed master docs/zh/ops/swiglu.md (backward)"),
    EmulatedOp("npu_clipped_swiglu", fake=_clipped_swiglu_fake,
               dtypes={"x": FLOATS, "group_index": ("int64",)}, source=_DOCS),
    EmulatedOp("npu_apply_rotary_pos_emb", fake=_apply_rotary_fake,
               dtypes={"query": FLOATS, "key": FLOATS, "cos": FLOATS, "sin": FLOATS},
               backward=NO_DERIVATIVE, source=_DOCS),
    EmulatedOp("npu_mrope", fake=_mrope_fake,
               dtypes={"positions": ("int64", "int32"), "query": FLOATS, "key": FLOATS,
                       "cos_sin_cache": FLOATS}, source=_DOCS),
    EmulatedOp("npu_cross_entropy_loss", fake=_cross_entropy_fake,
               dtypes={"input": FLOATS, "target": ("int64",), "weight": ("fp32",)},
               backward=_cross_entropy_backward, source=_DOCS),
    EmulatedOp("npu_cross_entropy_loss_backward", fake=_cross_entropy_backward_fake,
               dtypes={"grad_loss": FLOATS, "log_prob": FLOATS, "target": ("int64",),
                       "weight": ("fp32",)},
               source=f"{_DOCS} (npu_cross_entropy_loss: input, target, weight)"),
    EmulatedOp("npu_dynamic_quant", fake=_dynamic_quant_fake,
               dtypes={"input": ("bf16", "fp16"), "smooth_scales": ("bf16", "fp16"),
                       "group_index": ("int32",)}, source=_DOCS),
    EmulatedOp("npu_dynamic_quant_asymmetric", fake=_dynamic_quant_asymmetric_fake,
               dtypes={"input": ("bf16", "fp16"), "smooth_scales": ("bf16", "fp16"),
                       "group_index": ("int32",)}, source=_DOCS),
    EmulatedOp("npu_quant_matmul", fake=_quant_matmul_fake,
               dtypes={"x1": ("int8", "int32"), "x2": ("int8", "int32"), "offset": ("fp32",),
                       "pertoken_scale": ("fp32",)},
               source=f"{_DOCS} (int8 modes; A4W4: int4 packed in int32)"),
    EmulatedOp("npu_dynamic_mx_quant", fake=_dynamic_mx_quant_fake,
               dtypes={"input": FLOATS}, source=_DOCS),
    EmulatedOp("npu_dequant_swiglu_quant", fake=_dequant_swiglu_quant_fake,
               dtypes={"weight_scale": ("fp32",), "activation_scale": ("fp32",),
                       "bias": ("int32",), "quant_scale": ("fp32", "fp16", "bf16"),
                       "quant_offset": ("fp32", "fp16", "bf16"), "group_index": ("int64",)},
               source=_DOCS),
)
