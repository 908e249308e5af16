"""Reference math of the emulated NPU kernels, in plain PyTorch.

Each function takes the arguments *as the kernel reads them* (``_raw.kernel_view`` has already
reinterpreted wrongly typed ones) and follows the formulas of the CANN aclnn / torch_npu docs.
Floating math runs in fp32 and is cast back to the output dtype.

Index arguments may hold garbage when they were misread; a kernel reading garbage indices
does not raise, so neither do these: out-of-range indices select zero rows and their writes
are dropped.

Conventions (CANN aclnnMoeTokenPermute / aclnnMoeTokenUnpermute):
``sorted_indices[n * K + k]`` is the row of the permuted tokens that holds copy ``k`` of token
``n`` (``argsort(argsort(flatten(indices)))``), so ``unpermute`` reads
``permuted_tokens[sorted_indices[n * K + k]]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "attention_layout_to_bnsd",
    "bnsd_to_attention_layout",
    "npu_fusion_attention",
    "npu_grouped_matmul",
    "npu_moe_compute_expert_tokens",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_moe_token_permute",
    "npu_moe_token_permute_grad",
    "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_unpermute",
    "npu_moe_token_unpermute_grad",
    "npu_moe_token_unpermute_with_routing_map",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "num_out_rows",
    "rotated",
]

_F32 = torch.float32


# --------------------------------------------------------------------------- helpers


def safe_index(idx: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``idx`` as int64 clamped into ``[0, size)`` and the mask of the entries that were in range."""
    idx = idx.reshape(-1).long()
    valid = (idx >= 0) & (idx < size)
    return idx.clamp(0, max(size - 1, 0)), valid


