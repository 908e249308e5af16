"""Backward formulas of the differentiable ops whose backward has no kernel of its own.

The facts table names no backward kernels for the routing-map permute/unpermute, grouped
matmul, rms_norm, swiglu and rotary_mul, so their backward is a composite of plain PyTorch on
the saved inputs, in fp32: these formulas.  (Fusion attention has a backward kernel,
``npu_fusion_attention_grad``: its formula lives with its reference in ``_attention`` and is
re-exported here.)  The emulation's autograd kernels run them (with static shapes, so
``torch.compile`` traces them); the shadow compare judges a
real kernel's gradients against autograd through the forward reference instead, which is an
independent derivation of the same math (the test suite checks that the two agree).

Every formula: ``(inputs, outputs, grads) -> {argument name: gradient}`` (``inputs`` maps every
schema argument name to its value; names left out get no gradient).

Some backward kernels are ops of their own, called with the arguments torch_npu's C++ node (or
MindSpeed) passes: ``npu_rms_norm_backward``, ``npu_rotary_mul_backward`` and the routing-map
``npu_moe_token_(un)permute_with_routing_map_grad`` (CANN's aclnn*WithRoutingMapGrad; outputs
as op-plugin allocates them).  Their references here run the formulas above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._attention import fusion_attention_backward
from ._matmul import grouped_weights, is_grouped
from ._moe import routing_unpermute_weights, slot_of_destination
from ._norm import rms_norm_dims, rotate_transposed, rotated
from ._util import fit, gather_rows, safe_index, scatter_add_rows

__all__ = [
    "fusion_attention_backward",
    "grouped_matmul_backward",
    "internal_unpermute_with_routing_map_backward",
    "npu_moe_token_permute_with_routing_map_grad",
    "npu_moe_token_unpermute_with_routing_map_grad",
    "permute_with_routing_map_backward",
    "rms_norm_backward",
    "rotary_mul_backward",
    "npu_rotary_mul_backward",
    "swiglu_backward",
    "unpermute_with_routing_map_backward",
]

_F32 = torch.float32


def _reduce_to(grad: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Sum ``grad`` over the dimensions that were broadcast from ``shape``."""
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for d, size in enumerate(shape):
        if size == 1 and grad.size(d) != 1:
            grad = grad.sum(d, keepdim=True)
    return grad


