"""References of torch_npu's smaller fused ops: activations, the masked softmax, layer norm for
inference, the reshape-transpose, the in-place scatter, 1-bit Adam's sign packing, block and
dual-axis MX quantisation, the weight-only quantised matmul.  One ``Reference`` entry per op in
``REFERENCES`` (``_table`` appends them); the contracts in ``contracts/torch_npu/misc_ops.toml``
and ``quant_mx.toml`` cite the same sources.

Sources, per op (torch_npu 2.14.0 ``_op_plugin_docs.py`` unless named):

* ``npu_gelu``: GELU, erf or ``approximate='tanh'`` (op-plugin's torch_npu-npu_gelu.md);
  ``npu_gelu_backward``, what its autograd node calls (op-plugin ``derivatives.yaml``): the
  derivative at ``self`` times ``grad_output``, the two broadcast together, in their result
  type (``op_plugin_functions.yaml``: ``broadcast_ops_npu_output_size``, ``result_type``);
* ``npu_silu``: ``x * sigmoid(x)``; ``npu_silu_`` the same written into ``self`` (its schema's
  ``Tensor(a!) self``; no doc of its own);
* ``npu_confusion_transpose``: ``transpose_first``: permute by ``perm`` then reshape to
  ``shape``; else reshape then permute (the doc's two examples);
* ``npu_scaled_masked_softmax``: ``softmax((x * scale).masked_fill(mask, -inf), -1)``, the mask
  the upper triangle (``triu(diagonal=1)``) when ``fixed_triu_mask`` (Ascend's operator guide
  for ScaledMaskedSoftmax, "算子的计算逻辑"); a fully masked row is NaN as that formula gives;
* ``npu_layer_norm_eval``: ``torch.nn.functional.layer_norm`` (the doc says it is the same);
* ``npu_scatter_nd_update_``: ``self[indices[..., :]] = updates`` (the last axis of indices
  indexes self's leading axes), in place: the reference returns the updated copy, the
  emulated kernel writes it into ``self`` and returns ``self``; out-of-range index rows are
  dropped, never raised on;
* ``npu_sign_bits_pack``: bit i of byte j is ``x[8j + i] >= 0`` (little-endian bit order, the
  doc's example: [5, 4, 3, 2, 0, -1, -2, 4] packs to 159), padded with -1 to a multiple of 8,
  shaped ``(size, -1)``; ``npu_sign_bits_unpack``: the inverse, a set bit +1 and a clear bit -1
  in ``dtype``, shaped ``(size, -1)``;
* ``npu_dynamic_block_quant``: per block of ``row_block_size x col_block_size`` (the meta
  kernel's scale shape, the leading axis of a 3-D x a batch), ``scale = max(amax / 127,
  min_scale)``, ``y = rint(x / scale)`` saturated to int8 (dst_type 1, the only one the doc
  lists); a block of zeros has scale ``min_scale`` and zeros;
* ``npu_dynamic_mx_quant_with_dual_axis``: ``npu_dynamic_mx_quant`` along axis -1 (y1,
  mxscale1) and along axis -2 (y2, mxscale2), the doc's scenario 1 (scale_alg 0);
* ``npu_weight_quant_batchmatmul``: ``x @ ((weight + antiquant_offset) * antiquant_scale) +
  bias``, the scale per tensor, per channel (N) or per group of ``antiquant_group_size`` rows
  of K; with ``quant_scale`` the result ``rint(y * quant_scale + quant_offset)`` saturated to
  int8.

Modes the emulation does not compute raise ``NotImplementedError`` naming the mode: the int4
weight packed in int32, an int64 ``antiquant_scale`` or ``quant_scale`` (their fixed-point
encodings), ``npu_dynamic_block_quant``'s other dst_types, ``scale_alg`` 1 / 2 of the dual-axis
MX quantisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ._dropout import _npu_dropout_gen_mask
from ._entry import Reference
from ._fam_norm_quant import npu_dynamic_mx_quant
from ._util import acc_dtype

__all__ = ["REFERENCES"]

_F32 = torch.float32
Example = tuple[tuple[Any, ...], dict[str, Any]]
_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"
_META = "torch_npu 2.14.0 op_plugin/meta/_meta_registrations.py"


def _floats(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16
            ) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: exact in bf16, fp16, fp32 and fp64."""
    return (torch.randint(-16, 17, shape, generator=gen) / 8).to(dtype)