def gather_rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` with rows of out-of-range indices set to zero (no IndexError)."""
    if src.size(0) == 0:
        return src.new_zeros((idx.numel(), *src.shape[1:]))
    safe, valid = safe_index(idx, src.size(0))
    rows = src.index_select(0, safe)
    return rows * valid.view(-1, *([1] * (src.dim() - 1))).to(rows.dtype)


def scatter_add_rows(out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[idx] += rows``, dropping rows whose index is out of range."""
    if out.size(0) == 0:
        return out
    safe, valid = safe_index(idx, out.size(0))
    rows = rows * valid.view(-1, *([1] * (rows.dim() - 1))).to(rows.dtype)
    return out.index_add(0, safe, rows)


def fit(flat: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of 1-D ``flat``, zero-padded when it is shorter."""
    if flat.numel() >= n:
        return flat[:n]
    return torch.cat([flat, flat.new_zeros(n - flat.numel())])


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


# --------------------------------------------------------------------------- MoE permute family


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
    topk = _topk_of(indices)
    n_tokens = tokens.size(0)
    rows = gather_rows(grad_permuted_tokens.to(_F32), sorted_indices)
    owner = torch.arange(rows.size(0), device=rows.device) // topk
    out = rows.new_zeros((n_tokens, grad_permuted_tokens.size(1)))
    out = scatter_add_rows(out, owner, rows)
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
    n_tokens, topk = _unpermute_shape(sorted_indices, probs)
    rows = gather_rows(permuted_tokens.to(_F32), sorted_indices.reshape(-1)[: n_tokens * topk])
    if probs is not None:
        rows = rows * fit(probs.reshape(-1).to(_F32), n_tokens * topk).unsqueeze(1)
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
    n_tokens, topk = _unpermute_shape(sorted_indices, probs)
    dest = sorted_indices.reshape(-1)[: n_tokens * topk]
    grad = fit(grad_unpermuted_tokens.to(_F32).reshape(-1), n_tokens * permuted_tokens.size(1))
    grad_slots = grad.view(n_tokens, 1, -1).expand(n_tokens, topk, -1).reshape(n_tokens * topk, -1)
    weighted = grad_slots
    if probs is not None:
        weighted = grad_slots * fit(probs.reshape(-1).to(_F32), n_tokens * topk).unsqueeze(1)
    grad_permuted = scatter_add_rows(
        torch.zeros(permuted_tokens.shape, dtype=_F32, device=permuted_tokens.device),
        dest,
        weighted,
    ).to(permuted_tokens.dtype)
    if probs is None:
        return grad_permuted, permuted_tokens.new_empty((0,))
    per_slot = (gather_rows(permuted_tokens.to(_F32), dest) * grad_slots).sum(1)
    grad_probs = fit(per_slot, probs.numel()).view(probs.shape).to(probs.dtype)
    return grad_permuted, grad_probs


def routing_map_out_rows(
    tokens_rows: int, routing_map: torch.Tensor, num_out_tokens: int | None, drop_and_pad: bool
) -> int:
    """Rows of the routing-map permute output, as torch_npu's op-plugin sizes them."""
    requested = tokens_rows if num_out_tokens is None else num_out_tokens
    unit = routing_map.size(1 if drop_and_pad else 0)
    return (requested // unit) * unit if unit else 0


def _slot_of_destination(routing_map: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
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
            token_ids[int(mask.sum()):] = n_tokens
        sorted_indices = torch.argsort(token_ids, stable=True).to(torch.int32)
        permuted_probs = (
            fit(probs.T.masked_select(mask.T), rows) if probs is not None else None
        )
    permuted = gather_rows(tokens, token_ids)
    if permuted_probs is None:
        permuted_probs = tokens.new_empty((0,))
    return permuted, permuted_probs.clone(), sorted_indices


def _routing_unpermute_weights(
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None,
    routing_map: torch.Tensor | None,
    drop_and_pad: bool,
    n_rows: int,
) -> torch.Tensor | None:
    """Per permuted row, the prob it is scaled by (None: no scaling)."""
    if probs is None:
        return None
    p = probs.to(_F32)
    if drop_and_pad:
        n_experts = p.size(1)
        ids = sorted_indices.reshape(n_experts, -1).long() if n_experts else sorted_indices
        safe, valid = safe_index(ids, p.size(0))
        return p.T.gather(1, safe.view(n_experts, -1)).reshape(-1) * valid.to(_F32)
    if routing_map is None:  # probs already in permuted order
        return fit(p.reshape(-1), n_rows)
    # probs.T.masked_select(routing_map.T), fitted to n_rows, with static shapes (traceable).
    rank, valid = _slot_of_destination(routing_map, n_rows)
    picked = p.T.reshape(-1) * valid.to(_F32)
    return torch.zeros(n_rows, dtype=_F32, device=p.device).index_add(0, rank, picked)


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
    n_tokens, hidden = int(restore_shape[0]), int(restore_shape[1])
    out = torch.zeros((n_tokens, hidden), dtype=_F32, device=permuted_tokens.device)
    rows_f = permuted_tokens.to(_F32)
    weights = _routing_unpermute_weights(
        sorted_indices, probs, routing_map, drop_and_pad, permuted_tokens.size(0)
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


# --------------------------------------------------------------------------- MoE routing family


def npu_moe_init_routing(
    x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeInitRouting: sort (expert, row) pairs; gather rows of x in that order.

    Returns ``expanded_x`` ((min(N, active_num) * K, H)), ``expanded_row_idx`` (for each
    ``row_idx`` value, the row of expanded_x holding it) and ``expanded_expert_idx`` (the sorted
    expert ids). ``row_idx[n, k]`` is conventionally ``k * N + n``; its source row is
    ``row_idx % N``.
    """
    n_rows, topk = expert_idx.shape
    total = n_rows * topk
    experts = expert_idx.reshape(-1).long()
    rows = row_idx.reshape(-1).long()
    by_row = torch.argsort(rows, stable=True)
    order = by_row[torch.argsort(experts[by_row], stable=True)]
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
    """
    topk = scales.size(1) if scales is not None else max(k or 1, 1)
    dst = expanded_src_to_dst_row.reshape(-1)
    n_rows = dst.numel() // topk
    hidden = expanded_permuted_rows.size(1)
    rows = gather_rows(expanded_permuted_rows.to(_F32), dst[: n_rows * topk]).view(topk, n_rows, hidden)
    if bias is not None and export_for_source_row is not None:
        experts = export_for_source_row.reshape(n_rows, topk).T  # (K, N)
        rows = rows + gather_rows(bias.to(_F32), experts.reshape(-1)).view(topk, n_rows, hidden)
    if scales is not None:
        rows = rows * scales.to(_F32).T.unsqueeze(-1)
    out = rows.sum(0)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.to(_F32)
    return out.to(expanded_permuted_rows.dtype)


def npu_moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeGatingTopKSoftmax: softmax over experts, top-k; ``row_idx[r, j] = j * R + r``.

    Rows marked ``finished`` get expert id ``E`` (one past the last expert).
    """
    n_experts = x.size(-1)
    flat = x.reshape(-1, n_experts).to(_F32)
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


# --------------------------------------------------------------------------- grouped matmul


def group_sizes(group_list: torch.Tensor, group_list_type: int | None, n_groups: int) -> list[int]:
    """Rows per group from ``group_list`` (type 0: cumulative ends; type 1: counts)."""
    values = fit(group_list.reshape(-1).long(), n_groups)
    if group_list_type == 1:
        sizes = values
    else:
        sizes = torch.diff(values, prepend=values.new_zeros(1))
    return [max(int(s), 0) for s in sizes.tolist()]


def grouped_weights(weight: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One (K, N) matrix per group: a single 3-D (E, K, N) weight or a list of 2-D ones."""
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0))
    return list(weight)


def is_grouped(x: Sequence[torch.Tensor], group_type: int | None) -> bool:
    return group_type is not None and group_type >= 0 and len(x) == 1


def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
) -> list[torch.Tensor]:
    """aclnnGroupedMatmulV4, non-quantized: ``y_i = x_i @ w_i (+ b_i)`` per group.

    Two modes. List mode (``group_type`` None/-1, or several x): one matmul per pair.
    Grouped mode (``group_type`` 0, one x of shape (M, K)): rows of x split by
    ``group_list``, group ``g`` multiplied by ``weight[g]`` (a 3-D (E, K, N) weight or a list).
    ``split_item`` 2/3 returns one tensor (concatenated rows; rows past the last group are
    zero), 0/1 one tensor per group. Only group_type 0 (split along M) is emulated.
    """
    ws = grouped_weights(weight)
    bs = list(bias) if bias else []
    if is_grouped(x, group_type):
        if group_type != 0:
            raise NotImplementedError("npu_grouped_matmul emulation supports group_type 0 only")
        xs = x[0]
        if group_list is None:
            sizes = [xs.size(0)] + [0] * (len(ws) - 1)
        else:
            sizes = group_sizes(group_list, group_list_type, len(ws))
        outs: list[torch.Tensor] = []
        start = 0
        for g, w in enumerate(ws):
            stop = min(start + sizes[g], xs.size(0))
            y = xs[start:stop].to(_F32) @ w.to(_F32)
            if g < len(bs):
                y = y + bs[g].to(_F32)
            outs.append(y.to(xs.dtype))
            start = stop
        if split_item in (2, 3):
            n_out = ws[0].size(-1) if ws else 0
            tail = xs.new_zeros((xs.size(0) - start, n_out))
            return [torch.cat([*outs, tail], 0)]
        return outs
    outs = []
    for i, xi in enumerate(x):
        y = xi.to(_F32) @ ws[i].to(_F32)
        if i < len(bs):
            y = y + bs[i].to(_F32)
        outs.append(y.to(xi.dtype))
    if split_item in (2, 3):
        return [torch.cat(outs, 0)]
    return outs


# --------------------------------------------------------------------------- norms, activations


def rms_norm_dims(gamma: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(-gamma.dim(), 0)) if gamma.dim() else (-1,)


def npu_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = x * rstd * gamma``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` over gamma's dims (fp32)."""
    dims = rms_norm_dims(gamma)
    xf = self.to(_F32)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = xf * rstd * gamma.to(_F32)
    return y.to(self.dtype), rstd


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(a) * b`` with ``a, b = chunk(x, 2, dim)``: the size of ``dim`` halves."""
    a, b = self.to(_F32).chunk(2, dim=dim)
    return (F.silu(a) * b).to(self.dtype)


def rotated(x: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    """rotate_half (``'half'``: [-x2, x1]) or rotate_every_two (``'interleave'``)."""
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)
    if rotary_mode == "interleave":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([-odd, even], dim=-1).flatten(-2)
    raise NotImplementedError(f"rotary_mode {rotary_mode!r} is not emulated")


def rotate_transposed(g: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    """The adjoint of :func:`rotated` (used by the backward)."""
    if rotary_mode == "half":
        g1, g2 = g.chunk(2, dim=-1)
        return torch.cat([g2, -g1], dim=-1)
    even, odd = g[..., 0::2], g[..., 1::2]
    return torch.stack([odd, -even], dim=-1).flatten(-2)


def npu_rotary_mul(
    self: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x * cos + rotated(x) * sin`` (``r1`` = cos, ``r2`` = sin, broadcast); ``rotate`` unused."""
    xf = self.to(_F32)
    y = xf * r1.to(_F32) + rotated(xf, rotary_mode) * r2.to(_F32)
    return y.to(self.dtype)


