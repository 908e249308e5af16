"""Fake (meta) implementations: output shapes and dtypes without touching data.

``torch.compile`` traces the emulated ops through these, so they must agree with the kernels
in ``_kernels.py`` on every output's shape and dtype. Like the kernels, they receive arguments
already mapped to the dtype the kernel assumes (``_raw.fake_view``), so a misread input
yields the same output dtype here as in eager mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..reference._matmul import out_dtype
from . import _kernels as K

__all__ = [
    "_npu_moe_token_unpermute",
    "_npu_moe_token_unpermute_with_routing_map",
    "npu_grouped_matmul",
    "npu_moe_compute_expert_tokens",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_moe_token_permute",
    "npu_moe_token_permute_grad",
    "npu_moe_token_permute_grad_v2",
    "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_unpermute",
    "npu_moe_token_unpermute_grad",
    "npu_moe_token_unpermute_grad_v2",
    "npu_moe_token_unpermute_with_routing_map",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
]

_I32 = torch.int32


def _num_out_rows(num_out_tokens: int | None, total: int) -> int:
    if num_out_tokens is None or num_out_tokens <= 0:
        return total
    return torch.sym_min(num_out_tokens, total)


def npu_moe_token_permute(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    num_out_tokens: int | None = None,
    padded_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    total = indices.numel()
    rows = _num_out_rows(num_out_tokens, total)
    return tokens.new_empty((rows, tokens.size(1))), indices.new_empty((total,), dtype=_I32)


def npu_moe_token_permute_grad(
    tokens: torch.Tensor,
    grad_permuted_tokens: torch.Tensor,
    indices: torch.Tensor,
    sorted_indices: torch.Tensor,
    padded_mode: bool = False,
) -> torch.Tensor:
    return grad_permuted_tokens.new_empty((tokens.size(0), grad_permuted_tokens.size(1)))


def _unpermute_rows(sorted_indices: torch.Tensor, probs: torch.Tensor | None) -> int:
    topk = probs.size(1) if probs is not None and probs.dim() == 2 else 1
    return sorted_indices.numel() // topk


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    rows = _unpermute_rows(sorted_indices, probs)
    return permuted_tokens.new_empty((rows, permuted_tokens.size(1)))


def npu_moe_token_unpermute_grad(
    permuted_tokens: torch.Tensor,
    grad_unpermuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_permuted = permuted_tokens.new_empty(permuted_tokens.shape)
    if probs is None:
        return grad_permuted, permuted_tokens.new_empty((0,))
    return grad_permuted, probs.new_empty(probs.shape)


def _npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)
    return out, permuted_tokens.new_empty(permuted_tokens.shape)


def npu_moe_token_unpermute_grad_v2(
    grad_unpermuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    permuted_tokens_size_0: Any,
    permuted_tokens_dtype: torch.dtype,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
    permuted_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_permuted = grad_unpermuted_tokens.new_empty(
        (permuted_tokens_size_0, grad_unpermuted_tokens.size(-1)), dtype=permuted_tokens_dtype)
    if probs is None:
        return grad_permuted, grad_unpermuted_tokens.new_empty((0,), dtype=permuted_tokens_dtype)
    return grad_permuted, probs.new_empty(probs.shape)


def npu_moe_token_permute_grad_v2(
    grad_permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    tokens_size_0: Any,
    tokens_dtype: torch.dtype,
    num_topK: Any,  # noqa: N803 - torch_npu's argument name
    padded_mode: bool = False,
) -> torch.Tensor:
    return grad_permuted_tokens.new_empty((tokens_size_0, grad_permuted_tokens.size(1)),
                                          dtype=tokens_dtype)


def npu_moe_token_permute_with_routing_map(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = K.routing_map_out_rows(tokens.size(0), routing_map, num_out_tokens, drop_and_pad)
    permuted_probs = probs.new_empty((rows,)) if probs is not None else tokens.new_empty((0,))
    return (
        tokens.new_empty((rows, tokens.size(1))),
        permuted_probs,
        tokens.new_empty((rows,), dtype=_I32),
    )


def npu_moe_token_unpermute_with_routing_map(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    *,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
) -> torch.Tensor:
    return permuted_tokens.new_empty((restore_shape[0], restore_shape[1]))


def _npu_moe_token_unpermute_with_routing_map(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    *,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape)
    permute_probs = (probs.new_empty(sorted_indices.shape) if probs is not None
                     else permuted_tokens.new_empty((0,)))
    return (out, sorted_indices.new_empty(sorted_indices.shape),
            sorted_indices.new_empty(sorted_indices.shape), permute_probs)


def npu_moe_init_routing(
    x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_rows, topk = expert_idx.shape
    active = torch.sym_min(n_rows, max(active_num, 0)) * topk
    total = n_rows * topk
    return (
        x.new_empty((active, x.size(1))),
        x.new_empty((total,), dtype=_I32),
        x.new_empty((total,), dtype=_I32),
    )


def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor,
    skip1: torch.Tensor | None,
    skip2: torch.Tensor | None,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
    expanded_src_to_dst_row: torch.Tensor,
    export_for_source_row: torch.Tensor | None,
    drop_pad_mode: int | None = 0,
    k: int | None = 1,
) -> torch.Tensor:
    topk = scales.size(1) if scales is not None else max(k or 1, 1)
    rows = expanded_src_to_dst_row.numel() // topk
    return expanded_permuted_rows.new_empty((rows, expanded_permuted_rows.size(-1)))


def npu_moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=_I32), x.new_empty(shape, dtype=_I32)


def npu_moe_compute_expert_tokens(
    sorted_expert_for_source_row: torch.Tensor, num_expert: int
) -> torch.Tensor:
    return sorted_expert_for_source_row.new_empty((num_expert,), dtype=_I32)


def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
    offset: Sequence[torch.Tensor] | None = None,
    antiquant_scale: Sequence[torch.Tensor] | None = None,
    antiquant_offset: Sequence[torch.Tensor] | None = None,
    per_token_scale: Sequence[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    activation_input: Sequence[torch.Tensor] | None = None,
    activation_quant_scale: Sequence[torch.Tensor] | None = None,
    activation_quant_offset: Sequence[torch.Tensor] | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: Sequence[int] | None = None,
    output_dtype: int | None = None,
    x_dtype: int | None = None,
    weight_dtype: int | None = None,
    scale_dtype: int | None = None,
    per_token_scale_dtype: int | None = None,
) -> list[torch.Tensor]:
    # the meta kernel's shapes (torch_npu 2.14.0 _meta_registrations.py), the reference's
    # per-group outputs for group_type 0 with split_item 0/1 (data-dependent rows)
    ws = K.grouped_weights(weight)
    dtype = out_dtype(output_dtype, x[0])

    def n_of(w: torch.Tensor) -> int:
        return w.size(-1) * 8 if w.dtype == _I32 else w.size(-1)

    single = split_item in (2, 3)
    if K.is_grouped(x, group_type) and group_type == 2:
        xs = x[0]
        n_groups = group_list.size(0) if group_list is not None else 1
        n = n_of(ws[0])
        if single:
            return [xs.new_empty((n_groups, xs.size(0), n), dtype=dtype)]
        return [xs.new_empty((xs.size(0), n), dtype=dtype) for _ in range(n_groups)]
    if K.is_grouped(x, group_type):
        xs = x[0]
        if single:
            return [xs.new_empty((xs.size(0), n_of(ws[0])), dtype=dtype)]
        ctx = torch.library.get_ctx()
        return [xs.new_empty((ctx.new_dynamic_size(), n_of(w)), dtype=dtype) for w in ws]
    outs = [xi.new_empty((*xi.shape[:-1], n_of(ws[i])), dtype=dtype) for i, xi in enumerate(x)]
    if single:
        rows = sum(o.numel() // o.size(-1) for o in outs)
        return [outs[0].new_empty((rows, outs[0].size(-1)))]
    return outs


def npu_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(gamma.dim(), 1)
    rstd_shape = (*self.shape[:-n], *([1] * n))
    return self.new_empty(self.shape), self.new_empty(rstd_shape, dtype=torch.float32)


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    shape = list(self.shape)
    shape[dim] = shape[dim] // 2
    return self.new_empty(shape)


def npu_rotary_mul(
    self: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    return self.new_empty(torch.broadcast_shapes(self.shape, r1.shape, r2.shape))