# --------------------------------------------------------------------------- activations
def npu_gelu(self: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """GELU (erf), or its tanh approximation; in self's dtype."""
    return F.gelu(self.to(acc_dtype(self)), approximate=approximate).to(self.dtype)


def _gelu_example(gen: torch.Generator) -> Example:
    return (_floats(gen, 4, 8, dtype=torch.float16),), {"approximate": "tanh"}


def npu_gelu_backward(grad_output: torch.Tensor, self: torch.Tensor, *,
                      approximate: str = "none") -> torch.Tensor:
    """``grad_output * gelu'(self)`` (erf, or the tanh approximation), broadcast, computed in
    fp32 and returned in the inputs' result type."""
    acc = acc_dtype(self)
    g, x = torch.broadcast_tensors(grad_output.to(acc), self.to(acc))
    out = torch.ops.aten.gelu_backward(g.contiguous(), x.contiguous(), approximate=approximate)
    return out.to(torch.result_type(grad_output, self))


def _gelu_backward_example(gen: torch.Generator) -> Example:
    return (_floats(gen, 4, 8, dtype=torch.float16), _floats(gen, 4, 8, dtype=torch.float16)), {
        "approximate": "tanh"}


def npu_silu(self: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``, in self's dtype."""
    return F.silu(self.to(acc_dtype(self))).to(self.dtype)


def _silu_example(gen: torch.Generator) -> Example:
    return (_floats(gen, 4, 8, dtype=torch.float16),), {}


# --------------------------------------------------------------------------- reshape-transpose
def npu_confusion_transpose(self: torch.Tensor, perm: Sequence[int], shape: Sequence[int],
                            transpose_first: bool) -> torch.Tensor:
    """``transpose_first``: ``self.permute(perm).reshape(shape)``; else
    ``self.reshape(shape).permute(perm)`` (a new contiguous tensor either way)."""
    if transpose_first:
        return self.permute(*perm).reshape(*shape).clone()
    return self.reshape(*shape).permute(*perm).contiguous()


def _confusion_transpose_example(gen: torch.Generator) -> Example:
    return (_floats(gen, 2, 3, 4, 6, dtype=_F32), [0, 2, 1, 3], [2, 4, 18], True), {}


# --------------------------------------------------------------------------- masked softmax
def npu_scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor, scale: float = 1,
                              fixed_triu_mask: bool = False) -> torch.Tensor:
    """``softmax((x * scale).masked_fill(mask, -inf), dim=-1)`` in x's dtype; with
    ``fixed_triu_mask`` the mask is the strict upper triangle of x's last two axes."""
    acc = acc_dtype(x)
    v = x.to(acc) * float(scale)
    if fixed_triu_mask:
        h, w = x.shape[-2:]
        masked = torch.ones(h, w, dtype=torch.bool, device=x.device).triu(1)
    else:
        masked = mask.to(torch.bool)
    v = v.masked_fill(masked, float("-inf"))
    return torch.softmax(v, dim=-1).to(x.dtype)


def _scaled_masked_softmax_example(gen: torch.Generator) -> Example:
    s = 32
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    return (_floats(gen, 1, 2, s, s, dtype=torch.float16), causal, 0.5, False), {}


# --------------------------------------------------------------------------- layer norm
def npu_layer_norm_eval(input: torch.Tensor, normalized_shape: Sequence[int],
                        weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                        eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` (the doc: the same), computed in fp32 (fp64 for fp64)."""
    acc = acc_dtype(input)
    w = None if weight is None else weight.to(acc)
    b = None if bias is None else bias.to(acc)
    return F.layer_norm(input.to(acc), list(normalized_shape), w, b, eps).to(input.dtype)


def _layer_norm_eval_example(gen: torch.Generator) -> Example:
    return (_floats(gen, 6, 8, dtype=_F32), [8], _floats(gen, 8, dtype=_F32),
            _floats(gen, 8, dtype=_F32), 1e-5), {}


# --------------------------------------------------------------------------- scatter
def npu_scatter_nd_update_(self: torch.Tensor, indices: torch.Tensor,
                           updates: torch.Tensor) -> torch.Tensor:
    """``self`` with ``self[tuple(indices[i])] = updates[i]`` for every index row i (the last
    axis of ``indices`` indexes self's leading axes); returned as a new tensor.  Rows with an
    index out of range are dropped; a later row wins over an earlier one."""
    depth = indices.size(-1)
    lead = self.shape[:depth]
    rows = indices.reshape(-1, depth).long()
    valid = ((rows >= 0) & (rows < torch.tensor(lead, device=rows.device))).all(-1)
    flat_idx = torch.zeros(rows.size(0), dtype=torch.long, device=rows.device)
    for d, n in enumerate(lead):
        flat_idx = flat_idx * n + rows[:, d].clamp(0, max(n - 1, 0))
    out = self.reshape(math.prod(lead), *self.shape[depth:]).clone()
    upd = updates.reshape(rows.size(0), *self.shape[depth:]).to(self.dtype)
    keep = valid.nonzero().reshape(-1)
    out[flat_idx[keep]] = upd[keep]
    return out.reshape(self.shape)


def _scatter_nd_update_example(gen: torch.Generator) -> Example:
    cache = _floats(gen, 6, 2, 4, dtype=torch.float16)
    slots = torch.tensor([[4], [1]], dtype=torch.int64)
    return (cache, slots, _floats(gen, 2, 2, 4, dtype=torch.float16)), {}


# --------------------------------------------------------------------------- sign bits
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def npu_sign_bits_pack(self: torch.Tensor, size: int) -> torch.Tensor:
    """Bit i of byte j is ``self[8j + i] >= 0``; self padded with -1 to a multiple of 8; uint8
    of shape ``(size, -1)``."""
    flat = self.reshape(-1)
    pad = (-flat.numel()) % 8
    bits = torch.cat([flat >= 0, flat.new_zeros(pad, dtype=torch.bool)]).reshape(-1, 8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int64, device=self.device)
    return (bits.long() * weights).sum(-1).to(torch.uint8).reshape(size, -1)


def _sign_bits_pack_example(gen: torch.Generator) -> Example:
    return (_floats(gen, 14, dtype=_F32), 2), {}


def npu_sign_bits_unpack(input: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Each uint8 as 8 values, bit i first: +1 for a set bit, -1 for a clear one, in ``dtype``,
    of shape ``(size, -1)``."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int64, device=input.device)
    bits = (input.reshape(-1, 1).long() & weights) != 0
    return (bits.to(dtype) * 2 - 1).reshape(size, -1)


def _sign_bits_unpack_example(gen: torch.Generator) -> Example:
    return (torch.randint(0, 256, (4,), generator=gen, dtype=torch.uint8), 2, torch.float32), {}


# --------------------------------------------------------------------------- block quant
def npu_dynamic_block_quant(x: torch.Tensor, *, min_scale: float = 0.0, round_mode: str = "rint",
                            dst_type: int = 1, row_block_size: int = 1, col_block_size: int = 128,
                            dst_type_max: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``row_block_size x col_block_size`` of x's last two axes: ``scale =
    max(amax / 127, min_scale)``, ``y = rint(x / scale)`` saturated to int8.  Returns (y, scale),
    scale fp32 with the block counts in place of the last two axes (the meta kernel)."""
    if dst_type != 1 or round_mode != "rint" or dst_type_max:
        raise NotImplementedError("npu_dynamic_block_quant: only dst_type 1 (int8), round_mode "
                                  "'rint' and dst_type_max 0 are emulated")
    v = x.to(_F32)
    squeeze = v.dim() == 2
    if squeeze:
        v = v.unsqueeze(0)
    b, m, n = v.shape
    rb, cb = -(-m // row_block_size), -(-n // col_block_size)
    padded = F.pad(v, (0, cb * col_block_size - n, 0, rb * row_block_size - m))
    blocks = padded.reshape(b, rb, row_block_size, cb, col_block_size)
    amax = blocks.abs().amax(dim=(2, 4))                        # (b, rb, cb)
    scale = torch.clamp(amax / 127.0, min=min_scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, :, None, :, None]).clamp(-128, 127)
    q = torch.where(scale[:, :, None, :, None] > 0, q, torch.zeros_like(q))
    y = q.reshape(b, rb * row_block_size, cb * col_block_size)[:, :m, :n].to(torch.int8)
    if squeeze:
        return y.squeeze(0), scale.squeeze(0)
    return y, scale


def _dynamic_block_quant_example(gen: torch.Generator) -> Example:
    return (_floats(gen, 3, 200),), {"min_scale": 0.0, "col_block_size": 128}


# --------------------------------------------------------------------------- dual-axis MX
_TORCH_FP8_TO_NPU = {23: 291, 24: 292}   # torch.float8_e5m2 / e4m3fn -> torch_npu's codes


def npu_dynamic_mx_quant_with_dual_axis(input: torch.Tensor, *, round_mode: str = "rint",
                                        dst_type: int = 296, scale_alg: int = 0,
                                        dst_type_max: float | None = 0.0
                                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
    """MX quantisation along axis -1 (y1, mxscale1) and along axis -2 (y2, mxscale2), each as
    ``npu_dynamic_mx_quant`` with blocks of 32 (scale_alg 0, OCP MX)."""
    if scale_alg != 0:
        raise NotImplementedError("npu_dynamic_mx_quant_with_dual_axis: only scale_alg 0 (OCP "
                                  "MX) is emulated")
    code = _TORCH_FP8_TO_NPU.get(dst_type, dst_type)
    y1, s1 = npu_dynamic_mx_quant(input, axis=-1, round_mode=round_mode, dst_type=code,
                                  dst_type_max=dst_type_max or 0.0)
    y2, s2 = npu_dynamic_mx_quant(input, axis=-2, round_mode=round_mode, dst_type=code,
                                  dst_type_max=dst_type_max or 0.0)
    return y1, s1, y2, s2


def _dual_axis_example(gen: torch.Generator) -> Example:
    return (_floats(gen, 64, 64),), {"dst_type": 24}


# --------------------------------------------------------------------------- weight-only quant
def npu_weight_quant_batchmatmul(
        x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
        antiquant_offset: torch.Tensor | None = None, quant_scale: torch.Tensor | None = None,
        quant_offset: torch.Tensor | None = None, bias: torch.Tensor | None = None,
        antiquant_group_size: int = 0, inner_precise: int = 0,
        weight_dtype: int | None = None) -> torch.Tensor:
    """``x @ ((weight + antiquant_offset) * antiquant_scale) + bias`` (per tensor, per channel
    or per group of K rows), in x's dtype; with ``quant_scale``, ``rint(y * quant_scale +
    quant_offset)`` saturated to int8."""
    if weight.dtype != torch.int8 or weight_dtype is not None:
        raise NotImplementedError("npu_weight_quant_batchmatmul: only an int8 weight is "
                                  "emulated (int4 packed in int32 / uint8 is not)")
    if not antiquant_scale.is_floating_point() or (
            quant_scale is not None and not quant_scale.is_floating_point()):
        raise NotImplementedError("npu_weight_quant_batchmatmul: int64 (fixed-point) scales "
                                  "are not emulated")
    k = weight.size(0)
    w = weight.to(_F32)

    def per_row(t: torch.Tensor) -> torch.Tensor:
        t = t.to(_F32)
        if t.dim() == 2 and t.size(0) > 1 and antiquant_group_size > 0:
            return t.repeat_interleave(antiquant_group_size, 0)[:k]
        return t.reshape(1, -1)

    if antiquant_offset is not None:
        w = w + per_row(antiquant_offset)
    w = w * per_row(antiquant_scale)
    y = x.to(_F32) @ w
    if bias is not None:
        y = y + bias.to(_F32)
    if quant_scale is None:
        return y.to(x.dtype)
    y = y * quant_scale.to(_F32).reshape(-1)
    if quant_offset is not None:
        y = y + quant_offset.to(_F32).reshape(-1)
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def _weight_quant_bmm_example(gen: torch.Generator) -> Example:
    m, k, n = 4, 8, 6
    return (_floats(gen, m, k, dtype=torch.float16),
            torch.randint(-8, 9, (k, n), generator=gen, dtype=torch.int8),
            (torch.randint(1, 9, (n,), generator=gen) / 16).to(torch.float16)), {
        "antiquant_offset": torch.randint(-2, 3, (n,), generator=gen).to(torch.float16)}


def _gen_mask_example(gen: torch.Generator) -> Example:
    return (torch.zeros(1, dtype=torch.float16), [2, 100], 0.2, 7, 0), {}


# --------------------------------------------------------------------------- the entries
REFERENCES: tuple[Reference, ...] = (
    Reference("npu_gelu", npu_gelu, example=_gelu_example,
              source="Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_gelu.md"),
    Reference("npu_gelu_backward", npu_gelu_backward, example=_gelu_backward_example,
              grad_of="npu_gelu",
              source="op-plugin op_plugin/config/derivatives.yaml (npu_gelu: self: "
                     "npu_gelu_backward(grad, self, approximate)) and op_plugin_functions.yaml "
                     "(aclnnGeluBackwardV2; the output's size and dtype)"),
    Reference("npu_silu", npu_silu, example=_silu_example, source=_DOCS),
    Reference("npu_silu_", npu_silu, example=_silu_example,
              source=f"{_DOCS} (npu_silu; npu_silu_(Tensor(a!) self) -> Tensor(a!): in place)"),
    Reference("npu_confusion_transpose", npu_confusion_transpose,
              example=_confusion_transpose_example, source=_DOCS),
    Reference("npu_scaled_masked_softmax", npu_scaled_masked_softmax,
              example=_scaled_masked_softmax_example,
              source=f"{_DOCS}; Ascend PyTorch training migration guide, ScaledMaskedSoftmax "
                     "(算子的计算逻辑: softmax((x * scale).masked_fill(mask, -inf), dim=-1))"),
    Reference("npu_layer_norm_eval", npu_layer_norm_eval, example=_layer_norm_eval_example,
              source=f"{_DOCS} (the same as torch.nn.functional.layer_norm)"),
    Reference("npu_scatter_nd_update_", npu_scatter_nd_update_,
              example=_scatter_nd_update_example, source=_DOCS),
    Reference("npu_sign_bits_pack", npu_sign_bits_pack, example=_sign_bits_pack_example,
              source=f"{_DOCS} (the example: bit order and -1 padding)"),
    Reference("npu_sign_bits_unpack", npu_sign_bits_unpack, example=_sign_bits_unpack_example,
              source=f"{_DOCS} (the example)"),
    Reference("npu_dynamic_block_quant", npu_dynamic_block_quant,
              example=_dynamic_block_quant_example, source=f"{_DOCS}; {_META}"),
    Reference("npu_dynamic_mx_quant_with_dual_axis", npu_dynamic_mx_quant_with_dual_axis,
              example=_dual_axis_example,
              source=f"{_DOCS} (scale_alg 0); OCP Microscaling Formats (MX) v1.0"),
    Reference("npu_weight_quant_batchmatmul", npu_weight_quant_batchmatmul,
              example=_weight_quant_bmm_example, source=f"{_DOCS} (int8 weight); {_META}"),
    Reference("_npu_dropout_gen_mask", _npu_dropout_gen_mask, example=_gen_mask_example,
              source="op-plugin op_plugin/ops/opapi/DropoutGenMaskKernelNpuOpApi.cpp (length "
                     "and layout; the bits are the emulation's stream, reference._dropout)"),
)
