"""References of the moe serving family: vllm-ascend's MoE inference ops, the forward
of each in plain PyTorch, and one ``Reference`` entry per op in ``REFERENCES`` (``_table``
appends them).

* ``npu_moe_gating_top_k_softmax_v2``, ``npu_moe_gating_top_k``: the router (softmax or sigmoid,
  grouped top-k, renormalisation);
* ``npu_moe_init_routing_v2``: tokens sorted by expert, with the index, count and scale outputs
  the grouped matmul and ``npu_moe_finalize_routing`` / ``npu_moe_token_unpermute`` consume;
* ``npu_moe_distribute_dispatch`` / ``npu_moe_distribute_combine``: the expert-parallel
  all-to-all pair, computed as a simulated world: the emulation is one process, so the world
  it computes is ``ep_world_size`` ranks that each hold this rank's shard (the only tokens one
  process has).  Rank ``ep_rank_id`` owns experts ``[r*L, (r+1)*L)`` (L = moe_expert_num /
  ep_world_size): dispatch returns the rows every rank sends it, grouped by local expert, then
  by source rank (optionally quantised to int8), with the meta kernel's shapes; combine adds
  each token's rows of the local experts, weighted; the rows of the other ranks' experts live
  in their processes, which one process cannot see, so they add nothing here.  At
  ep_world_size 1 both are exact.  A tensor-parallel domain (tp_world_size 2) and
  shared-expert ranks raise ``NotImplementedError``;
* ``npu_moe_re_routing``: tokens received rank-major regrouped expert-major.

Formulas: torch_npu 2.14.0 ``_op_plugin_docs.py`` and meta kernels (output shapes and dtypes),
the torch_npu API docs of Ascend/op-plugin (``docs/zh/custom_APIs/torch_npu/``, the ops without
a docstring in the wheels), the CANN aclnn docs (aclnnMoeGatingTopK, aclnnMoeDistributeDispatch)
and op-plugin's CPU goldens (``test/test_custom_ops/test_npu_moe_init_routing_v2.py``,
``..._gating_top_k_softmax_v2.py``).  Modes the sources leave undefined or that are not emulated
(drop-pad, static and MX quantisation, hash routing, packed ``x_dtype`` / ``tokens_dtype``)
raise ``NotImplementedError``; outputs the docs call undefined (rows past the valid ones, scales
without a scale input) are zeros here.  None of these ops is trained through (torch_npu has no
autograd for them), so none has a backward.  Index arguments may hold garbage (a misread
buffer): the references never raise on it, out-of-range indices select nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._entry import Reference
from ._examples import E, Example, H, K, N, _experts, _probs, _vals
from ._util import acc_dtype, fit, gather_rows, safe_index, scatter_add_rows

__all__ = [
    "REFERENCES",
    "dispatch_rows",
    "init_routing_v2_plan",
    "npu_moe_distribute_combine",
    "npu_moe_distribute_dispatch",
    "npu_moe_gating_top_k",
    "npu_moe_gating_top_k_softmax_v2",
    "npu_moe_init_routing_v2",
    "names_int8",
    "npu_moe_re_routing",
    "recv_counts_len",
    "world",
]

_F32 = torch.float32
_I32 = torch.int32
_I64 = torch.int64


def _sort_desc(v: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` largest values per row, ties to the lower index (a stable sort,
    as the kernels' goldens use)."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]


def _by_expert(ids: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For flat expert ids: the stable order that sorts the ids in ``[lo, hi)`` by expert and,
    in that order, which entries are valid.  The others follow as the kernel sorts them
    (op-plugin's init_routing_v2 golden): ids at or past ``hi`` by id, then those below ``lo``
    (sorted as the largest int), each in position order."""
    ids = ids.reshape(-1).long()
    valid = (ids >= lo) & (ids < hi)
    key = torch.where(ids >= lo, ids, torch.full_like(ids, torch.iinfo(torch.int64).max))
    order = torch.argsort(key, stable=True)
    return order, valid[order]


