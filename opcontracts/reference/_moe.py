"""References of the MoE ops: token permute / unpermute (and their ``_grad`` ops), the
routing-map variants, init / finalize routing, gating top-k softmax, expert token counts.

Formulas of the CANN aclnn / torch_npu docs (aclnnMoeTokenPermute, aclnnMoeTokenUnpermute,
aclnnMoeTokenPermuteWithRoutingMap, aclnnMoeInitRouting, aclnnMoeFinalizeRouting,
aclnnMoeGatingTopKSoftmax, aclnnMoeComputeExpertTokens; torch_npu 2.13/2.14
``_op_plugin_docs.py``).  Floating math runs in ``acc_dtype`` (fp32, fp64 for fp64 inputs) and
is cast back to the output dtype.

Conventions (CANN aclnnMoeTokenPermute / aclnnMoeTokenUnpermute):
``sorted_indices[n * K + k]`` is the row of the permuted tokens that holds copy ``k`` of token
``n`` (``argsort(argsort(flatten(indices)))``), so ``unpermute`` reads
``permuted_tokens[sorted_indices[n * K + k]]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._util import acc_dtype, fit, gather_rows, safe_index, scatter_add_rows

__all__ = [
    "_npu_moe_token_unpermute",
    "_npu_moe_token_unpermute_with_routing_map",
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
    "num_out_rows",
    "routing_map_out_rows",
    "routing_unpermute_weights",
    "slot_of_destination",
]


def num_out_rows(num_out_tokens: int | None, total: int) -> int:
    """Rows ``npu_moe_token_permute`` writes: ``min(N * K, num_out_tokens)``; None or <= 0 keeps all."""
    if num_out_tokens is None or num_out_tokens <= 0:
        return total
    return min(num_out_tokens, total)


def _topk_of(indices: torch.Tensor) -> int:
    return indices.size(1) if indices.dim() == 2 else 1


def _no_padded_mode(padded_mode: bool) -> None:
    if padded_mode:
        raise NotImplementedError("padded_mode=True is not supported (nor by the NPU kernel)")


# --------------------------------------------------------------------------- permute family


def npu_moe_token_permute(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    num_out_tokens: int | None = None,
    padded_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """aclnnMoeTokenPermute: ``permuted[sorted_indices[i]] = tokens[i // K]``."""
    _no_padded_mode(padded_mode)
    topk = _topk_of(indices)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the slot each output row takes
    sorted_indices = torch.argsort(order, stable=True).to(torch.int32)  # the row of each slot
    rows = num_out_rows(num_out_tokens, flat.numel())
    permuted = gather_rows(tokens, order[:rows] // topk)
    return permuted, sorted_indices


def npu_moe_token_permute_grad(
    tokens: torch.Tensor,
    grad_permuted_tokens: torch.Tensor,
    indices: torch.Tensor,
    sorted_indices: torch.Tensor,
    padded_mode: bool = False,
) -> torch.Tensor:
    """Backward of permute: ``grad_tokens[n] = sum_k grad_permuted[sorted_indices[n * K + k]]``.

    ``tokens`` only donates its row count, as in torch_npu's derivatives.
    """
    _no_padded_mode(padded_mode)
    acc = acc_dtype(grad_permuted_tokens)
    topk = _topk_of(indices)
    n_tokens = tokens.size(0)
    rows = gather_rows(grad_permuted_tokens, sorted_indices).to(acc)  # the rows, then widened
    owner = torch.arange(rows.size(0), device=rows.device) // topk
    out = rows.new_zeros((n_tokens, grad_permuted_tokens.size(1)))
    out = scatter_add_rows(out, owner, rows, fresh=True)
    return out.to(grad_permuted_tokens.dtype)


def _unpermute_shape(sorted_indices: torch.Tensor, probs: torch.Tensor | None) -> tuple[int, int]:
    topk = probs.size(1) if probs is not None and probs.dim() == 2 else 1
    return sorted_indices.numel() // topk, topk


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """aclnnMoeTokenUnpermute: ``out[n] = sum_k permuted[sorted_indices[n*K+k]] * probs[n, k]``.

    ``restore_shape`` is only meaningful with ``padded_mode``, which is unsupported.
    """
    _no_padded_mode(padded_mode)
    acc = acc_dtype(permuted_tokens)
    n_tokens, topk = _unpermute_shape(sorted_indices, probs)
    rows = gather_rows(permuted_tokens, sorted_indices.reshape(-1)[: n_tokens * topk]).to(acc)
    if probs is not None:
        rows = rows * fit(probs.reshape(-1).to(acc), n_tokens * topk).unsqueeze(1)
    out = rows.view(n_tokens, topk, -1).sum(1)
    return out.to(permuted_tokens.dtype)


def npu_moe_token_unpermute_grad(
    permuted_tokens: torch.Tensor,
    grad_unpermuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of unpermute: (grad of permuted_tokens, grad of probs).

    ``grad_permuted[sorted_indices[n*K+k]] = grad[n] * probs[n, k]`` and
    ``grad_probs[n, k] = <permuted[sorted_indices[n*K+k]], grad[n]>``. Without probs the second
    output is an empty tensor (the op's schema has no optional outputs).
    """
    _no_padded_mode(padded_mode)
    acc = acc_dtype(grad_unpermuted_tokens, permuted_tokens)
    n_tokens, topk = _unpermute_shape(sorted_indices, probs)
    dest = sorted_indices.reshape(-1)[: n_tokens * topk]
    grad = fit(grad_unpermuted_tokens.to(acc).reshape(-1), n_tokens * permuted_tokens.size(1))
    per_token = grad.view(n_tokens, 1, -1)  # each token's gradient, for each of its K slots
    if probs is None:
        weighted = per_token.expand(n_tokens, topk, -1).reshape(n_tokens * topk, -1)
    else:
        weights = fit(probs.reshape(-1).to(acc), n_tokens * topk).view(n_tokens, topk, 1)
        weighted = (per_token * weights).view(n_tokens * topk, -1)
    grad_permuted = scatter_add_rows(
        torch.zeros(permuted_tokens.shape, dtype=acc, device=permuted_tokens.device),
        dest,
        weighted,
        fresh=probs is not None,  # without probs, weighted may be a view of the caller's grad
    ).to(permuted_tokens.dtype)
    if probs is None:
        return grad_permuted, permuted_tokens.new_empty((0,))
    slots = gather_rows(permuted_tokens, dest).to(acc).view(n_tokens, topk, -1)
    per_slot = (slots * per_token).sum(-1).reshape(-1)
    grad_probs = fit(per_slot, probs.numel()).view(probs.shape).to(probs.dtype)
    return grad_permuted, grad_probs


# ----------------------------------------------------------------------------- release ops
# torch_npu 2.7.1.post11 / 2.9.0.post9 / 2.12.0.post3 / 2.13 / 2.14: the public unpermute is an
# autograd-only kernel calling _npu_moe_token_unpermute, whose backward calls the v2 grad ops
# (npu_native_functions_by_codegen.yaml; Functions.h: NpuMoeTokenUnpermuteBackward0 saves
# permuted_tokens_scalar_type, permuted_tokens_sym_argsize_0, permuted_tokens_for_backward).
# Same aclnn kernels as the public / _grad ops: these only adapt the arguments.


def _npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_moe_token_unpermute``'s kernel, also returning what its backward needs
    (``permuted_tokens_for_backward``: the permuted tokens themselves, not a copy; op-plugin's
    glue returns them, or nothing, by its own rule)."""
    out = npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode,
                                  restore_shape)
    return out, permuted_tokens.detach()  # not differentiable (only saved)


def npu_moe_token_unpermute_grad_v2(
    grad_unpermuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    permuted_tokens_size_0: int,
    permuted_tokens_dtype: torch.dtype,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
    permuted_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_moe_token_unpermute_grad`` with the permuted tokens' row count and dtype given
    (the tokens themselves only when probs' gradient needs them)."""
    if permuted_tokens is None:
        permuted_tokens = grad_unpermuted_tokens.new_zeros(
            (permuted_tokens_size_0, grad_unpermuted_tokens.size(-1)), dtype=permuted_tokens_dtype)
    grad_permuted, grad_probs = npu_moe_token_unpermute_grad(
        permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs, padded_mode, restore_shape)
    return grad_permuted.to(permuted_tokens_dtype), grad_probs


def npu_moe_token_permute_grad_v2(
    grad_permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    tokens_size_0: int,
    tokens_dtype: torch.dtype,
    num_topK: int,  # noqa: N803 - torch_npu's argument name
    padded_mode: bool = False,
) -> torch.Tensor:
    """``npu_moe_token_permute_grad`` with the tokens' row count and dtype and the top-k given
    instead of the tokens and indices."""
    shape_only = grad_permuted_tokens.new_empty((tokens_size_0, 0))
    indices = sorted_indices.new_empty((tokens_size_0, num_topK) if num_topK > 1 else (tokens_size_0,))
    out = npu_moe_token_permute_grad(shape_only, grad_permuted_tokens, indices, sorted_indices,
                                     padded_mode)
    return out.to(tokens_dtype)


# --------------------------------------------------------------------------- routing-map variants

def routing_map_out_rows(
    tokens_rows: int, routing_map: torch.Tensor, num_out_tokens: int | None, drop_and_pad: bool
) -> int:
    """Rows of the routing-map permute output, as torch_npu's op-plugin sizes them."""
    requested = tokens_rows if num_out_tokens is None else num_out_tokens
    unit = routing_map.size(1 if drop_and_pad else 0)
    return (requested // unit) * unit if unit else 0


def slot_of_destination(routing_map: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (token, expert) of the routing map, its row in expert-major order, and the mask."""
    mask_t = routing_map.T.reshape(-1) != 0  # expert-major order, as masked_select(routing_map.T)
    rank = torch.cumsum(mask_t.long(), 0) - 1
    safe, valid = safe_index(rank, length)
    return safe, valid & mask_t


def npu_moe_token_permute_with_routing_map(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeTokenPermuteWithRoutingMap: (permuted_tokens, permuted_probs, sorted_indices).

    Without ``drop_and_pad``: token ids taken expert-major from ``routing_map.T``; the
    permuted tokens are those rows, ``sorted_indices = argsort(token ids)`` (the row of each
    token-major slot), and ``permuted_probs = probs.T.masked_select(routing_map.T)``.
    With ``drop_and_pad``: ``capacity = num_out_tokens // E`` tokens per expert, and
    ``sorted_indices`` holds the token ids. Without probs the second output is empty.
    """
    n_tokens, n_experts = routing_map.shape
    rows = routing_map_out_rows(tokens.size(0), routing_map, num_out_tokens, drop_and_pad)
    mask = routing_map != 0
    if drop_and_pad:
        capacity = rows // n_experts if n_experts else 0
        ids = torch.argsort(mask.T.to(torch.int32), dim=-1, descending=True, stable=True)
        ids = ids[:, :capacity]
        token_ids = ids.reshape(-1)
        sorted_indices = token_ids.to(torch.int32)
        permuted_probs = probs.T.gather(1, ids).reshape(-1) if probs is not None else None
    else:
        all_ids = torch.arange(n_tokens, device=tokens.device).expand(n_experts, n_tokens)
        token_ids = fit(all_ids.masked_select(mask.T), rows)
        if token_ids.numel() > int(mask.sum()):  # padding slots read nothing
            token_ids[int(mask.sum()):] = n_tokens  # a fresh index tensor, not an input
        sorted_indices = torch.argsort(token_ids, stable=True).to(torch.int32)
        permuted_probs = (
            fit(probs.T.masked_select(mask.T), rows) if probs is not None else None
        )
    permuted = gather_rows(tokens, token_ids)
    if permuted_probs is None:
        permuted_probs = tokens.new_empty((0,))
    return permuted, permuted_probs.clone(), sorted_indices


def routing_unpermute_weights(
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None,
    routing_map: torch.Tensor | None,
    drop_and_pad: bool,
    n_rows: int,
    acc: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """Per permuted row, the prob it is scaled by (None: no scaling)."""
    if probs is None:
        return None
    p = probs.to(acc)
    if drop_and_pad:
        n_experts = p.size(1)
        ids = sorted_indices.reshape(n_experts, -1).long() if n_experts else sorted_indices
        safe, valid = safe_index(ids, p.size(0))
        return p.T.gather(1, safe.view(n_experts, -1)).reshape(-1) * valid.to(acc)
    if routing_map is None:  # probs already in permuted order
        return fit(p.reshape(-1), n_rows)
    # probs.T.masked_select(routing_map.T), fitted to n_rows, with static shapes (traceable).
    rank, valid = slot_of_destination(routing_map, n_rows)
    picked = p.T.reshape(-1) * valid.to(acc)
    return torch.zeros(n_rows, dtype=acc, device=p.device).index_add(0, rank, picked)


def npu_moe_token_unpermute_with_routing_map(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    *,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
) -> torch.Tensor:
    """aclnnMoeTokenUnpermuteWithRoutingMap: the inverse of the routing-map permute.

    Each permuted row (scaled by its permuted prob) is added to the token it came from; the
    output has ``restore_shape`` and permuted_tokens' dtype.
    """
    acc = acc_dtype(permuted_tokens)
    n_tokens, hidden = int(restore_shape[0]), int(restore_shape[1])
    out = torch.zeros((n_tokens, hidden), dtype=acc, device=permuted_tokens.device)
    rows_f = permuted_tokens.to(acc)
    weights = routing_unpermute_weights(
        sorted_indices, probs, routing_map, drop_and_pad, permuted_tokens.size(0), acc
    )
    if drop_and_pad:
        rows = rows_f[: sorted_indices.numel()]
        if weights is not None:
            rows = rows * weights.unsqueeze(1)
        out = scatter_add_rows(out, sorted_indices, rows)
    else:
        topk = sorted_indices.numel() // n_tokens if n_tokens else 1
        rows = gather_rows(rows_f, sorted_indices)
        if weights is not None:
            rows = rows * gather_rows(weights.unsqueeze(1), sorted_indices)
        owner = torch.arange(rows.size(0), device=rows.device) // max(topk, 1)
        out = scatter_add_rows(out, owner, rows)
    return out.to(permuted_tokens.dtype)


def _npu_moe_token_unpermute_with_routing_map(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    *,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``npu_moe_token_unpermute_with_routing_map``'s kernel as the internal op torch_npu routes
    it through (from 2.6.0.post3; MindSpeed 2.2+'s ``te/pytorch/permutation.py`` calls it
    directly): (output, out_index, permuted_token_id, permute_probs).

    The output is the public op's.  The other three are what the kernel's backward reads; their
    shapes and dtypes are the op-plugin adaptor's allocations (``out_index`` and
    ``permuted_token_id`` like ``sorted_indices``; ``permute_probs`` ``sorted_indices``' shape in
    probs' dtype, empty in permuted_tokens' dtype without probs).  Their values are not known
    from the wheels.  With ``drop_and_pad`` (the only case the backward reads them) they are
    what CANN's grad kernels document (aclnnMoeTokenPermuteWithRoutingMapGrad:
    ``permuteTokenId, outIndex = sortedIndices.sort()``): ``permuted_token_id`` the sorted token
    ids, ``out_index`` the row of each; otherwise both are ``sorted_indices`` (what MindSpeed and
    torch_npu's derivative pass instead).  ``permute_probs`` is each permuted row's prob.  None
    of the three is differentiable (saved for backward only)."""
    out = npu_moe_token_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
        drop_and_pad=drop_and_pad)
    out_index, token_id = _routed_rows(sorted_indices.detach(), drop_and_pad)
    if probs is None:
        permute_probs = permuted_tokens.new_empty((0,))
    else:
        weights = routing_unpermute_weights(sorted_indices, probs.detach(), routing_map,
                                            drop_and_pad, permuted_tokens.size(0))
        assert weights is not None
        permute_probs = fit(weights, sorted_indices.numel()).to(probs.dtype).view(
            sorted_indices.shape)
    return out, out_index, token_id, permute_probs


def _routed_rows(sorted_indices: torch.Tensor, drop_and_pad: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_index, permuted_token_id) of the internal routing-map unpermute (see its docstring)."""
    if not drop_and_pad:
        return sorted_indices.clone(), sorted_indices.clone()
    token_id, rows = torch.sort(sorted_indices.reshape(-1), stable=True)
    return rows.to(sorted_indices.dtype).view(sorted_indices.shape), token_id.view(sorted_indices.shape)


# --------------------------------------------------------------------------- routing family


def npu_moe_init_routing(
    x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeInitRouting: sort the (expert, row) pairs by expert; gather rows of x in that order.

    Returns ``expanded_x`` ((min(N, active_num) * K, H)), ``expanded_row_idx`` (for each
    ``row_idx`` value, the row of expanded_x holding it) and ``expanded_expert_idx`` (the sorted
    expert ids). ``row_idx[n, k]`` is conventionally ``k * N + n``; its source row is
    ``row_idx % N``.  Pairs of the same expert keep their position in ``expert_idx`` (row-major:
    ``n * K + k``), not the order of their ``row_idx`` values: the kernel's key-value sort is
    stable over the flattened ids (op-plugin docs, torch_npu-npu_moe_init_routing.md, its
    equivalent numpy: ``argsort(expert_idx.reshape(-1), kind="stable")``).
    """
    n_rows, topk = expert_idx.shape
    total = n_rows * topk
    experts = expert_idx.reshape(-1).long()
    rows = row_idx.reshape(-1).long()
    order = torch.argsort(experts, stable=True)
    sorted_rows = rows[order]
    expanded_expert_idx = experts[order].to(torch.int32)
    expanded_row_idx = torch.zeros(total, dtype=torch.int64, device=x.device)
    positions = torch.arange(total, device=x.device).unsqueeze(1)
    expanded_row_idx = scatter_add_rows(expanded_row_idx.unsqueeze(1), sorted_rows, positions)
    active = min(n_rows, max(active_num, 0)) * topk
    source = torch.remainder(sorted_rows[:active], max(n_rows, 1))
    expanded_x = gather_rows(x, source)
    return expanded_x, expanded_row_idx.view(-1).to(torch.int32), expanded_expert_idx


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
    """aclnnMoeFinalizeRouting:
    ``out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[dst[k * N + i]] + bias[expert[i, k]])``.

    ``drop_pad_mode`` 1 and 3 (drop-pad: capacity C per expert): ``expanded_permuted_rows`` is
    (E, C, H), read as (E * C, H); a ``dst`` of -1 is a dropped token, whose row reads as zeros
    (its bias still counts).  2 and 3 lay ``dst`` out by row (``dst[i * K + k]``) instead of by
    column.  op-plugin docs, torch_npu-npu_moe_finalize_routing.md (the parameter list, the
    equivalent numpy: ``reshape(-1, H)`` and ``value == -1``).
    """
    acc = acc_dtype(expanded_permuted_rows)
    topk = scales.size(1) if scales is not None else max(k or 1, 1)
    dst = expanded_src_to_dst_row.reshape(-1)
    n_rows = dst.numel() // topk
    dst = dst[: n_rows * topk]
    if drop_pad_mode in (2, 3):  # by row: (N, K) -> the by-column (K, N) order
        dst = dst.view(n_rows, topk).T.reshape(-1)
    hidden = expanded_permuted_rows.size(-1)
    table = expanded_permuted_rows.reshape(-1, hidden).to(acc)
    rows = gather_rows(table, dst).view(topk, n_rows, hidden)
    if bias is not None and export_for_source_row is not None:
        experts = export_for_source_row.reshape(n_rows, topk).T  # (K, N)
        rows = rows + gather_rows(bias.to(acc), experts.reshape(-1)).view(topk, n_rows, hidden)
    if scales is not None:
        rows = rows * scales.to(acc).T.unsqueeze(-1)
    out = rows.sum(0)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.to(acc)
    return out.to(expanded_permuted_rows.dtype)


def npu_moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeGatingTopKSoftmax: softmax over experts, top-k; ``row_idx[r, j] = j * R + r``.

    Rows marked ``finished`` get expert id ``E`` (one past the last expert).
    """
    n_experts = x.size(-1)
    flat = x.reshape(-1, n_experts).to(acc_dtype(x))
    n_rows = flat.size(0)
    values, experts = torch.topk(torch.softmax(flat, dim=-1), k, dim=-1)
    if finished is not None:
        done = fit(finished.reshape(-1), n_rows).bool().unsqueeze(1)
        experts = torch.where(done, torch.full_like(experts, n_experts), experts)
    arange_k = torch.arange(k, device=x.device).unsqueeze(0)
    row_idx = arange_k * n_rows + torch.arange(n_rows, device=x.device).unsqueeze(1)
    shape = (*x.shape[:-1], k)
    return (
        values.to(x.dtype).view(shape),
        experts.to(torch.int32).view(shape),
        row_idx.to(torch.int32).view(shape),
    )


def npu_moe_compute_expert_tokens(
    sorted_expert_for_source_row: torch.Tensor, num_expert: int
) -> torch.Tensor:
    """aclnnMoeComputeExpertTokens: for each expert, the end of its rows in the sorted input."""
    ids, valid = safe_index(sorted_expert_for_source_row, num_expert)
    counts = torch.zeros(num_expert, dtype=torch.int64, device=ids.device)
    counts = counts.index_add(0, ids, valid.long())
    return torch.cumsum(counts, 0).to(torch.int32)
