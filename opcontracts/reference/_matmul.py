"""Reference of ``npu_grouped_matmul`` (CANN aclnnGroupedMatmulV4), torch_npu 2.14.0
``_op_plugin_docs.py`` and its meta kernel (``_meta_registrations.py``), every argument of the
2.14.0 schema.

The doc's four formulas, per group ``i`` (accumulated in fp32, fp64 for fp64 inputs):

* non-quantized: ``y_i = x_i @ w_i + bias_i``;
* per-channel quantized (int8 x and weight): ``y_i = (x_i @ w_i + bias_i) * scale_i + offset_i``;
* per-token quantized: ``y_i = (x_i @ w_i + bias_i) * scale_i * per_token_scale_i``;
* antiquant (float x, int8 or int4 weight): ``y_i = x_i @ ((w_i + antiquant_offset_i) *
  antiquant_scale_i) + bias_i`` (per-channel scales ``(n,)``, per-group scales ``(G, n)``
  spread over ``k / G`` rows of the weight each);

then the activation ``act_type`` (0 none, 1 relu, 2 gelu tanh, 4 fast gelu, 5 silu; 3 is "not
supported" in the doc) and the output dtype (``output_dtype``, c10's ScalarType number as the
meta kernel reads it, else x's dtype; an int8 output is rounded half to even and saturated).

What the doc does not pin down, and the reference assumes (stated where it is used):

* an int64 ``scale`` is ``npu_trans_quant_param``'s packing: its low 32 bits read as fp32;
* an int32 weight carries 8 int4 values per element (the doc; the meta kernel multiplies N by
  8); they are unpacked as torchair's converter bitcasts them (``ge.Bitcast`` to DT_INT4),
  little-endian, the low nibble first;
* ``x_dtype`` / ``weight_dtype`` / ``scale_dtype`` / ``per_token_scale_dtype`` (hifloat8 and
  mxfp4 carried in other dtypes) are not emulated: the reference raises NotImplementedError;
* ``activation_input``, ``activation_quant_scale``, ``activation_quant_offset`` are "None
  only" in the doc and ``tuning_config`` is a tiling hint: none changes the math here.

Group modes (``group_type``): None / -1 one matmul per (x_i, w_i) pair; 0 rows of one x split
by ``group_list`` (group g times weight g: a 3-D (E, K, N) weight or a list of 2-D ones; several
x and weights with one output: the products concatenated); 2 the K axis split by
``group_list`` (one 2-D x (M, K) and one 2-D weight (K, N): y_g = x[:, k_g] @ w[k_g], as
MindSpeed computes expert weight gradients).  ``group_list`` holds cumulative ends
(``group_list_type`` 0) or group sizes (1).  ``split_item`` 0/1: one output per group, 2/3: one
tensor (groups concatenated along M, rows past the last group zero; K-split: stacked (G, M, N)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ._util import acc_dtype, fit

__all__ = ["FP8_TYPES", "SCALAR_TYPES", "activation", "dequant_weight", "group_sizes", "grouped_weights",
           "int4_unpack", "is_grouped", "npu_grouped_matmul", "out_dtype", "quant_out"]

# c10::ScalarType numbers, as the meta kernel's TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP reads
# ``output_dtype`` (torch_npu 2.14.0 _meta_registrations.py)
SCALAR_TYPES: dict[int, torch.dtype] = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64,
    5: torch.float16, 6: torch.float32, 7: torch.float64, 15: torch.bfloat16,
}
# the float8 dtype numbers an fp8 argument may carry: c10::ScalarType's (23, 24) and torch_npu's
# own codes for the same types (291, 292)
FP8_TYPES: dict[int, torch.dtype] = {23: torch.float8_e5m2, 24: torch.float8_e4m3fn,
                                     291: torch.float8_e5m2, 292: torch.float8_e4m3fn}

Tensors = Sequence[torch.Tensor]


def group_sizes(group_list: torch.Tensor, group_list_type: int | None, n_groups: int) -> list[int]:
    """Rows per group from ``group_list`` (type 0: cumulative ends; type 1: counts)."""
    values = fit(group_list.reshape(-1).long(), n_groups)
    if group_list_type == 1:
        sizes = values
    else:
        sizes = torch.diff(values, prepend=values.new_zeros(1))
    return [max(int(s), 0) for s in sizes.tolist()]


def grouped_weights(weight: Tensors) -> list[torch.Tensor]:
    """One (K, N) matrix per group: a single 3-D (E, K, N) weight or a list of 2-D ones."""
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0))
    return list(weight)


def is_grouped(x: Tensors, group_type: int | None) -> bool:
    """One x split by ``group_list`` (group_type 0 along M, 2 along K)."""
    return group_type is not None and group_type >= 0 and len(x) == 1


def _per_group(t: Tensors | None, n: int) -> list[torch.Tensor | None]:
    """A per-group list of ``n`` parameters (a list of one per group, or one tensor whose first
    axis is the group, as a single-tensor weight takes them); None where none is given."""
    if not t:
        return [None] * n
    items = list(t[0].unbind(0)) if len(t) == 1 and n > 1 and t[0].dim() >= 2 else list(t)
    return [items[i] if i < len(items) else None for i in range(n)]


def out_dtype(output_dtype: Any, x: torch.Tensor) -> torch.dtype:
    """The output dtype: ``output_dtype`` (a ScalarType number or a torch.dtype), else x's."""
    if output_dtype is None:
        return x.dtype
    if isinstance(output_dtype, torch.dtype):
        return output_dtype
    if int(output_dtype) not in SCALAR_TYPES:
        raise NotImplementedError(f"output_dtype {output_dtype} is not emulated")
    return SCALAR_TYPES[int(output_dtype)]


