"""References of the norm / activation / rotary / loss / quantisation family: the
forward of each op in plain PyTorch, its example builder, and one ``Reference`` entry per op in
``REFERENCES`` (``_table`` appends them).

Sources, per op (the contracts in ``contracts/torch_npu/norm_rotary.toml``, ``loss.toml`` and
``quant.toml`` cite the same):

* ``npu_add_rms_norm``: CANN ``aclnnAddRmsNorm`` (x = x1 + x2, y = RmsNorm(x) * gamma; rstd and
  x are outputs too); the torch_npu wheels carry no docstring for it;
* ``npu_swiglu_backward``: the gradient of ``npu_swiglu`` (op-plugin ``derivatives.yaml``:
  ``npu_swiglu``'s backward is ``npu_swiglu_backward(grad, self, dim)``);
* ``npu_clipped_swiglu``, ``npu_apply_rotary_pos_emb``, ``npu_mrope``, ``npu_cross_entropy_loss``,
  ``npu_dynamic_quant``, ``npu_dynamic_quant_asymmetric``, ``npu_quant_matmul``,
  ``npu_dynamic_mx_quant``,
  ``npu_dequant_swiglu_quant``: torch_npu 2.14.0 ``_op_plugin_docs.py`` (formulas) and
  ``_meta_registrations.py`` (output shapes and dtypes);
* ``npu_cross_entropy_loss_backward``: op-plugin ``derivatives.yaml`` (``input:
  npu_cross_entropy_loss_backward(grads[0], result1, target, weight, grads[1], result3, ...)``).

Floating math runs in fp32 (fp64 for fp64 inputs) like the other references, except in the
quantising ops: they compute in fp32 whatever they are given (the kernels do, and a
quantisation decision taken in fp64 on the shadow compare's up-cast copies could round the
other way and differ by one step from the kernel's).  Integer arguments that may hold garbage
(positions, targets, group indices of a misread tensor) are clamped, never raised on.

Readings where the docs leave something open (each named in the contract's ``doc`` too):
rows a ``group_index`` does not cover are zero (the docs: not written, garbage); rounding is
half-to-even (``torch.round``); ``npu_dynamic_mx_quant`` packs two FP4 codes
per byte low nibble first, as OCP MX (scale_alg 0) with ``round_mode='rint'``.  Modes the
emulation does not compute raise ``NotImplementedError`` naming the mode: int4-packed int32
and int32-output ``npu_quant_matmul``, its fp8 / fp4 / hifloat8 modes (``x1_dtype`` ...),
``npu_dynamic_quant``'s hifloat8 output, the FP4 E1M2 output and ``scale_alg`` 1 / 2 of
``npu_dynamic_mx_quant``, the ``quarter`` rotary mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ._entry import Reference
from ._grads import swiglu_backward as _swiglu_grad_formula
from ._norm import npu_swiglu, rms_norm_dims, rotated
from ._util import acc_dtype, safe_index

__all__ = ["REFERENCES"]

_F32 = torch.float32
Example = tuple[tuple[Any, ...], dict[str, Any]]
_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"
_DERIV = "op-plugin op_plugin/config/derivatives.yaml"

# ScalarType numbers the dispatcher hands an ``int`` dtype argument (``torch.int8`` -> 1)
_ST_INT8, _ST_INT32, _ST_FP16, _ST_BF16, _ST_QUINT4X2 = 1, 3, 5, 15, 16
_ST_FP8_E5M2, _ST_FP8_E4M3 = 23, 24
# torch_npu's own dtype numbers (torch_npu.float8_e5m2 = 291, ...; npu_dynamic_mx_quant's doc)
_NPU_FP8_E5M2, _NPU_FP8_E4M3, _NPU_FP4_E2M1, _NPU_FP4_E1M2 = 291, 292, 296, 297


# --------------------------------------------------------------------------- shared helpers
def _halves(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    size = x.size(dim)
    return x.narrow(dim, 0, size // 2), x.narrow(dim, size // 2, size - size // 2)


def _group_of_rows(n_rows: int, ends: torch.Tensor) -> torch.Tensor:
    """Row r belongs to group i when ``ends[i-1] <= r < ends[i]`` (cumulative ends): the number
    of ends at or below r.  Rows past the last end get ``len(ends)`` (no group).  Garbage ends
    (a misread tensor) give some assignment, never an error."""
    row = torch.arange(n_rows, device=ends.device)
    return (row.unsqueeze(1) >= ends.reshape(1, -1).long()).sum(1)


def _rows_of(table: torch.Tensor, group: torch.Tensor | None, n_rows: int) -> torch.Tensor:
    """Per row, the row of ``table`` ([G, H]) its group selects (zeros for rows in no group);
    without groups, ``table``'s only row (or ``table`` itself when it is 1-D)."""
    t = table.to(_F32)
    if t.dim() == 1:
        return t.unsqueeze(0).expand(n_rows, -1)
    if group is None:
        return t[:1].expand(n_rows, -1)
    idx, valid = safe_index(group, t.size(0))
    return t.index_select(0, idx) * valid.unsqueeze(1).to(_F32)