def _counts(ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """int64 number of entries per expert of ``[lo, hi)``."""
    n = max(hi - lo, 0)
    safe, valid = safe_index(ids.reshape(-1).long() - lo, n)
    return torch.zeros(n, dtype=_I64, device=ids.device).index_add(0, safe, valid.long())


def _dynamic_quant(rows: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantisation in fp32: ``scale = max|row| / 127``,
    ``q = round(row / scale)``; rows that are not valid (or all zero) give zeros."""
    amax = rows.abs().amax(dim=-1)
    scale = torch.where(valid, amax / 127.0, torch.zeros_like(amax))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / safe.unsqueeze(-1)).clamp(-128, 127)
    q = torch.where((scale > 0).unsqueeze(-1), q, torch.zeros_like(q))
    return q.to(torch.int8), scale


# --------------------------------------------------------------------------- gating


def npu_moe_gating_top_k_softmax_v2(
    x: torch.Tensor,
    *,
    k: int = 1,
    finished: torch.Tensor | None = None,
    renorm: int | None = 0,
    output_softmax: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeGatingTopKSoftmaxV2: ``renorm`` 0 takes the top-k of ``softmax(x)``; 1 takes the
    top-k of ``x`` and softmaxes those k values.  Rows marked ``finished`` get expert id ``E``.
    The third output is the full softmax (fp32, x's shape) when ``renorm`` is 0 and
    ``output_softmax`` is set, else an empty fp32 tensor (op-plugin's golden; the 2.14.0 meta
    kernel's shape for 3-D x tests ``x.dim == 3`` without calling it and always says 2-D)."""
    n_experts = x.size(-1)
    flat = x.reshape(-1, n_experts).to(acc_dtype(x))
    soft = torch.softmax(flat, dim=-1)
    if renorm == 1:
        idx = _sort_desc(flat, k)
        y = torch.softmax(flat.gather(1, idx), dim=-1)
    else:
        idx = _sort_desc(soft, k)
        y = soft.gather(1, idx)
    if finished is not None:
        done = fit(finished.reshape(-1), flat.size(0)).bool().unsqueeze(1)
        idx = torch.where(done, torch.full_like(idx, n_experts), idx)
    shape = (*x.shape[:-1], k)
    if (renorm or 0) == 0 and output_softmax:
        softmax_out = soft.to(_F32).view(x.shape)
    else:
        softmax_out = x.new_empty((0,), dtype=_F32)
    return y.to(x.dtype).view(shape), idx.to(_I32).view(shape), softmax_out


def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeGatingTopK: ``norm = softmax(x)`` (norm_type 0) or ``sigmoid(x)`` (1); experts
    are chosen on ``norm + bias``: with ``group_count`` > 1 the experts split into groups scored
    by their max (group_select_mode 0) or the sum of their top two (1), only the ``k_group``
    best groups stay; the top-k experts give ``y = norm[expert]``, then
    ``y / (sum(y) + eps) * routed_scaling_factor``.  Outputs: y (x's dtype), expert ids (int32),
    ``norm`` (fp32, x's shape).  Hash mode (``input_ids`` / ``tid2eid``) and renorm 1 are not
    emulated."""
    if input_ids is not None or tid2eid is not None:
        raise NotImplementedError("npu_moe_gating_top_k: hash mode (input_ids/tid2eid) is not "
                                  "emulated")
    if renorm != 0:
        raise NotImplementedError("npu_moe_gating_top_k: renorm must be 0 (the only mode the "
                                  "torch_npu docs support)")
    if norm_type not in (0, 1):
        raise NotImplementedError(f"npu_moe_gating_top_k: norm_type {norm_type} is not emulated")
    xf = x.to(acc_dtype(x))
    norm = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    choose = norm + bias.to(norm.dtype) if bias is not None else norm
    if group_count > 1:
        grouped = choose.reshape(choose.size(0), group_count, -1)
        if group_select_mode == 0:
            score = grouped.amax(dim=-1)
        else:
            score = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter(1, _sort_desc(score, k_group),
                                                                 True)
        grouped = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf"))
        choose = grouped.reshape(choose.shape)
    idx = _sort_desc(choose, k)
    y = norm.gather(1, idx)
    y = y / (y.sum(dim=-1, keepdim=True) + eps) * routed_scaling_factor
    # norm_out is a buffer of its own (y is computed from it; sharing the tensor would tie
    # the outputs' autograd nodes together)
    return y.to(x.dtype), idx.to(_I32), norm.to(_F32, copy=True)


# --------------------------------------------------------------------------- init routing v2


def init_routing_v2_plan(
    n_rows: int, topk: int, active_num: int, expert_num: int, drop_pad_mode: int,
    quant_mode: int, active_expert_range: Sequence[int] | None, x_dtype: int | None,
) -> tuple[int, int, int]:
    """(first expert, end of the expert range, output rows) of an init_routing_v2 call, or
    ``NotImplementedError`` for what is not emulated.  The fake shares it."""
    if drop_pad_mode != 0:
        raise NotImplementedError("npu_moe_init_routing_v2: drop_pad_mode 1 is not emulated (the "
                                  "torch_npu docs support 0 only)")
    if quant_mode not in (-1, 1):
        raise NotImplementedError(f"npu_moe_init_routing_v2: quant_mode {quant_mode} is not "
                                  "emulated (the torch_npu docs support -1 and 1)")
    if x_dtype is not None and not names_int8(x_dtype):
        raise NotImplementedError(f"npu_moe_init_routing_v2: x_dtype {x_dtype!r} (packed fp4/fp8 "
                                  "inputs) is not emulated; int8 (already quantised x, or the "
                                  "quantised output) is")
    if active_expert_range:
        lo, hi = int(active_expert_range[0]), int(active_expert_range[1])
    elif expert_num > 0:
        lo, hi = 0, expert_num
    else:
        raise ValueError("npu_moe_init_routing_v2: give expert_num or active_expert_range")
    total = n_rows * topk
    rows = total if active_num <= 0 else min(active_num, total)
    return lo, hi, rows


_INT8_CODE = 1  # c10::ScalarType::Char: what an ``int? x_dtype`` schema receives for torch.int8


def names_int8(x_dtype: object) -> bool:
    """Whether ``x_dtype`` says int8: ``torch.int8`` from Python, or its ScalarType code through
    the ``int? x_dtype`` schema.  vllm-ascend passes it for int8 tokens (its W8A8 All2AllV
    dispatch, x already int8) and for an int8 quantised output; either way the computation is
    the one without it."""
    return x_dtype is torch.int8 or (type(x_dtype) is int and x_dtype == _INT8_CODE)


def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: Sequence[int] | None = None,
    row_idx_type: int = 0,
    x_dtype: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeInitRoutingV2/V3, dropless: the (row, k) pairs whose expert lies in
    ``active_expert_range`` (default ``[0, expert_num)``), stably sorted by expert.

    * ``expanded_x`` (rows, H): ``x[row]`` in that order (rows = N*K, or ``active_num`` when
      it is positive and smaller), zero past the valid pairs; quant_mode 1 quantises each row
      to int8 (after multiplying by ``scale[expert - start]``, or ``scale[0]`` for a (1, H)
      scale);
    * ``expanded_row_idx`` (N*K,) int32: row_idx_type 0 maps each pair ``n*K + k`` to its row
      (-1 when out of range), 1 lists the pair of each row;
    * ``expert_token_cumsum_or_count`` int64: per expert of the range its count
      (expert_tokens_num_type 1) or their running sum (0), or (expert_num, 2) pairs
      (expert, count) of the experts with tokens, then zeros (2); a 0-d tensor without
      ``expert_tokens_num_flag`` (the meta kernel's shape);
    * ``expanded_scale`` (rows,) fp32: ``scale[row]`` (quant_mode -1 with a (N,) scale) or the
      quantisation scale (quant_mode 1); zeros otherwise.
    ``offset`` and ``expert_capacity`` are not used in the modes the docs support."""
    n_rows, topk = expert_idx.shape
    lo, hi, rows = init_routing_v2_plan(n_rows, topk, active_num, expert_num, drop_pad_mode,
                                        quant_mode, active_expert_range, x_dtype)
    if quant_mode == 1 and not x.is_floating_point():
        raise NotImplementedError("npu_moe_init_routing_v2: an int8 x takes quant_mode -1 only")
    total = n_rows * topk
    order, valid_sorted = _by_expert(expert_idx, lo, hi)
    src = order[:rows] // max(topk, 1)
    valid = valid_sorted[:rows]
    gathered = gather_rows(x, src)
    expanded_x = torch.where(valid.view(-1, 1), gathered, torch.zeros_like(gathered))
    pos = torch.arange(total, device=x.device)
    if row_idx_type == 1:
        expanded_row_idx = order.to(_I32)
    else:
        dest = torch.where(valid_sorted, pos, torch.full_like(pos, -1))
        expanded_row_idx = torch.empty_like(pos).scatter(0, order, dest).to(_I32)
    ids = expert_idx.reshape(-1).long()
    counts = _counts(ids, lo, hi)
    if not expert_tokens_num_flag:
        tokens_out = x.new_zeros((), dtype=_I64)
    elif expert_tokens_num_type == 2:
        pairs = torch.stack([torch.arange(lo, hi, device=x.device), counts], dim=1)
        nonzero = counts > 0
        slot = torch.where(nonzero, torch.cumsum(nonzero.long(), 0) - 1,
                           torch.full_like(counts, max(expert_num, 0)))
        tokens_out = scatter_add_rows(x.new_zeros((max(expert_num, 0), 2), dtype=_I64), slot,
                                      pairs)
    elif expert_tokens_num_type == 0:
        tokens_out = torch.cumsum(counts, 0)
    else:
        tokens_out = counts
    expanded_scale = x.new_zeros((rows,), dtype=_F32)
    if quant_mode == 1:
        fx = expanded_x.to(_F32)
        if scale is not None and fx.numel():  # no rows (an empty x): nothing to smooth
            if scale.size(0) == 1:
                smooth = scale.to(_F32)[0].expand_as(fx)
            else:
                expert = ids[order[:rows]] - lo
                smooth = gather_rows(scale.to(_F32), expert)
            fx = fx * smooth
        expanded_x, expanded_scale = _dynamic_quant(fx, valid)
    elif scale is not None:
        expanded_scale = torch.where(valid, gather_rows(scale.to(_F32).reshape(-1), src),
                                     expanded_scale)
    return expanded_x, expanded_row_idx, tokens_out, expanded_scale


# --------------------------------------------------------------------------- dispatch / combine


def world(op: str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int,
          tp_world_size: int, shared_expert_rank_num: int) -> tuple[int, int]:
    """(first local expert, local expert count L) of rank ``ep_rank_id`` in the simulated world,
    or ``NotImplementedError`` for what it does not compute."""
    if tp_world_size > 1 or shared_expert_rank_num != 0:
        raise NotImplementedError(
            f"{op}: the simulated world has no tensor-parallel domain and no shared-expert ranks "
            f"(got tp_world_size {tp_world_size}, shared_expert_rank_num "
            f"{shared_expert_rank_num})")
    if ep_world_size < 1 or moe_expert_num % ep_world_size or not 0 <= ep_rank_id < ep_world_size:
        raise NotImplementedError(
            f"{op}: moe_expert_num {moe_expert_num} over ep_world_size {ep_world_size} ranks "
            f"(rank {ep_rank_id}): the experts must split evenly and the rank exist")
    local = moe_expert_num // ep_world_size
    return ep_rank_id * local, local


def dispatch_rows(bs: int, topk: int, moe_expert_num: int, global_bs: int,
                  ep_world_size: int = 1) -> int:
    """``A``, the rows dispatch returns (the meta kernel's formula): ``global_bs * min(local
    experts, K)``, global_bs defaulting to BS * ep_world_size."""
    real_bs = bs * ep_world_size if global_bs == 0 else global_bs
    return real_bs * min(moe_expert_num // max(ep_world_size, 1), topk)


def recv_counts_len(bs: int, topk: int, moe_expert_num: int, global_bs: int,
                    ep_world_size: int, with_expert_scales: bool) -> int:
    """The length of ``ep_recv_counts`` (the meta kernel's formula): ep_world_size * L, plus
    ``global_bs * 2 * K * (ep_world_size // 8)`` with expert_scales."""
    n = moe_expert_num  # ep_world_size * L
    if with_expert_scales:
        real_bs = bs * ep_world_size if global_bs == 0 else global_bs
        n += real_bs * 2 * topk * (ep_world_size // 8)
    return n


def npu_moe_distribute_dispatch(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
) -> tuple[torch.Tensor, ...]:
    """aclnnMoeDistributeDispatch in the simulated world (module docstring): rank r receives
    from each of the ``ep_world_size`` ranks (all holding this shard) the (token, k) pairs of
    its local experts, so ``expand_x`` (A, H) holds, per local expert and then per source rank,
    ``x[token]`` of this shard's pairs of that expert in stable order (zero past the valid
    rows), int8 with per-row ``dynamic_scales = max|x * scales[e]| / 127`` for quant_mode 2;
    ``expand_idx[n*K + k]`` is the pair's position among the shard's pairs of its expert (the
    row combine reads back in the owner's block for this source rank); ``expert_token_nums``
    (L,) int64 counts (type 1) or running sums (0); ``ep_recv_counts`` int32 running sums of
    the (expert, source rank) blocks, zero-padded to the meta kernel's length;
    ``tp_recv_counts`` (tp_world_size,) zeros; ``expand_scales`` the rows' ``expert_scales``,
    (A,) fp32 when given, else empty.  At ep_world_size 1 this is the local sort by expert.
    ``x_active_mask`` is a reserved argument in the torch_npu docs and is ignored."""
    lo, local = world("npu_moe_distribute_dispatch", ep_world_size, ep_rank_id, moe_expert_num,
                      tp_world_size, shared_expert_rank_num)
    if quant_mode not in (0, 2) or (scales is not None and quant_mode == 0):
        raise NotImplementedError("npu_moe_distribute_dispatch: quant_mode 0 without scales and "
                                  "2 are emulated")
    bs, topk = expert_ids.shape
    rows = dispatch_rows(bs, topk, moe_expert_num, global_bs, ep_world_size)
    ids = expert_ids.reshape(-1).long()
    local_order, _ = _by_expert(ids, lo, lo + local)
    local_counts = _counts(ids, lo, lo + local)
    # the pairs of each local expert, repeated once per source rank: (expert, rank) blocks
    pieces, starts_e = [], torch.cumsum(local_counts, 0) - local_counts
    for e in range(local):
        block = local_order[int(starts_e[e]):int(starts_e[e]) + int(local_counts[e])]
        pieces.extend([block] * ep_world_size)
    picked_pairs = torch.cat(pieces) if pieces else ids.new_empty((0,))
    valid = fit(torch.ones_like(picked_pairs, dtype=torch.bool), rows)
    order = fit(picked_pairs, rows)
    gathered = gather_rows(x, torch.where(valid, order // max(topk, 1), torch.full_like(order, -1)))
    expand_x = torch.where(valid.view(-1, 1), gathered, torch.zeros_like(gathered))
    dynamic_scales = x.new_zeros((rows,), dtype=_F32)
    if quant_mode == 2:
        fx = expand_x.to(_F32)
        if scales is not None:  # (experts, H) smoothing scales, by the row's expert
            fx = fx * gather_rows(scales.to(_F32), torch.where(valid, ids[order], -1))
        expand_x, dynamic_scales = _dynamic_quant(fx, valid)
    counts = _counts(ids, 0, moe_expert_num)  # every expert's pairs of this shard
    full_order, _ = _by_expert(ids, 0, moe_expert_num)
    starts = torch.cumsum(counts, 0) - counts
    inv = torch.argsort(full_order)  # each pair's position in the sorted order
    e_safe, e_valid = safe_index(ids, moe_expert_num)
    expand_idx = torch.where(e_valid, inv - starts[e_safe], torch.full_like(ids, -1)).to(_I32)
    received = local_counts * ep_world_size
    expert_token_nums = torch.cumsum(received, 0) if expert_token_nums_type == 0 else received
    blocks = local_counts.repeat_interleave(ep_world_size)
    n_recv = recv_counts_len(bs, topk, moe_expert_num, global_bs, ep_world_size,
                             expert_scales is not None)
    ep_recv_counts = fit(torch.cumsum(blocks, 0).to(_I32), n_recv)
    tp_recv_counts = x.new_zeros((tp_world_size,), dtype=_I32)
    if expert_scales is not None:
        flat_scales = expert_scales.to(_F32).reshape(-1)
        picked = gather_rows(flat_scales, torch.where(valid, order, torch.full_like(order, -1)))
        expand_scales = torch.where(valid, picked, torch.zeros_like(picked))
    else:
        expand_scales = x.new_empty((0,), dtype=_F32)
    return (expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts,
            tp_recv_counts, expand_scales)


def npu_moe_distribute_combine(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    expand_idx: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    activation_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    group_list: torch.Tensor | None = None,
    expand_scales: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    out_dtype: int = 0,
    comm_quant_mode: int = 0,
    group_list_type: int = 0,
) -> torch.Tensor:
    """aclnnMoeDistributeCombine in the simulated world (module docstring): ``out[n] =
    sum_k expert_scales[n, k] * expand_x[start(e, r) + expand_idx[n*K + k]]`` over the pairs
    whose expert ``e = expert_ids[n, k]`` is local to rank r, ``start(e, r)`` the start of the
    (expert, source rank r) block read from ``ep_send_counts`` (dispatch's running sums); the
    other ranks' experts add nothing (their rows are in other processes).  (BS, H) in
    expand_x's dtype, math in fp32; exact at ep_world_size 1.  The reserved arguments
    (x_active_mask, activation_scale, weight_scale, group_list, shared_expert_x, out_dtype,
    group_list_type) and expand_scales are not read; comm_quant_mode 2 (int8 communication) is
    computed exactly."""
    lo, local = world("npu_moe_distribute_combine", ep_world_size, ep_rank_id, moe_expert_num,
                      tp_world_size, shared_expert_rank_num)
    if not expand_x.is_floating_point():
        raise NotImplementedError("npu_moe_distribute_combine: an int32 expand_x (out_dtype) is "
                                  "not emulated")
    acc = acc_dtype(expand_x)
    bs, topk = expert_ids.shape
    ids = expert_ids.reshape(-1).long()
    is_local = (ids >= lo) & (ids < lo + local)
    block = (ids - lo) * ep_world_size + ep_rank_id
    ends = ep_send_counts.reshape(-1).long()
    b_safe, b_valid = safe_index(block - 1, ends.numel())
    start = torch.where(b_valid & (block >= 1), ends[b_safe], torch.zeros_like(ids))
    row = start + fit(expand_idx.reshape(-1).long(), ids.numel())
    row = torch.where(is_local, row, torch.full_like(row, -1))
    picked = gather_rows(expand_x.to(acc), row)
    weights = fit(expert_scales.reshape(-1).to(acc), ids.numel())
    out = (picked * weights.unsqueeze(1)).view(bs, topk, -1).sum(1)
    return out.to(expand_x.dtype)


# --------------------------------------------------------------------------- re-routing


def npu_moe_re_routing(
    tokens: torch.Tensor,
    expert_token_num_per_rank: torch.Tensor,
    *,
    per_token_scales: torch.Tensor | None = None,
    expert_token_num_type: int = 1,
    idx_type: int = 0,
    tokens_dtype: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """aclnnMoeReRouting: ``tokens`` (A, H) arrive rank-major (for rank i, expert j,
    ``expert_token_num_per_rank[i, j]`` consecutive tokens); the output is expert-major (for
    expert j, rank i).  Returns the regrouped tokens and ``per_token_scales`` (fp32 ones when
    absent), ``permute_token_idx`` (int32: per output row its source row for idx_type 0, per
    source row its output row for 1) and ``expert_token_num`` (E,) in the counts' dtype (counts,
    or running sums for expert_token_num_type 0).  Rows past ``sum(counts)`` read nothing."""
    if tokens_dtype is not None:
        raise NotImplementedError("npu_moe_re_routing: tokens_dtype (hifloat8/fp4 tokens) is not "
                                  "emulated")
    a = tokens.size(0)
    counts = expert_token_num_per_rank.long().clamp(min=0, max=a)  # garbage never allocates
    n_ranks, n_experts = counts.shape
    src_start = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(n_ranks,
                                                                                n_experts)
    seg_len = counts.T.reshape(-1)  # expert-major segments (j, i)
    seg_end = torch.cumsum(seg_len, 0)
    pos = torch.arange(a, device=tokens.device)
    seg = torch.searchsorted(seg_end, pos, right=True)
    seg_safe, seg_valid = safe_index(seg, seg_len.numel())
    within = pos - (seg_end[seg_safe] - seg_len[seg_safe])
    src = src_start.T.reshape(-1)[seg_safe] + within
    src = torch.where(seg_valid, src, torch.full_like(src, -1))
    permute_tokens = gather_rows(tokens, src)
    if per_token_scales is not None:
        permute_scales = gather_rows(per_token_scales.reshape(-1), src)
    else:
        permute_scales = torch.ones(a, dtype=_F32, device=tokens.device)
    if idx_type == 1:  # scatter form: per source row, its output row (-1: none)
        safe, ok = safe_index(src, a)
        slot = torch.where(ok, safe, torch.full_like(safe, a))
        idx = torch.full((a + 1,), -1, dtype=_I64, device=tokens.device).scatter(0, slot, pos)[:a]
    else:
        idx = src
    per_expert = counts.sum(0)
    if expert_token_num_type == 0:
        per_expert = torch.cumsum(per_expert, 0)
    return (permute_tokens, permute_scales, idx.to(_I32),
            per_expert.to(expert_token_num_per_rank.dtype))


# --------------------------------------------------------------------------- examples


def _idx32(gen: torch.Generator) -> torch.Tensor:
    return _experts(gen, torch.int32)


def gating_v2_example(gen: torch.Generator) -> Example:
    finished = torch.tensor([False, True, False, False])
    return (_vals(gen, N, E),), {"k": K, "finished": finished, "renorm": 0,
                                 "output_softmax": True}


def gating_example(gen: torch.Generator) -> Example:
    experts = 8  # two groups of four: group_count divides E and E / group_count > 2
    return (_vals(gen, N, experts), K), {
        "bias": _vals(gen, experts) / 8, "k_group": 1, "group_count": 2,
        "group_select_mode": 1, "norm_type": 1, "routed_scaling_factor": 2.5}


def init_routing_v2_example(gen: torch.Generator) -> Example:
    # quant_mode -1 with the (N,) scale, so every tensor the kernel reads is given; offset is
    # not passed (the docs: not used in the supported modes)
    return (_vals(gen, N, H), _idx32(gen)), {
        "scale": _probs(gen, N).float(), "active_num": N * K, "expert_num": E,
        "expert_tokens_num_type": 1, "expert_tokens_num_flag": True, "quant_mode": -1,
        "active_expert_range": [0, E], "row_idx_type": 0}


_HD = 32  # dispatch/combine: the docs want H a multiple of 32


def dispatch_example(gen: torch.Generator) -> Example:
    # quant_mode 2 with scales: every tensor the kernel reads is given
    return (_vals(gen, N, _HD), _idx32(gen), "ep0", 1, 0, E), {
        "scales": (_probs(gen, E, _HD) * 2).float(), "expert_scales": _probs(gen, N, K).float(),
        "quant_mode": 2, "expert_token_nums_type": 1}


def combine_example(gen: torch.Generator) -> Example:
    x, ids = _vals(gen, N, _HD), _idx32(gen)
    expand_x, _, expand_idx, _, counts, _, expand_scales = npu_moe_distribute_dispatch(
        x, ids, "ep0", 1, 0, E, expert_scales=_probs(gen, N, K).float())
    return (expand_x, ids, expand_idx, counts, _probs(gen, N, K).float(), "ep0", 1, 0, E), {
        "expand_scales": expand_scales}


def re_routing_example(gen: torch.Generator) -> Example:
    ranks, experts = 2, E
    counts = torch.randint(0, 3, (ranks, experts), generator=gen)
    a = int(counts.sum())
    return (_vals(gen, a, H), counts.to(torch.int32)), {
        "per_token_scales": _probs(gen, a).float(), "expert_token_num_type": 1, "idx_type": 0}


_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py and _meta_registrations.py"
_OPP = "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-"

REFERENCES: tuple[Reference, ...] = (
    Reference("npu_moe_gating_top_k_softmax_v2", npu_moe_gating_top_k_softmax_v2,
              example=gating_v2_example,
              source=f"{_DOCS}; op-plugin test_npu_moe_gating_top_k_softmax_v2.py (golden)"),
    Reference("npu_moe_gating_top_k", npu_moe_gating_top_k, example=gating_example,
              source=f"{_DOCS}; CANN aclnnMoeGatingTopK"),
    Reference("npu_moe_init_routing_v2", npu_moe_init_routing_v2,
              example=init_routing_v2_example,
              source=f"{_DOCS}; op-plugin test_npu_moe_init_routing_v2.py (golden)"),
    Reference("npu_moe_distribute_dispatch", npu_moe_distribute_dispatch,
              example=dispatch_example,
              source=f"{_OPP}npu_moe_distribute_dispatch.md; CANN aclnnMoeDistributeDispatch "
                     "(ep_world_size 1)"),
    Reference("npu_moe_distribute_combine", npu_moe_distribute_combine,
              example=combine_example,
              source=f"{_OPP}npu_moe_distribute_combine.md (ep_world_size 1)"),
    Reference("npu_moe_re_routing", npu_moe_re_routing, example=re_routing_example,
              source=f"{_OPP}npu_moe_re_routing.md"),
)