# --------------------------------------------------------------------------- fusion attention


def attention_layout_to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """(B, N, S, D) view of a query/key/value in ``layout`` (``heads`` used for BSH/SBH)."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)
    raise NotImplementedError(f"input_layout {layout!r} is not emulated (BSH, SBH, BSND, BNSD)")


def bnsd_to_attention_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of :func:`attention_layout_to_bnsd`."""
    b, n, s, d = t.shape
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def attention_heads(
    query: torch.Tensor, key: torch.Tensor, head_num: int, layout: str
) -> tuple[int, int]:
    """(query heads, key/value heads); BSH/SBH derive the kv heads from the query head dim."""
    if layout in ("BSH", "SBH"):
        head_dim = query.size(-1) // head_num
        return head_num, key.size(-1) // head_dim
    return query.size(-2 if layout == "BSND" else 1), key.size(-2 if layout == "BSND" else 1)


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    pse: torch.Tensor | None,
    atten_mask: torch.Tensor | None,
    sparse_mode: int,
) -> torch.Tensor:
    """fp32 ``scale * q k^T + pse``, masked positions (mask != 0) set to the fp32 minimum."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if pse is not None:
        scores = scores + pse.to(_F32)
    sq, skv = scores.shape[-2:]
    mask: torch.Tensor | None = None
    if sparse_mode in (2, 3):  # left-up / right-down causal, mask argument is a compressed tile
        offset = 0 if sparse_mode == 2 else skv - sq
        mask = torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(1 + offset)
    elif atten_mask is not None:
        mask = atten_mask != 0
    if mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(_F32).min)
    return scores


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.size(1), dim=1) if t.size(1) != heads else t


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Softmax attention; returns (out, softmax_max, softmax_sum, softmax_in, seed, offset, numels).

    softmax_max / softmax_sum are the real per-row statistics, broadcast to (B, N, Sq, 8) fp32
    as on the NPU; softmax_in is empty and seed/offset/numels are 0. Dropout (keep_prob),
    the token windows (pre/next_tockens) and TND layouts are not emulated.
    """
    heads, _ = attention_heads(query, key, head_num, input_layout)
    q = attention_layout_to_bnsd(query, input_layout, heads).to(_F32)
    k_heads = attention_heads(query, key, head_num, input_layout)[1]
    k = expand_kv(attention_layout_to_bnsd(key, input_layout, k_heads).to(_F32), heads)
    v = expand_kv(attention_layout_to_bnsd(value, input_layout, k_heads).to(_F32), heads)
    scores = attention_scores(q, k, scale, pse, atten_mask, sparse_mode)
    row_max = scores.amax(dim=-1, keepdim=True)
    exp = torch.exp(scores - row_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    out = torch.matmul(exp / row_sum, v)
    out = bnsd_to_attention_layout(out, input_layout).to(query.dtype).contiguous()
    stats_shape = (*row_max.shape[:-1], 8)
    return (
        out,
        row_max.expand(stats_shape).contiguous(),
        row_sum.expand(stats_shape).contiguous(),
        query.new_empty((0,)),
        0,
        0,
        0,
    )