def _example_floats(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16
                    ) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: exact in bf16, fp16, fp32 and fp64."""
    return (torch.randint(-16, 17, shape, generator=gen) / 8).to(dtype)


def _example_scales(gen: torch.Generator, *shape: int, dtype: torch.dtype = _F32
                    ) -> torch.Tensor:
    """Multiples of 1/16 in (0, 1]."""
    return (torch.randint(1, 17, shape, generator=gen) / 16).to(dtype)


# --------------------------------------------------------------------------- add_rms_norm
def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CANN aclnnAddRmsNorm: ``x = x1 + x2``; ``y = x * rstd * gamma`` with ``rstd = 1 /
    sqrt(mean(x^2) + eps)`` over gamma's (trailing) dims.  Returns (y, rstd, x); y and x in
    x1's dtype, rstd fp32 (the meta kernel), its normalised dims of size 1."""
    acc = acc_dtype(x1)
    x = x1.to(acc) + x2.to(acc)
    rstd = torch.rsqrt(x.pow(2).mean(dim=rms_norm_dims(gamma), keepdim=True) + epsilon)
    y = x * rstd * gamma.to(acc)
    return y.to(x1.dtype), rstd if acc == torch.float64 else rstd.to(_F32), x.to(x1.dtype)


def _add_rms_norm_example(gen: torch.Generator) -> Example:
    return (_example_floats(gen, 4, 8), _example_floats(gen, 4, 8), _example_floats(gen, 8)), {}


# --------------------------------------------------------------------------- swiglu backward
def npu_swiglu_backward(grad_output: torch.Tensor, self: torch.Tensor, dim: int = -1
                        ) -> torch.Tensor:
    """The gradient of ``npu_swiglu`` (``silu(a) * b``, ``a, b`` the halves of ``self`` along
    ``dim``) for the incoming ``grad_output``: the composite formula of ``_grads``."""
    return _swiglu_grad_formula({"self": self, "dim": dim}, None, grad_output)["self"]


def _swiglu_backward_example(gen: torch.Generator) -> Example:
    return (_example_floats(gen, 4, 8), _example_floats(gen, 4, 16), -1), {}


# --------------------------------------------------------------------------- clipped swiglu
def npu_clipped_swiglu(x: torch.Tensor, *, group_index: torch.Tensor | None = None,
                       dim: int = -1, alpha: float = 1.702, limit: float = 7.0,
                       bias: float = 1.0, interleaved: bool = True) -> torch.Tensor:
    """torch_npu 2.14.0 doc: x merged to [pre, cut*after] around ``dim``; the first
    ``sum(group_index)`` rows kept (the rest: zero here, not written by the kernel); A, B the
    even/odd (``interleaved``) or front/back halves; ``A = A.clamp(max=limit)``, ``B =
    B.clamp(-limit, limit)``; ``y = A * sigmoid(alpha * A) * (B + bias)``; y has ``dim`` halved."""
    d = dim % x.dim()
    pre = math.prod(x.shape[:d])
    acc = acc_dtype(x)
    flat = x.to(acc).reshape(pre, -1)
    if interleaved:
        a, b = flat[:, 0::2], flat[:, 1::2]
    else:
        a, b = _halves(flat, 1)
    a = a.clamp(max=limit)
    b = b.clamp(min=-limit, max=limit)
    y = a * torch.sigmoid(alpha * a) * (b + bias)
    if group_index is not None:
        total = group_index.reshape(-1).long().sum().clamp(0, pre)
        y = y * (torch.arange(pre, device=y.device) < total).unsqueeze(1).to(acc)
    shape = list(x.shape)
    shape[d] //= 2
    return y.reshape(shape).to(x.dtype)


def _clipped_swiglu_example(gen: torch.Generator) -> Example:
    # gates (even columns) in [-4, 10], up halves in [-10, 10]: both clamps act, and no output
    # is so small that fp16 holds it as a subnormal
    x = (torch.randint(-80, 81, (6, 16), generator=gen) / 8)
    x[:, 0::2] = (torch.randint(-32, 81, (6, 8), generator=gen) / 8)
    return (x.to(torch.bfloat16),), {"group_index": torch.tensor([2, 3], dtype=torch.int64), "limit": 7.0}


# --------------------------------------------------------------------------- rotary
def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    """``t * cos + rotated(t) * sin`` on t's first ``cos.size(-1)`` features (the rest pass
    through), cos/sin broadcast (their head axis is 1)."""
    acc = acc_dtype(t)
    tf = t.to(acc)
    d = cos.size(-1)
    rot, rest = tf[..., :d], tf[..., d:]
    out = rot * cos.to(acc) + rotated(rot, mode) * sin.to(acc)
    return torch.cat([out, rest], dim=-1).to(t.dtype)