def _routing_grad_probs(
    grad_permuted_probs: torch.Tensor, routing_map: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Scatter per-permuted-row prob grads (expert-major order) back to (N, E)."""
    n_tokens, n_experts = routing_map.shape
    rank, valid = slot_of_destination(routing_map, grad_permuted_probs.numel())
    flat = grad_permuted_probs.to(_F32).reshape(-1)
    if flat.numel() == 0:
        per_entry = torch.zeros(rank.shape, dtype=_F32, device=rank.device)
    else:
        per_entry = flat.index_select(0, rank) * valid.to(_F32)
    return per_entry.view(n_experts, n_tokens).T.to(dtype)


def _permute_routing_grads(
    grad_permuted: torch.Tensor, grad_permuted_probs: torch.Tensor | None,
    sorted_indices: torch.Tensor, routing_map: torch.Tensor, n_tokens: int, drop_and_pad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The routing-map permute's gradients in fp32: (tokens (N, H), probs (N, E) or None when
    ``grad_permuted_probs`` is None).  An empty ``grad_permuted_probs`` (the emulated forward's
    second output without probs) scatters nothing: zeros."""
    g = grad_permuted.to(_F32)
    grad_tokens = torch.zeros((n_tokens, g.size(1)), dtype=_F32, device=g.device)
    grad_probs: torch.Tensor | None = None
    if drop_and_pad:
        grad_tokens = scatter_add_rows(grad_tokens, sorted_indices, g)
        if grad_permuted_probs is not None:
            n_experts = routing_map.size(1)
            ids, valid = safe_index(sorted_indices, n_tokens)
            gp = fit(grad_permuted_probs.to(_F32).reshape(-1), ids.numel()) * valid.to(_F32)
            grad_t = torch.zeros((n_experts, n_tokens), dtype=_F32, device=g.device)
            grad_probs = grad_t.scatter_add(1, ids.view(n_experts, -1), gp.view(n_experts, -1)).T
    else:
        topk = max(sorted_indices.numel() // n_tokens, 1) if n_tokens else 1
        rows = gather_rows(g, sorted_indices)
        owner = torch.arange(rows.size(0), device=rows.device) // topk
        grad_tokens = scatter_add_rows(grad_tokens, owner, rows)
        if grad_permuted_probs is not None:
            grad_probs = _routing_grad_probs(grad_permuted_probs, routing_map, _F32)
    return grad_tokens, grad_probs


def permute_with_routing_map_backward(
    inputs: dict[str, Any], outputs: Any, grads: Any
) -> dict[str, Any]:
    tokens, routing_map, probs = inputs["tokens"], inputs["routing_map"], inputs["probs"]
    grad_permuted, grad_permuted_probs, _ = grads
    grad_tokens, grad_probs = _permute_routing_grads(
        grad_permuted, grad_permuted_probs if probs is not None else None, outputs[2],
        routing_map, tokens.size(0), inputs["drop_and_pad"])
    result: dict[str, Any] = {"tokens": grad_tokens.to(tokens.dtype)}
    if grad_probs is not None:
        result["probs"] = grad_probs.to(probs.dtype)
    return result


def npu_moe_token_permute_with_routing_map_grad(
    permuted_token_out_grad: torch.Tensor, probs_grad: torch.Tensor | None,
    sorted_indices: torch.Tensor, routing_map: torch.Tensor, experts_num: int, tokens_num: int,
    drop_and_pad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """aclnnMoeTokenPermuteWithRoutingMapGrad, as the permute's C++ node and MindSpeed 2.2+'s
    ``MoePermuteMaskMap.backward`` call it: (tokens grad (tokens_num, H) in
    permuted_token_out_grad's dtype, probs grad (tokens_num, experts_num) in probs_grad's dtype,
    None without probs_grad), op-plugin's ``MoeTokenPermuteWithRoutingMapGradOpApi.cpp``
    allocations."""
    grad_tokens, grad_probs = _permute_routing_grads(
        permuted_token_out_grad, probs_grad, sorted_indices, routing_map, int(tokens_num),
        drop_and_pad)
    if grad_probs is not None:
        assert probs_grad is not None
        grad_probs = fit(grad_probs.reshape(-1), int(tokens_num) * int(experts_num)).view(
            int(tokens_num), int(experts_num)).to(probs_grad.dtype)
    return grad_tokens.to(permuted_token_out_grad.dtype), grad_probs


def unpermute_with_routing_map_backward(
    inputs: dict[str, Any], outputs: Any, grads: Any
) -> dict[str, Any]:
    got = _unpermute_routing_grads(inputs, grads)
    return {name: g.to(inputs[name].dtype) for name, g in got.items()}


def _unpermute_routing_grads(inputs: dict[str, Any], grads: torch.Tensor) -> dict[str, Any]:
    """The routing-map unpermute's gradients in fp32 (``probs``' only with probs)."""
    permuted = inputs["permuted_tokens"]
    sorted_indices = inputs["sorted_indices"]
    probs, routing_map = inputs["probs"], inputs["routing_map"]
    drop_and_pad = inputs["drop_and_pad"]
    g = grads.to(_F32)
    n_tokens = g.size(0)
    rows_f = permuted.to(_F32)
    weights = routing_unpermute_weights(
        sorted_indices, probs, routing_map, drop_and_pad, permuted.size(0)
    )
    result: dict[str, Any] = {}
    if drop_and_pad:
        g_rows = gather_rows(g, sorted_indices)  # grad of each permuted row, unweighted
        grad_permuted = g_rows * (weights.unsqueeze(1) if weights is not None else 1.0)
        grad_permuted = fit(grad_permuted.reshape(-1), rows_f.numel()).view(rows_f.shape)
        if probs is not None:
            n_experts = probs.size(1)
            dots = (rows_f[: g_rows.size(0)] * g_rows).sum(1)
            ids, valid = safe_index(sorted_indices, n_tokens)
            grad_t = torch.zeros((n_experts, n_tokens), dtype=_F32, device=g.device)
            grad_t = grad_t.scatter_add(1, ids.view(n_experts, -1), (dots * valid).view(n_experts, -1))
            result["probs"] = grad_t.T
    else:
        topk = max(sorted_indices.numel() // n_tokens, 1) if n_tokens else 1
        owner = torch.arange(sorted_indices.numel(), device=g.device) // topk
        g_slots = gather_rows(g, owner)  # per token-major slot
        w_slots = gather_rows(weights.unsqueeze(1), sorted_indices) if weights is not None else None
        contrib = g_slots * w_slots if w_slots is not None else g_slots
        grad_permuted = scatter_add_rows(torch.zeros_like(rows_f), sorted_indices, contrib)
        if probs is not None:
            dots = (gather_rows(rows_f, sorted_indices) * g_slots).sum(1, keepdim=True)
            per_row = scatter_add_rows(rows_f.new_zeros((rows_f.size(0), 1)), sorted_indices, dots)
            if routing_map is not None:
                result["probs"] = _routing_grad_probs(per_row.view(-1), routing_map, _F32)
            else:
                result["probs"] = fit(per_row.view(-1), probs.numel()).view(probs.shape)
    result["permuted_tokens"] = grad_permuted
    return result


def internal_unpermute_with_routing_map_backward(
    inputs: dict[str, Any], outputs: Any, grads: Any
) -> dict[str, Any]:
    """``_npu_moe_token_unpermute_with_routing_map``: the public op's formula on the output (the
    other three outputs are not differentiable)."""
    return unpermute_with_routing_map_backward(inputs, outputs[0], grads[0])


def _row_tokens(out_index: torch.Tensor, permuted_token_id: torch.Tensor) -> torch.Tensor:
    """Per permuted row, the token it holds: ``row_tokens[out_index[i]] = permuted_token_id[i]``
    (CANN: ``permuteTokenId, outIndex = sortedIndices.sort()``), i.e. drop_and_pad's
    ``sorted_indices``."""
    rows = out_index.numel()
    ids = permuted_token_id.reshape(-1, 1).to(torch.int64)
    return scatter_add_rows(ids.new_zeros((rows, 1)), out_index, ids).view(-1).to(out_index.dtype)


def npu_moe_token_unpermute_with_routing_map_grad(
    unpermuted_tokens_grad: torch.Tensor, out_index: torch.Tensor,
    permuted_token_id: torch.Tensor, routing_map: torch.Tensor | None,
    permuted_tokens: torch.Tensor | None, probs: torch.Tensor | None, drop_and_pad: bool,
    restore_shape: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """aclnnMoeTokenUnpermuteWithRoutingMapGrad, as ``_npu_moe_token_unpermute_with_routing_map``'s
    C++ node and MindSpeed 2.2+'s ``MoeUnpermuteMaskMap.backward`` call it (drop_and_pad: the
    internal op's ``out_index`` and ``permuted_token_id``; otherwise ``sorted_indices`` for
    both, the token of slot i being ``i // topK``): (permuted tokens grad (out_index rows, H),
    probs grad (probs' shape, None without probs)), both in unpermuted_tokens_grad's dtype
    (op-plugin's ``MoeTokenUnpermuteWithRoutingMapGradKernelNpuOpApi.cpp`` allocations).
    ``permuted_tokens`` is only read for probs' gradient (MindSpeed saves it only with probs)."""
    rows, dtype = out_index.numel(), unpermuted_tokens_grad.dtype
    like = permuted_tokens if permuted_tokens is not None else \
        unpermuted_tokens_grad.new_zeros((rows, unpermuted_tokens_grad.size(1)))
    got = _unpermute_routing_grads(
        {"permuted_tokens": like, "probs": probs, "routing_map": routing_map,
         "drop_and_pad": drop_and_pad,
         "sorted_indices": _row_tokens(out_index, permuted_token_id) if drop_and_pad
         else out_index},
        unpermuted_tokens_grad)
    grad_probs = got.get("probs")
    return got["permuted_tokens"].to(dtype), grad_probs.to(dtype) if grad_probs is not None else None


_GMM_QUANT = ("scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale")


def _grouped_matmul_autograd(inputs: dict[str, Any], grads: Any) -> dict[str, Any]:
    """Autograd through the reference: quantized modes and activations (not trained through on
    the NPU; torch_npu has no backward for them), floating inputs only."""
    from ._matmul import npu_grouped_matmul

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().requires_grad_()
        if isinstance(v, (list, tuple)):
            return [leaf(t) for t in v]
        return v

    call = {k: leaf(v) for k, v in inputs.items()}
    with torch.enable_grad():
        outs = npu_grouped_matmul(**call)
    pairs = [(o, g) for o, g in zip(outs, grads, strict=False)
             if g is not None and o.requires_grad]
    names = [k for k, v in call.items() if isinstance(v, list)
             and any(isinstance(t, torch.Tensor) and t.requires_grad for t in v)]
    leaves = [t for k in names for t in call[k] if t.requires_grad]
    if not pairs or not leaves:
        return {}
    got = iter(torch.autograd.grad([o for o, _ in pairs], leaves,
                                   [g.to(o.dtype) for o, g in pairs], allow_unused=True))
    result: dict[str, Any] = {}
    for k in names:
        result[k] = [next(got) if t.requires_grad else None for t in call[k]]
    return result


def grouped_matmul_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """Grads of x, weight and bias (non-quantized, no activation: the mode MindSpeed and
    Megatron train through); the grouped cases use a one-hot row->group (M split) or
    column->group (K split) map so that the backward has static shapes (traceable by
    torch.compile).  Quantized modes and activations: autograd through the reference."""
    if any(inputs.get(k) for k in _GMM_QUANT) or inputs.get("act_type") or \
            inputs.get("output_dtype") is not None:
        return _grouped_matmul_autograd(inputs, grads)
    x: list[torch.Tensor] = list(inputs["x"])
    weight: list[torch.Tensor] = list(inputs["weight"])
    bias = inputs["bias"]
    gs = [g.to(_F32) if g is not None else None for g in grads]
    result: dict[str, Any] = {}
    group_list = inputs["group_list"]
    if is_grouped(x, inputs["group_type"]) and inputs["group_type"] == 2:
        return _k_split_backward(x[0], weight, group_list, inputs["group_list_type"],
                                 inputs["split_item"], gs)
    if is_grouped(x, inputs["group_type"]):
        xs = x[0].to(_F32)
        w3 = weight[0].to(_F32) if len(weight) == 1 and weight[0].dim() == 3 else torch.stack(
            [w.to(_F32) for w in weight]
        )
        n_groups = w3.size(0)
        gz = [g if g is not None else torch.zeros((0, w3.size(-1)), dtype=_F32) for g in gs]
        g = gz[0] if len(gz) == 1 else torch.cat(gz, 0)
        if inputs["split_item"] not in (2, 3):  # per-group outputs; rows past the end get none
            g = torch.cat([g, g.new_zeros((xs.size(0) - g.size(0), g.size(1)))], 0)
        if group_list is None:
            ends = torch.full((n_groups,), xs.size(0), dtype=torch.int64, device=xs.device)
        else:
            values = fit(group_list.reshape(-1).long(), n_groups)
            ends = torch.cumsum(values, 0) if inputs["group_list_type"] == 1 else values
        row = torch.arange(xs.size(0), device=xs.device)
        group_of_row = torch.searchsorted(ends.contiguous(), row, right=True)  # E: past the end
        onehot = (group_of_row.unsqueeze(1) == torch.arange(n_groups, device=xs.device)).to(_F32)
        grad_x = torch.einsum("me,mn,ekn->mk", onehot, g, w3)
        grad_w3 = torch.einsum("me,mk,mn->ekn", onehot, xs, g)
        result["x"] = [grad_x.to(x[0].dtype)]
        if len(weight) == 1 and weight[0].dim() == 3:
            result["weight"] = [grad_w3.to(weight[0].dtype)]
        else:
            result["weight"] = [gw.to(w.dtype) for gw, w in zip(grad_w3.unbind(0), weight, strict=True)]
        if bias:
            grad_b = torch.einsum("me,mn->en", onehot, g)
            if len(bias) == 1 and bias[0].dim() == 2:
                result["bias"] = [grad_b.to(bias[0].dtype)]
            else:
                result["bias"] = [gb.to(b.dtype) for gb, b in zip(grad_b.unbind(0), bias, strict=False)]
        return result
    ws = grouped_weights(weight)
    if len(gs) == 1 and len(x) > 1:  # split_item 2/3: one concatenated output
        assert gs[0] is not None
        gs = list(gs[0].split([xi.numel() // xi.size(-1) for xi in x], 0))
    gs = [g.reshape(-1, g.size(-1)) if g is not None else None for g in gs]
    flat = [xi.reshape(-1, xi.size(-1)).to(_F32) for xi in x]
    result["x"] = [(g @ w.to(_F32).T).reshape(xi.shape).to(xi.dtype) if g is not None else None
                   for g, w, xi in zip(gs, ws, x, strict=False)]
    result["weight"] = [(xf.T @ g).to(w.dtype) if g is not None else None
                        for g, w, xf in zip(gs, ws, flat, strict=False)]
    if bias:
        result["bias"] = [g.sum(0).to(b.dtype) if g is not None else None
                          for g, b in zip(gs, bias, strict=False)]
    return result


def _k_split_backward(x: torch.Tensor, weight: list[torch.Tensor], group_list: Any,
                      group_list_type: Any, split_item: Any, gs: list[Any]) -> dict[str, Any]:
    """group_type 2: y_g = x[:, k_g] @ w[k_g]; a one-hot column->group map (static shapes)."""
    w = weight[0] if len(weight) == 1 else torch.cat(list(weight), 0)
    n_groups = group_list.numel() if group_list is not None else 1
    if split_item in (2, 3):
        gy = gs[0]
    else:
        gy = torch.stack([g if g is not None else torch.zeros((x.size(0), w.size(-1)),
                                                                dtype=_F32) for g in gs])
    if group_list is None:
        ends = torch.full((1,), x.size(1), dtype=torch.int64, device=x.device)
    else:
        values = group_list.reshape(-1).long()
        ends = torch.cumsum(values, 0) if group_list_type == 1 else values
    col = torch.arange(x.size(1), device=x.device)
    group_of_col = torch.searchsorted(ends.contiguous(), col, right=True)
    onehot = (group_of_col.unsqueeze(1) == torch.arange(n_groups, device=x.device)).to(_F32)
    grad_x = torch.einsum("kg,gmn,kn->mk", onehot, gy, w.to(_F32))
    grad_w = torch.einsum("kg,mk,gmn->kn", onehot, x.to(_F32), gy)
    if len(weight) == 1:
        grad_ws = [grad_w.to(weight[0].dtype)]
    else:
        grad_ws = [gw.to(wi.dtype) for gw, wi in
                   zip(grad_w.split([wi.size(0) for wi in weight], 0), weight, strict=True)]
    return {"x": [grad_x.to(x.dtype)], "weight": grad_ws}


def rms_norm_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    x, gamma = inputs["self"], inputs["gamma"]
    grad_y, _ = grads
    _, rstd = outputs
    dims = rms_norm_dims(gamma)
    xf, gf = x.to(_F32), gamma.to(_F32)
    x_hat = xf * rstd
    gy = grad_y.to(_F32) * gf
    grad_x = rstd * (gy - x_hat * (gy * x_hat).mean(dim=dims, keepdim=True))
    # torch_npu's derivative (op-plugin derivatives.yaml, NpuRmsNormBackward0 in Functions.h):
    # npu_rms_norm_backward(grads[0], self, gamma, result1): a gradient reaching the rstd output
    # is not used, so none is added here either
    grad_gamma = _reduce_to(grad_y.to(_F32) * x_hat, gamma.shape)
    return {"self": grad_x.to(x.dtype), "gamma": grad_gamma.to(gamma.dtype)}


def npu_rms_norm_backward(dy: torch.Tensor, self: torch.Tensor, gamma: torch.Tensor,
                          rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu's RMSNorm backward kernel (op-plugin ``derivatives.yaml``: ``self, gamma:
    npu_rms_norm_backward(grads[0], self, gamma, result1)``; rstd's gradient is not used):
    (dx in self's dtype, dgamma in gamma's)."""
    got = rms_norm_backward({"self": self, "gamma": gamma}, (None, rstd), (dy, None))
    return got["self"], got["gamma"]


def npu_rotary_mul_backward(grad: torch.Tensor, self: torch.Tensor, r1: torch.Tensor,
                            r2: torch.Tensor, rotary_mode: str = "half"
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_npu's rotary-mul backward kernel, as ``NpuRotaryMulBackward0`` calls it
    (``npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)``): (dx, dr1, dr2), each in its
    input's dtype and shape."""
    got = rotary_mul_backward({"self": self, "r1": r1, "r2": r2, "rotary_mode": rotary_mode},
                              None, grad)
    return got["self"], got["r1"], got["r2"]


def swiglu_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    x, dim = inputs["self"], inputs["dim"]
    a, b = x.to(_F32).chunk(2, dim=dim)
    g = grads.to(_F32)
    sig = torch.sigmoid(a)
    grad_a = g * b * sig * (1 + a * (1 - sig))
    grad_b = g * a * sig
    return {"self": torch.cat([grad_a, grad_b], dim=dim).to(x.dtype)}


def rotary_mul_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    x, r1, r2, mode = inputs["self"], inputs["r1"], inputs["r2"], inputs["rotary_mode"]
    g = grads.to(_F32)
    xf = x.to(_F32)
    grad_x = _reduce_to(g * r1.to(_F32) + rotate_transposed(g * r2.to(_F32), mode), x.shape)
    return {
        "self": grad_x.to(x.dtype),
        "r1": _reduce_to(g * xf, r1.shape).to(r1.dtype),
        "r2": _reduce_to(g * rotated(xf, mode), r2.shape).to(r2.dtype),
    }