def int4_unpack(w: torch.Tensor) -> torch.Tensor:
    """An int32 tensor carrying 8 int4 values per element, unpacked to int8 values in [-8, 7]
    along the last axis (which grows 8x): little-endian, the low nibble first (torchair's
    ``ge.Bitcast`` to DT_INT4; the aclnn doc does not state the order)."""
    raw = w.contiguous().view(torch.uint8).to(torch.int16)  # (..., n * 4) bytes
    nib = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(*w.shape[:-1], w.size(-1) * 8)
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


def _scale_values(s: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """A scale as numbers: an int64 one is ``npu_trans_quant_param``'s packing, its low 32 bits
    read as fp32 (an assumption: the doc names the packing, not its layout)."""
    if s.dtype == torch.int64:
        low = (s & 0xFFFFFFFF).to(torch.int64)
        low = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
        return low.view(torch.float32).to(acc)
    return s.to(acc)


def dequant_weight(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                   acc: torch.dtype) -> torch.Tensor:
    """Antiquant: ``(w + offset) * scale``; scale (n,) per channel or (G, n) per group of
    ``k / G`` rows."""
    wf = (int4_unpack(w) if w.dtype == torch.int32 else w).to(acc)
    sc = scale.to(acc)
    off = offset.to(acc) if offset is not None else None
    if sc.dim() == 2 and sc.size(0) > 1:  # per group along K
        rows = wf.size(0) // sc.size(0)
        sc = sc.repeat_interleave(rows, dim=0)
        off = off.repeat_interleave(rows, dim=0) if off is not None else None
    if off is not None:
        wf = wf + off.reshape(sc.shape)
    return wf * sc


def activation(y: torch.Tensor, act_type: int | None) -> torch.Tensor:
    """``act_type``: 0 none, 1 relu, 2 gelu (tanh), 4 fast gelu, 5 silu (3: not supported)."""
    if not act_type:
        return y
    if act_type == 1:
        return torch.relu(y)
    if act_type == 2:
        return F.gelu(y, approximate="tanh")
    if act_type == 4:  # fast gelu: x * sigmoid(1.702 x)
        return y * torch.sigmoid(1.702 * y)
    if act_type == 5:
        return F.silu(y)
    raise NotImplementedError(f"npu_grouped_matmul act_type {act_type} is not supported")


def quant_out(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` in the output dtype; an int8 output is rounded half to even and saturated."""
    if dtype == torch.int8:
        return torch.round(y).clamp(-128, 127).to(torch.int8)
    if not dtype.is_floating_point:
        return torch.round(y).to(dtype)
    return y.to(dtype)


class _Math:
    """One call's per-group math: the mode is chosen by the scale arguments passed."""

    def __init__(self, x0: torch.Tensor, n_groups: int, bias: Tensors | None,
                 scale: Tensors | None, offset: Tensors | None, antiquant_scale: Tensors | None,
                 antiquant_offset: Tensors | None, per_token_scale: Tensors | None,
                 act_type: int | None, dtype: torch.dtype) -> None:
        self.acc = acc_dtype(x0) if x0.is_floating_point() else torch.float32
        self.bias = _per_group(bias, n_groups)
        self.scale = _per_group(scale, n_groups)
        self.offset = _per_group(offset, n_groups)
        self.aq_scale = _per_group(antiquant_scale, n_groups)
        self.aq_offset = _per_group(antiquant_offset, n_groups)
        self.pts = list(per_token_scale) if per_token_scale else []
        self.act_type, self.dtype = act_type, dtype

    def weight(self, g: int, w: torch.Tensor) -> torch.Tensor:
        s = self.aq_scale[g]
        if s is not None:
            return dequant_weight(w, s, self.aq_offset[g], self.acc)
        return (int4_unpack(w) if w.dtype == torch.int32 else w).to(self.acc)

    def product(self, g: int, x: torch.Tensor, w: torch.Tensor,
                token_scale: torch.Tensor | None) -> torch.Tensor:
        """Group g's ``x @ w`` with bias, scales and the activation, in fp32 (not cast yet)."""
        y = x.to(self.acc) @ self.weight(g, w)
        b = self.bias[g]
        if b is not None:
            y = y + b.to(self.acc)
        s = self.scale[g]
        if s is not None:
            y = y * _scale_values(s, self.acc)
            off = self.offset[g]
            if off is not None:
                y = y + off.to(self.acc)
        if token_scale is not None:
            y = y * token_scale.to(self.acc).reshape(-1, 1)
        return activation(y, self.act_type)

    def rows_scale(self, i: int, start: int, stop: int) -> torch.Tensor | None:
        """Per-token scales of rows [start, stop) of x_i."""
        if i >= len(self.pts):
            return None
        return self.pts[i].reshape(-1)[start:stop]


def npu_grouped_matmul(
    x: Tensors,
    weight: Tensors,
    *,
    bias: Tensors | None = None,
    scale: Tensors | None = None,
    offset: Tensors | None = None,
    antiquant_scale: Tensors | None = None,
    antiquant_offset: Tensors | None = None,
    per_token_scale: Tensors | None = None,
    group_list: torch.Tensor | Sequence[int] | None = None,
    activation_input: Tensors | None = None,
    activation_quant_scale: Tensors | None = None,
    activation_quant_offset: Tensors | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: Sequence[int] | None = None,
    output_dtype: Any = None,
    x_dtype: int | None = None,
    weight_dtype: int | None = None,
    scale_dtype: int | None = None,
    per_token_scale_dtype: int | None = None,
) -> list[torch.Tensor]:
    """aclnnGroupedMatmulV4 (see the module docstring for every mode)."""
    if any(v is not None for v in (x_dtype, weight_dtype, scale_dtype, per_token_scale_dtype)):
        raise NotImplementedError("npu_grouped_matmul: hifloat8 / mxfp4 inputs (x_dtype, "
                                  "weight_dtype, scale_dtype, per_token_scale_dtype) are not "
                                  "emulated")
    if group_list is not None and not isinstance(group_list, torch.Tensor):
        group_list = torch.tensor(list(group_list), dtype=torch.int64)
    ws = grouped_weights(weight)
    dtype = out_dtype(output_dtype, x[0])
    single = split_item in (2, 3)
    if is_grouped(x, group_type) and group_type == 2:
        return _k_split(x[0], ws, group_list, group_list_type, single, dtype, bias, scale,
                        offset, antiquant_scale, antiquant_offset, per_token_scale, act_type)
    if is_grouped(x, group_type):
        if group_type != 0:
            raise NotImplementedError(f"npu_grouped_matmul group_type {group_type} (the doc: "
                                      "not supported)")
        xs = x[0]
        m = _Math(xs, len(ws), bias, scale, offset, antiquant_scale, antiquant_offset,
                  per_token_scale, act_type, dtype)
        if group_list is None:
            sizes = [xs.size(0)] + [0] * (len(ws) - 1)
        else:
            sizes = group_sizes(group_list, group_list_type, len(ws))
        outs: list[torch.Tensor] = []
        start = 0
        for g, w in enumerate(ws):
            stop = min(start + sizes[g], xs.size(0))
            y = m.product(g, xs[start:stop], w, m.rows_scale(0, start, stop))
            outs.append(quant_out(y, dtype))
            start = stop
        if single:
            n_out = outs[0].size(-1) if outs else 0
            tail = torch.zeros((xs.size(0) - start, n_out), dtype=dtype, device=xs.device)
            return [torch.cat([*outs, tail], 0)]
        return outs
    m = _Math(x[0], len(x), bias, scale, offset, antiquant_scale, antiquant_offset,
              per_token_scale, act_type, dtype)
    outs = []
    for i, xi in enumerate(x):
        flat = xi.reshape(-1, xi.size(-1))
        y = m.product(i, flat, ws[i], m.rows_scale(i, 0, flat.size(0)))
        outs.append(quant_out(y, dtype).reshape(*xi.shape[:-1], y.size(-1)))
    if single:
        return [torch.cat([o.reshape(-1, o.size(-1)) for o in outs], 0)]
    return outs


def _k_split(x: torch.Tensor, ws: list[torch.Tensor], group_list: torch.Tensor | None,
             group_list_type: int | None, single: bool, dtype: torch.dtype,
             bias: Tensors | None, scale: Tensors | None, offset: Tensors | None,
             antiquant_scale: Tensors | None, antiquant_offset: Tensors | None,
             per_token_scale: Tensors | None, act_type: int | None) -> list[torch.Tensor]:
    """group_type 2: x (M, K) and w (K, N) split along K; y_g = x[:, k_g] @ w[k_g]."""
    w = ws[0] if len(ws) == 1 else torch.cat(ws, 0)
    n_groups = group_list.numel() if group_list is not None else 1
    sizes = group_sizes(group_list, group_list_type, n_groups) if group_list is not None \
        else [x.size(1)]
    m = _Math(x, n_groups, bias, scale, offset, antiquant_scale, antiquant_offset,
              per_token_scale, act_type, dtype)
    outs: list[torch.Tensor] = []
    start = 0
    for g in range(n_groups):
        stop = min(start + sizes[g], x.size(1))
        y = m.product(g, x[:, start:stop], w[start:stop], m.rows_scale(0, 0, x.size(0)))
        outs.append(quant_out(y, dtype))
        start = stop
    if single:
        return [torch.stack(outs, 0)]
    return outs