def npu_apply_rotary_pos_emb(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, layout: str = "BSND", rotary_mode: str = "half"
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu 2.14.0 doc: rotary embedding of query and key with one cos/sin (head axis 1:
    (B, S, 1, D) in BSND, (T, 1, D) in TND).  The kernel updates query and key in place and
    returns them; the reference returns new tensors (the schema declares no aliasing)."""
    if layout not in ("BSND", "SBND", "BNSD", "TND"):
        raise ValueError(f"npu_apply_rotary_pos_emb: unknown layout {layout!r}")
    return _rope(query, cos, sin, rotary_mode), _rope(key, cos, sin, rotary_mode)


def _apply_rotary_example(gen: torch.Generator) -> Example:
    b, s, d = 1, 4, 64  # the head size the A2/A3 kernels take: 64 or 128
    return (_example_floats(gen, b, s, 2, d), _example_floats(gen, b, s, 1, d),
            _example_floats(gen, b, s, 1, d), _example_floats(gen, b, s, 1, d)), {}


def npu_mrope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
              cos_sin_cache: torch.Tensor, head_size: int, *,
              mrope_section: Sequence[int] | None = None, rotary_mode: str | None = "half",
              cache_mode: str | None = "default") -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu 2.14.0 doc (vLLM's rope / mrope): cos and sin are the two halves of each row
    of ``cos_sin_cache`` (maxSeqLen, rotaryDim) looked up at ``positions``: (T,) is rope, (3, T)
    mrope, whose three rows (temporal, height, width) share the rotaryDim/2 frequencies by
    ``mrope_section``.  ``cache_mode`` (the doc: how cos and sin are put together) says how:
    ``'default'`` in three consecutive sections, ``'interleave'`` frequency by frequency
    (``_mrope_rows``); it changes nothing in rope mode.  Each head's first rotaryDim features of
    query / key ((T, heads*head_size)) are rotated neox style for ``'half'``, gpt-j style
    otherwise (op-plugin's glue hands the kernel ``is_neox_style = rotary_mode == "half"``).
    Positions past the cache read zeros."""
    rd = cos_sin_cache.size(-1)
    acc = acc_dtype(query)
    cache = cos_sin_cache.to(acc)
    idx, valid = safe_index(positions, cache.size(0))
    cs = (cache.index_select(0, idx) * valid.unsqueeze(1).to(acc)).view(*positions.shape, rd)
    cos, sin = cs[..., : rd // 2], cs[..., rd // 2:]
    if positions.dim() == 2:  # (3, T, rd/2): each frequency from its row
        rows = _mrope_rows(list(mrope_section or [0, 0, 0]), rd // 2, cache_mode == "interleave")
        pick = rows.to(cs.device).view(1, 1, -1).expand(1, *cos.shape[1:])
        cos, sin = cos.gather(0, pick)[0], sin.gather(0, pick)[0]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (T, 1, rd/2): every head

    def rotate(t: torch.Tensor) -> torch.Tensor:
        tf = t.to(acc).view(t.size(0), -1, head_size)
        rot, rest = tf[..., :rd], tf[..., rd:]
        if rotary_mode == "half":
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1).reshape(t.shape).to(t.dtype)

    return rotate(query), rotate(key)


def _mrope_rows(sections: list[int], half: int, interleave: bool) -> torch.Tensor:
    """Which position row (0 temporal, 1 height, 2 width) gives each of the ``half`` = rotaryDim/2
    frequencies of mrope.  Three sections (``cache_mode='default'``): the first ``sections[0]``
    from row 0, the next ``sections[1]`` from row 1, the last ``sections[2]`` from row 2.
    Interleaved (``'interleave'``, the multimodal rope of Qwen3-VL): frequencies cycle through
    the rows, j % 3 == 1 from row 1 while j < 3 * sections[1], j % 3 == 2 from row 2 while
    j < 3 * sections[2], every other from row 0."""
    if len(sections) != 3 or sum(sections) != half:
        raise ValueError(f"npu_mrope: mrope_section {sections} must be three numbers summing to "
                         f"rotary_dim/2 = {half}")
    if not interleave:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
    j = torch.arange(half)
    rows = torch.zeros(half, dtype=torch.long)
    rows[(j % 3 == 1) & (j < 3 * sections[1])] = 1
    rows[(j % 3 == 2) & (j < 3 * sections[2])] = 2
    return rows


def _mrope_example(gen: torch.Generator) -> Example:
    t, hs, max_seq = 4, 16, 8
    positions = torch.stack([torch.randperm(max_seq, generator=gen)[:t] for _ in range(3)])
    return (positions, _example_floats(gen, t, 2 * hs), _example_floats(gen, t, hs),
            _example_floats(gen, max_seq, hs), hs), {"mrope_section": [2, 3, 3]}


# --------------------------------------------------------------------------- cross entropy
def _ce_coefficients(target: torch.Tensor, weight: torch.Tensor | None, n_cls: int,
                     reduction: str, ignore_index: int, label_smoothing: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """``A`` (N, C) with ``loss_i = -sum_c A[i, c] * log_prob[i, c]`` (summed for 'sum' and
    'mean'; 'mean' divides by the weights of the counted targets, as PyTorch's
    ``cross_entropy`` does with label smoothing).  ``ignore_index`` below 0 ignores nothing
    (the doc); a target outside [0, C) counts nothing (a kernel reading garbage)."""
    t, valid = safe_index(target, n_cls)
    if 0 <= ignore_index < n_cls:
        valid = valid & (target.reshape(-1) != ignore_index)
    # weight takes no gradient (torch_npu's derivative is for input only)
    w = weight.detach().to(dtype).reshape(-1) if weight is not None else torch.ones(
        n_cls, dtype=dtype, device=target.device)
    keep = valid.to(dtype)
    wt = w.index_select(0, t) * keep
    coeff = (1.0 - label_smoothing) * F.one_hot(t, n_cls).to(dtype) * wt.unsqueeze(1)
    if label_smoothing:
        coeff = coeff + (label_smoothing / n_cls) * w.unsqueeze(0) * keep.unsqueeze(1)
    if reduction == "mean":
        coeff = coeff / wt.sum()
    return coeff


def npu_cross_entropy_loss(input: torch.Tensor, target: torch.Tensor,
                           weight: torch.Tensor | None = None, reduction: str = "mean",
                           ignore_index: int = -100, label_smoothing: float = 0.0,
                           lse_square_scale_for_zloss: float = 0.0, return_zloss: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_npu 2.14.0 doc: log_softmax and nll_loss fused, with ``weight``,
    ``ignore_index`` and ``label_smoothing``.  Returns (loss, log_prob, zloss, lse_for_zloss):
    loss [N] for 'none', else [1]; log_prob (N, C), the backward's input (no gradient, as
    torch_npu's derivative marks it); zloss and lse_for_zloss (not supported yet, the doc) are
    zeros of the meta kernel's shapes.  All in input's dtype."""
    acc = acc_dtype(input)
    logp = torch.log_softmax(input.to(acc), dim=-1)
    coeff = _ce_coefficients(target, weight, input.size(-1), reduction, ignore_index,
                             label_smoothing, acc)
    per_row = -(coeff * logp).sum(-1)
    loss = per_row if reduction == "none" else per_row.sum().reshape(1)
    n = input.size(0)
    zloss = input.new_zeros(loss.shape)
    return (loss.to(input.dtype), logp.detach().to(input.dtype), zloss,
            input.new_zeros((n,)))


def _cross_entropy_example(gen: torch.Generator) -> Example:
    n, c = 4, 8
    # 'sum' with class weights: a call the doc allows in training (in 'mean' mode it allows
    # no argument off its default while the input requires grad)
    return (_example_floats(gen, n, c), torch.randint(0, c, (n,), generator=gen),
            _example_scales(gen, c)), {"reduction": "sum"}


def npu_cross_entropy_loss_backward(
        grad_loss: torch.Tensor, log_prob: torch.Tensor, target: torch.Tensor,
        weight: torch.Tensor | None = None, grad_zloss: torch.Tensor | None = None,
        lse_for_zloss: torch.Tensor | None = None, reduction: str = "mean",
        ignore_index: int = -100, label_smoothing: float = 0.0,
        lse_square_scale_for_zloss: float = 0.0) -> torch.Tensor:
    """The gradient of ``npu_cross_entropy_loss``'s loss with respect to its input, from the
    saved log_prob: ``g = -A * grad_loss``, ``grad_input = g - softmax * sum(g)`` (zloss is not
    supported, so ``grad_zloss`` / ``lse_for_zloss`` add nothing)."""
    acc = acc_dtype(log_prob)
    lp = log_prob.to(acc)
    coeff = _ce_coefficients(target, weight, lp.size(-1), reduction, ignore_index,
                             label_smoothing, acc)
    g = grad_loss.to(acc)
    g = g.reshape(-1, 1) if reduction == "none" else g.reshape(-1)[:1].reshape(1, 1)
    g_logp = -coeff * g
    return (g_logp - lp.exp() * g_logp.sum(-1, keepdim=True)).to(log_prob.dtype)


def _cross_entropy_backward_example(gen: torch.Generator) -> Example:
    (x, target, weight), kwargs = _cross_entropy_example(gen)
    _, log_prob, _, lse = npu_cross_entropy_loss(x, target, weight, **kwargs)
    return (torch.ones(1, dtype=x.dtype), log_prob, target, weight), {
        "lse_for_zloss": lse, **kwargs}


# --------------------------------------------------------------------------- quantisation
def _quantize_int(v: torch.Tensor, scale: torch.Tensor, qmax: float) -> torch.Tensor:
    """``round(v / scale)`` clamped to [-qmax-1, qmax]; 0 where the scale is 0."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(v / safe) * (scale != 0).to(v.dtype)
    return q.clamp(-qmax - 1, qmax)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Eight int4 values per int32 along the last axis, the first in the lowest bits."""
    nib = (q.to(torch.int64) & 0xF).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    packed = (nib << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def npu_dynamic_quant(input: torch.Tensor, *,
                      smooth_scales: torch.Tensor | None = None,
                      group_index: torch.Tensor | None = None, dst_type: int | None = None,
                      quant_mode: str = "pertoken", dst_type_max: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu 2.14.0 doc: symmetric dynamic quantisation ``scale = max|x * smooth| /
    DTYPE_MAX`` per token (row), ``y = round(x * smooth / scale)``; with ``group_index``
    (cumulative row ends, MoE) row r takes the smooth row of its group.  int8 (default) or
    quint4x2 (eight int4 per int32, last axis / 8); fp8 E4M3 / E5M2 (cast, saturated);
    ``quant_mode`` 'pertoken' (scale x.shape[:-1]), 'pertensor' ([1]), 'perchannel' (the meta
    kernel's x.shape[:-2] + [H])."""
    x = _smoothed(input, smooth_scales, group_index)
    dst = _ST_INT8 if dst_type is None else dst_type
    limits = {_ST_INT8: 127.0, _ST_QUINT4X2: 7.0, _ST_FP8_E4M3: 448.0, _ST_FP8_E5M2: 57344.0}
    if dst not in limits:
        raise NotImplementedError(f"npu_dynamic_quant: dst_type {dst} (torch_npu's hifloat8 "
                                  "or another type) is not emulated")
    qmax = dst_type_max if dst_type_max and dst in (_ST_FP8_E4M3, _ST_FP8_E5M2) else limits[dst]
    if quant_mode == "pertensor":
        amax = x.abs().amax().reshape(1)
        scale_b = amax.reshape([1] * x.dim())
    elif quant_mode == "perchannel":
        amax = x.abs().amax(dim=-2)
        scale_b = amax.unsqueeze(-2)
    elif quant_mode == "pertoken":
        amax = x.abs().amax(dim=-1)
        scale_b = amax.unsqueeze(-1)
    else:
        raise ValueError(f"npu_dynamic_quant: unknown quant_mode {quant_mode!r}")
    scale = amax / qmax
    sb = scale_b / qmax
    if dst in (_ST_FP8_E4M3, _ST_FP8_E5M2):
        safe = torch.where(sb == 0, torch.ones_like(sb), sb)
        y = (x / safe).clamp(-qmax, qmax).to(
            torch.float8_e4m3fn if dst == _ST_FP8_E4M3 else torch.float8_e5m2)
        return y, scale
    q = _quantize_int(x, sb, qmax)
    if dst == _ST_QUINT4X2:
        return _pack_int4(q), scale
    return q.to(torch.int8), scale


def _smoothed(input: torch.Tensor, smooth_scales: torch.Tensor | None,
              group_index: torch.Tensor | None) -> torch.Tensor:
    """``input`` in fp32 times its smooth scales (the dynamic quantisations' ``smooth quant``):
    one (H,) row for every token, or with ``group_index`` (cumulative row ends, MoE) the row of
    each token's group."""
    x = input.to(_F32)
    if smooth_scales is None:
        return x
    rows = x.reshape(-1, x.size(-1))
    group = None
    if group_index is not None and smooth_scales.dim() == 2:
        group = _group_of_rows(rows.size(0), group_index)
    return (rows * _rows_of(smooth_scales, group, rows.size(0))).reshape(x.shape)


def npu_dynamic_quant_asymmetric(input: torch.Tensor, *,
                                 smooth_scales: torch.Tensor | None = None,
                                 group_index: torch.Tensor | None = None,
                                 dst_type: int | None = None, quant_mode: str = "pertoken",
                                 dst_type_max: float = 0.0
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_npu 2.14.0 doc: asymmetric dynamic quantisation per token (row), after the smooth
    scales as ``npu_dynamic_quant``: ``scale = (rowMax - rowMin) / (DST_MAX - DST_MIN)``,
    ``offset = DST_MAX - rowMax / scale``, ``y = round(x / scale + offset)``; int8 (127 / -128,
    the default) or quint4x2 (7 / -8, eight int4 per int32, the first in the lowest bits).
    ``quant_mode='perchannel'`` (the schema's and the meta kernel's, not the doc's; op-plugin's
    test, an Ascend 950 case): per column, over axis -2, the smooth scales one per row of axis
    -2; 'pertensor' over everything.  A row whose max equals its min (scale 0) quantises to 0,
    its offset as the formula gives (no doc says)."""
    dst = _ST_INT8 if dst_type is None else dst_type
    limits = {_ST_INT8: (127.0, -128.0), _ST_QUINT4X2: (7.0, -8.0)}
    if dst not in limits:
        raise NotImplementedError(f"npu_dynamic_quant_asymmetric: dst_type {dst} (an fp8 or "
                                  "hifloat8 output, Ascend 950) is not emulated")
    hi, lo = limits[dst]
    if quant_mode == "perchannel":
        x = input.to(_F32)
        if smooth_scales is not None:
            x = x * smooth_scales.to(_F32).reshape(-1, 1)
        mx, mn = x.amax(dim=-2), x.amin(dim=-2)
        axis: int | None = -2
    elif quant_mode in ("pertoken", "pertensor"):
        x = _smoothed(input, smooth_scales, group_index)
        if quant_mode == "pertensor":
            mx, mn, axis = x.amax().reshape(1), x.amin().reshape(1), None
        else:
            mx, mn, axis = x.amax(dim=-1), x.amin(dim=-1), -1
    else:
        raise ValueError(f"npu_dynamic_quant_asymmetric: unknown quant_mode {quant_mode!r}")
    scale = (mx - mn) / (hi - lo)
    offset = hi - mx / scale

    def spread(t: torch.Tensor) -> torch.Tensor:  # back over the axis reduced
        return t.reshape([1] * x.dim()) if axis is None else t.unsqueeze(axis)

    s = spread(scale)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = (torch.round(x / safe + spread(offset)) * (s != 0).to(_F32)).clamp(lo, hi)
    if dst == _ST_QUINT4X2:
        return _pack_int4(q), scale, offset
    return q.to(torch.int8), scale, offset


def _dynamic_quant_asymmetric_example(gen: torch.Generator) -> Example:
    n, h = 6, 16
    return (_example_floats(gen, n, h),), {
        "smooth_scales": _example_scales(gen, 3, h, dtype=torch.bfloat16),
        "group_index": torch.tensor([1, 3, 6], dtype=torch.int32)}


def _dynamic_quant_example(gen: torch.Generator) -> Example:
    n, h = 6, 8
    return (_example_floats(gen, n, h),), {
        "smooth_scales": _example_scales(gen, 3, h, dtype=torch.bfloat16),
        "group_index": torch.tensor([1, 3, 6], dtype=torch.int32)}


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """The float scale: an int64 one (``npu_trans_quant_param``'s) carries the fp32 bits in its
    low 32 bits."""
    if scale.dtype == torch.int64:
        low = scale & 0xFFFFFFFF
        return torch.where(low >= 2**31, low - 2**32, low).to(torch.int32).view(_F32)
    return scale.to(_F32)


def _npu_dtype_name(value: int | None) -> str:
    return {None: "None", _ST_INT8: "int8", _ST_FP16: "float16", _ST_BF16: "bfloat16",
            _ST_INT32: "int32"}.get(value, str(value))


def _int4_unpacked(t: torch.Tensor, axis: int) -> torch.Tensor:
    """int32 holding eight int4 each (the first in the lowest bits) -> int64 values in
    [-8, 7], ``axis`` eight times longer."""
    moved = t.movedim(axis, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=t.device, dtype=torch.int64)
    nib = (moved.unsqueeze(-1) >> shifts) & 0xF
    values = torch.where(nib >= 8, nib - 16, nib).flatten(-2)
    return values.movedim(-1, axis)


def _packed_axis(x2: torch.Tensor) -> int:
    """The axis x2's int4 values are packed along (the doc): (k, n // 8) contiguous -> the last;
    (k // 8, n), the transpose of a contiguous (n, k // 8) -> the one before."""
    if x2.dim() >= 2 and x2.stride(-2) == 1 and x2.stride(-1) != 1 and x2.size(-2) > 1:
        return -2
    return -1


def npu_quant_matmul(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *,
                     offset: torch.Tensor | None = None,
                     pertoken_scale: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, output_dtype: int | None = None,
                     x1_dtype: int | None = None, x2_dtype: int | None = None,
                     pertoken_scale_dtype: int | None = None, scale_dtype: int | None = None,
                     group_sizes: Sequence[int] | None = None,
                     y_scale: torch.Tensor | None = None) -> torch.Tensor:
    """torch_npu 2.14.0 doc (int8 modes, and A4W4: int32 x1 (m, k // 8) and x2 (k, n // 8), or
    x2 (k // 8, n) transposed from a contiguous (n, k // 8), eight int4 per int32, the first in
    the lowest bits): ``acc = x1 @ x2`` (batched, broadcast) in exact integer arithmetic; an int32 bias is added to acc; ``y = acc * scale [* pertoken_scale]``
    (per output column / per row), a floating bias added after, ``offset`` added for int8
    output; int8 output rounded and saturated, fp16 / bf16 cast."""
    extra = {"x1_dtype": x1_dtype, "x2_dtype": x2_dtype, "scale_dtype": scale_dtype,
             "pertoken_scale_dtype": pertoken_scale_dtype, "group_sizes": group_sizes,
             "y_scale": y_scale}
    given = [k for k, v in extra.items() if v is not None]
    if given:
        raise NotImplementedError(f"npu_quant_matmul: the modes chosen by {', '.join(given)} "
                                  "(fp8 / fp4 / hifloat8 / mx / A8W4) are not emulated")
    if (x1.dtype == torch.int32) != (x2.dtype == torch.int32):
        raise NotImplementedError("npu_quant_matmul: one int32 (int4-packed) input with an int8 "
                                  "one is not a mode of the doc")
    if x1.dtype == torch.int32:  # A4W4: eight int4 per int32
        x1, x2 = _int4_unpacked(x1, -1), _int4_unpacked(x2, _packed_axis(x2))
    if output_dtype not in (None, _ST_INT8, _ST_FP16, _ST_BF16):
        raise NotImplementedError(f"npu_quant_matmul: output_dtype "
                                  f"{_npu_dtype_name(output_dtype)} is not emulated")
    acc = torch.matmul(x1.to(torch.float64), x2.to(torch.float64))
    if bias is not None and not bias.is_floating_point():
        acc = acc + bias.to(torch.float64)
    y = acc.to(_F32) * _scale_values(scale)
    if pertoken_scale is not None:
        y = y * pertoken_scale.to(_F32).reshape(-1, 1)
    if bias is not None and bias.is_floating_point():
        y = y + bias.to(_F32)
    if output_dtype in (None, _ST_INT8):
        if offset is not None:
            y = y + offset.to(_F32)
        return torch.round(y).clamp(-128, 127).to(torch.int8)
    return y.to(torch.float16 if output_dtype == _ST_FP16 else torch.bfloat16)


def _quant_matmul_example(gen: torch.Generator) -> Example:
    m, k, n = 4, 8, 6
    return (torch.randint(-5, 6, (m, k), generator=gen, dtype=torch.int8),
            torch.randint(-5, 6, (k, n), generator=gen, dtype=torch.int8),
            _example_scales(gen, n)), {
        "offset": (torch.randint(-8, 9, (n,), generator=gen) / 4).to(_F32),
        "bias": torch.randint(-20, 21, (n,), generator=gen, dtype=torch.int32)}


# FP4 E2M1 magnitudes, in code order (the code is the index)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_EMAX = {_NPU_FP8_E5M2: 15, _NPU_FP8_E4M3: 8, _NPU_FP4_E2M1: 2}
_ELEM_MAX = {_NPU_FP8_E5M2: 57344.0, _NPU_FP8_E4M3: 448.0, _NPU_FP4_E2M1: 6.0}


def _fp4_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even code, as 'rint'); 4-bit codes
    (sign in bit 3)."""
    mags = torch.tensor(_E2M1, dtype=v.dtype, device=v.device)
    a = v.abs().clamp(max=6.0)
    dist = (a.unsqueeze(-1) - mags).abs()
    lower = dist.argmin(-1)
    upper = (lower + 1).clamp(max=7)
    tie = dist.gather(-1, upper.unsqueeze(-1)).squeeze(-1) == dist.gather(
        -1, lower.unsqueeze(-1)).squeeze(-1)
    code = torch.where(tie & (upper != lower) & (lower % 2 == 1), upper, lower)
    return code | ((v < 0) & (code != 0)).to(code.dtype) << 3


def npu_dynamic_mx_quant(input: torch.Tensor, *,
                         axis: int = -1, round_mode: str = "rint", dst_type: int = 296,
                         block_size: int = 32, scale_alg: int | None = 0,
                         dst_type_max: float = 0.0, max_low_bound: float = 0.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu 2.14.0 doc, OCP MX (scale_alg 0): per block of ``block_size`` along
    ``axis``, ``mxscale = 2^(floor(log2(amax)) - emax)`` (emax of the element type: E4M3 8,
    E5M2 15, E2M1 2) as an E8M0 byte (exponent + 127, uint8); ``y = x / mxscale`` cast
    (saturated) to FP8, or to FP4 E2M1 packed two per uint8 (last axis halved).  mxscale's
    shape is the meta kernel's: the block axis padded to even and halved, a trailing 2 (pairs
    of block scales; along a non-last axis two rows interleaved)."""
    if dst_type not in _EMAX:
        raise NotImplementedError(f"npu_dynamic_mx_quant: dst_type {dst_type} (FP4 E1M2 or "
                                  "another type) is not emulated")
    if (scale_alg or 0) != 0 or round_mode != "rint" or dst_type_max:
        raise NotImplementedError("npu_dynamic_mx_quant: only scale_alg 0, round_mode 'rint' "
                                  "and dst_type_max 0 are emulated")
    nd = input.dim()
    ax = axis % nd
    x = input.to(_F32).movedim(ax, -1)
    n = x.size(-1)
    nb = -(-n // block_size)
    blocks = F.pad(x, (0, nb * block_size - n)).unflatten(-1, (nb, block_size))
    amax = blocks.abs().amax(-1)
    exp = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax))))
    shared = torch.where(amax > 0, exp - _EMAX[dst_type], torch.full_like(amax, -127.0))
    shared = shared.clamp(-127, 127)
    elem = (blocks / torch.exp2(shared).unsqueeze(-1)).clamp(-_ELEM_MAX[dst_type],
                                                              _ELEM_MAX[dst_type])
    elem = elem.flatten(-2)[..., :n].movedim(-1, ax)
    if dst_type == _NPU_FP4_E2M1:
        codes = _fp4_e2m1_codes(elem).to(torch.uint8)
        y = codes[..., 0::2] | (codes[..., 1::2] << 4)
    else:
        y = elem.to(torch.float8_e5m2 if dst_type == _NPU_FP8_E5M2 else torch.float8_e4m3fn)
    e8m0 = (shared + 127).to(torch.uint8)                       # (..., nb) with ax moved last
    e8m0 = F.pad(e8m0, (0, nb % 2))                              # pad the block axis to even
    e8m0 = e8m0.unflatten(-1, (-1, 2)).movedim(-2, ax)           # pairs; the block axis at ax
    return y, e8m0


def _dynamic_mx_quant_example(gen: torch.Generator) -> Example:
    return (_example_floats(gen, 2, 64),), {}


def npu_dequant_swiglu_quant(
        x: torch.Tensor, *, weight_scale: torch.Tensor | None = None,
        activation_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
        quant_scale: torch.Tensor | None = None, quant_offset: torch.Tensor | None = None,
        group_index: torch.Tensor | None = None, activate_left: bool = False,
        quant_mode: int = 0, dst_type: int | None = None, round_mode: int | None = None,
        activate_dim: int | None = None, swiglu_mode: int = 0, clamp_limit: float = 7.0,
        glu_alpha: float = 1.702, glu_bias: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu 2.14.0 doc: int32 x dequantised (``(x + bias) * weight_scale *
    activation_scale``; bf16 / fp16 x as it is), SwiGLU over the halves of ``activate_dim``
    (``activate_left``: swish of the left half times the right, else the reverse; swiglu_mode
    1: the clamped variant of npu_clipped_swiglu), then int8 quantisation: static
    (quant_mode 0: ``round(act * quant_scale + quant_offset)``; the scale output is 1) or
    dynamic (1: ``act * quant_scale`` (smooth), ``scale = max|.| / 127`` per token).  With
    ``group_index`` (token counts per group) each row takes its group's scale rows; rows past
    the counts' sum are zero here (the doc: not written)."""
    if dst_type not in (None, _ST_INT8):
        raise NotImplementedError(f"npu_dequant_swiglu_quant: dst_type {dst_type} is not "
                                  "emulated (the doc: y is int8)")
    dim = -1 if activate_dim is None else activate_dim
    v = x.to(_F32)
    if bias is not None and not x.is_floating_point():
        v = v + bias.to(_F32)
    n_rows = math.prod(x.shape[:-1])
    group = None
    if group_index is not None:
        ends = torch.cumsum(group_index.reshape(-1).long(), 0)
        group = _group_of_rows(n_rows, ends)
    if weight_scale is not None:  # per column of x's last axis, per group's row
        v = (v.reshape(n_rows, -1) * _rows_of(weight_scale, group, n_rows)).reshape(v.shape)
    if activation_scale is not None:
        v = v * activation_scale.to(_F32).reshape(*x.shape[:-1], 1)
    a, b = _halves(v, dim)
    gate, up = (a, b) if activate_left else (b, a)
    if swiglu_mode == 1:
        gate = gate.clamp(max=clamp_limit)
        up = up.clamp(min=-clamp_limit, max=clamp_limit)
        act = gate * torch.sigmoid(glu_alpha * gate) * (up + glu_bias)
    else:
        act = F.silu(gate) * up
    n_out = math.prod(act.shape[:-1])  # n_rows unless activate_dim halves another axis
    flat = act.reshape(n_out, -1)
    if quant_scale is not None:
        flat = flat * _rows_of(quant_scale, group, n_out)
    if quant_mode == 1:
        amax = flat.abs().amax(-1)
        scale = amax / 127.0
        q = _quantize_int(flat, scale.unsqueeze(-1), 127.0)
    else:
        if quant_offset is not None:
            flat = flat + _rows_of(quant_offset, group, n_out)
        q = torch.round(flat).clamp(-128, 127)
        scale = torch.ones(n_out, dtype=_F32, device=x.device)
    if group is not None:
        covered = (group < group_index.numel()).to(_F32)  # type: ignore[union-attr]
        q, scale = q * covered.unsqueeze(1), scale * covered
    return q.reshape(act.shape).to(torch.int8), scale.reshape(act.shape[:-1])


def _dequant_swiglu_quant_example(gen: torch.Generator) -> Example:
    t, h2 = 4, 16
    return (torch.randint(-50, 51, (t, h2), generator=gen, dtype=torch.int32),), {
        "weight_scale": _example_scales(gen, 2, h2) / 8,
        "activation_scale": _example_scales(gen, t),
        "quant_scale": _example_scales(gen, 2, h2 // 2),
        "group_index": torch.tensor([1, 3], dtype=torch.int64),
        "activate_left": True, "quant_mode": 1}


# --------------------------------------------------------------------------- MindSpeed
def fused_swiglu(x: torch.Tensor) -> torch.Tensor:
    """MindSpeed master, mindspeed/core/fusions/fused_bias_swiglu.py: ``npu_swiglu(x, dim=-1)``."""
    return npu_swiglu(x, -1)


def _fused_swiglu_example(gen: torch.Generator) -> Example:
    return (_example_floats(gen, 4, 16),), {}


# --------------------------------------------------------------------------- the entries
REFERENCES: tuple[Reference, ...] = (
    Reference("npu_add_rms_norm", npu_add_rms_norm, example=_add_rms_norm_example,
              source="CANN 8.2.RC1 aclnnAddRmsNorm (no torch_npu docstring)"),
    Reference("npu_swiglu_backward", npu_swiglu_backward, example=_swiglu_backward_example,
              grad_of="npu_swiglu", source=f"{_DERIV} (npu_swiglu); {_DOCS} (npu_swiglu)"),
    Reference("npu_clipped_swiglu", npu_clipped_swiglu, example=_clipped_swiglu_example,
              source=_DOCS),
    Reference("npu_apply_rotary_pos_emb", npu_apply_rotary_pos_emb,
              example=_apply_rotary_example, source=_DOCS),
    Reference("npu_mrope", npu_mrope, example=_mrope_example, source=_DOCS),
    Reference("npu_cross_entropy_loss", npu_cross_entropy_loss, example=_cross_entropy_example,
              source=f"{_DOCS}; {_DERIV}"),
    Reference("npu_cross_entropy_loss_backward", npu_cross_entropy_loss_backward,
              example=_cross_entropy_backward_example, grad_of="npu_cross_entropy_loss",
              source=f"{_DERIV} (npu_cross_entropy_loss)"),
    Reference("npu_dynamic_quant", npu_dynamic_quant, example=_dynamic_quant_example,
              source=_DOCS),
    Reference("npu_dynamic_quant_asymmetric", npu_dynamic_quant_asymmetric,
              example=_dynamic_quant_asymmetric_example, source=_DOCS),
    Reference("npu_quant_matmul", npu_quant_matmul, example=_quant_matmul_example,
              source=f"{_DOCS} (int8 modes)"),
    Reference("npu_dynamic_mx_quant", npu_dynamic_mx_quant, example=_dynamic_mx_quant_example,
              source=f"{_DOCS}; OCP Microscaling Formats (MX) v1.0"),
    Reference("npu_dequant_swiglu_quant", npu_dequant_swiglu_quant,
              example=_dequant_swiglu_quant_example, source=f"{_DOCS}; CANN aclnnSwiGluQuant"),
    Reference("mindspeed.fused_swiglu", fused_swiglu, example=_fused_swiglu_example,
              source="MindSpeed master, mindspeed/core/fusions/fused_bias_swiglu.py"),
)
