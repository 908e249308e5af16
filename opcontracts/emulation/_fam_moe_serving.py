"""Emulated ops of the moe serving family: vllm-ascend's MoE inference path, one
``EmulatedOp`` entry per op (see ``_family``); their references live in
``opcontracts.reference._fam_moe_serving``.

Schemas are torch_npu 2.14.0's (the wheel digest).  None of these ops has autograd in torch_npu
(they serve, they are not trained through), so none has a backward here.  The dispatch /
combine pair is computed as a simulated world (every rank holding this process's shard): see
the reference module.

Dtypes per tensor argument are what the sources document, the dtype the kernel assumes first;
every profile reads them alike (no source narrows them).  Arguments the kernel does not read in
the emulated modes (``offset``, reserved ``x_active_mask`` / ``expand_scales``, the hash-mode
tensors of gating top-k) are not listed: nothing of them can be misread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..reference import _fam_moe_serving as ref
from ._family import EmulatedOp

__all__ = ["OPS"]

FLOATS = ("bf16", "fp16", "fp32")
HALF = ("bf16", "fp16")
FP32 = ("fp32",)
INT32 = ("int32",)
_F32, _I32, _I64 = torch.float32, torch.int32, torch.int64


def _gating_top_k_softmax_v2_fake(
    x: torch.Tensor, *, k: int = 1, finished: torch.Tensor | None = None,
    renorm: int | None = 0, output_softmax: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], k)
    soft = x.shape if (renorm or 0) == 0 and output_softmax else (0,)
    return x.new_empty(shape), x.new_empty(shape, dtype=_I32), x.new_empty(soft, dtype=_F32)


def _gating_top_k_fake(
    x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
    k_group: int = 1, group_count: int = 1, group_select_mode: int = 0, renorm: int = 0,
    norm_type: int = 0, out_flag: bool = False, routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if input_ids is not None or tid2eid is not None or renorm != 0 or norm_type not in (0, 1):
        raise NotImplementedError("npu_moe_gating_top_k: mode not emulated (see the reference)")
    rows = x.size(0)
    return (x.new_empty((rows, k)), x.new_empty((rows, k), dtype=_I32),
            x.new_empty(x.shape, dtype=_F32))


def _init_routing_v2_fake(
    x: torch.Tensor, expert_idx: torch.Tensor, *, scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None, active_num: int = -1, expert_capacity: int = -1,
    expert_num: int = -1, drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False, quant_mode: int = -1,
    active_expert_range: Sequence[int] | None = None, row_idx_type: int = 0,
    x_dtype: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n_rows, topk = expert_idx.shape
    lo, hi, rows = ref.init_routing_v2_plan(n_rows, topk, active_num, expert_num, drop_pad_mode,
                                            quant_mode, active_expert_range, x_dtype)
    if not expert_tokens_num_flag:
        tokens_shape: tuple[int, ...] = ()
    elif expert_tokens_num_type == 2:
        tokens_shape = (max(expert_num, 0), 2)
    else:
        tokens_shape = (max(hi - lo, 0),)
    x_out = x.dtype if quant_mode == -1 else torch.int8
    return (x.new_empty((rows, x.size(1)), dtype=x_out),
            x.new_empty((n_rows * topk,), dtype=_I32),
            x.new_empty(tokens_shape, dtype=_I64),
            x.new_empty((rows,), dtype=_F32))


def _dispatch_fake(
    x: torch.Tensor, expert_ids: torch.Tensor, group_ep: str, ep_world_size: int,
    ep_rank_id: int, moe_expert_num: int, *, scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None, expert_scales: torch.Tensor | None = None,
    group_tp: str = "", tp_world_size: int = 0, tp_rank_id: int = 0, expert_shard_type: int = 0,
    shared_expert_num: int = 1, shared_expert_rank_num: int = 0, quant_mode: int = 0,
    global_bs: int = 0, expert_token_nums_type: int = 1,
) -> tuple[torch.Tensor, ...]:
    _, local = ref.world("npu_moe_distribute_dispatch", ep_world_size, ep_rank_id,
                         moe_expert_num, tp_world_size, shared_expert_rank_num)
    if quant_mode not in (0, 2) or (scales is not None and quant_mode == 0):
        raise NotImplementedError("npu_moe_distribute_dispatch: mode not emulated")
    bs, topk = expert_ids.shape
    rows = ref.dispatch_rows(bs, topk, moe_expert_num, global_bs, ep_world_size)
    n_recv = ref.recv_counts_len(bs, topk, moe_expert_num, global_bs, ep_world_size,
                                 expert_scales is not None)
    out = x.dtype if quant_mode == 0 else torch.int8
    return (x.new_empty((rows, x.size(1)), dtype=out), x.new_empty((rows,), dtype=_F32),
            x.new_empty((bs * topk,), dtype=_I32), x.new_empty((local,), dtype=_I64),
            x.new_empty((n_recv,), dtype=_I32), x.new_empty((tp_world_size,), dtype=_I32),
            x.new_empty((rows if expert_scales is not None else 0,), dtype=_F32))


def _combine_fake(
    expand_x: torch.Tensor, expert_ids: torch.Tensor, expand_idx: torch.Tensor,
    ep_send_counts: torch.Tensor, expert_scales: torch.Tensor, group_ep: str,
    ep_world_size: int, ep_rank_id: int, moe_expert_num: int, *,
    tp_send_counts: torch.Tensor | None = None, x_active_mask: torch.Tensor | None = None,
    activation_scale: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
    group_list: torch.Tensor | None = None, expand_scales: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None, group_tp: str = "", tp_world_size: int = 0,
    tp_rank_id: int = 0, expert_shard_type: int = 0, shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0, global_bs: int = 0, out_dtype: int = 0,
    comm_quant_mode: int = 0, group_list_type: int = 0,
) -> torch.Tensor:
    ref.world("npu_moe_distribute_combine", ep_world_size, ep_rank_id, moe_expert_num,
              tp_world_size, shared_expert_rank_num)
    if not expand_x.is_floating_point():
        raise NotImplementedError("npu_moe_distribute_combine: an int32 expand_x is not emulated")
    return expand_x.new_empty((expert_ids.size(0), expand_x.size(1)))


def _re_routing_fake(
    tokens: torch.Tensor, expert_token_num_per_rank: torch.Tensor, *,
    per_token_scales: torch.Tensor | None = None, expert_token_num_type: int = 1,
    idx_type: int = 0, tokens_dtype: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if tokens_dtype is not None:
        raise NotImplementedError("npu_moe_re_routing: tokens_dtype is not emulated")
    a = tokens.size(0)
    scales = (per_token_scales.new_empty((a,)) if per_token_scales is not None
              else tokens.new_empty((a,), dtype=_F32))
    return (tokens.new_empty(tokens.shape), scales, tokens.new_empty((a,), dtype=_I32),
            expert_token_num_per_rank.new_empty((expert_token_num_per_rank.size(1),)))


_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"
_OPP = "Ascend/op-plugin master docs/zh/custom_APIs/torch_npu/torch_npu-"

OPS: tuple[EmulatedOp, ...] = (
    EmulatedOp(
        "npu_moe_gating_top_k_softmax_v2",
        fake=_gating_top_k_softmax_v2_fake,
        dtypes={"x": FLOATS, "finished": ("bool",)},
        source=_DOCS,
    ),
    EmulatedOp(
        "npu_moe_gating_top_k",
        fake=_gating_top_k_fake,
        dtypes={"x": FLOATS, "bias": FLOATS},
        source=_DOCS,
    ),
    EmulatedOp(
        "npu_moe_init_routing_v2",
        fake=_init_routing_v2_fake,
        # x: int8 is a pre-quantised input (quant_mode -1), read as it is
        dtypes={"x": (*FLOATS, "int8"), "expert_idx": INT32, "scale": FP32},
        source=_DOCS,
    ),
    EmulatedOp(
        "npu_moe_distribute_dispatch",
        fake=_dispatch_fake,
        dtypes={"x": HALF, "expert_ids": INT32, "scales": FP32, "expert_scales": FP32},
        source=f"{_OPP}npu_moe_distribute_dispatch.md",
    ),
    EmulatedOp(
        "npu_moe_distribute_combine",
        fake=_combine_fake,
        dtypes={"expand_x": HALF, "expert_ids": INT32, "expand_idx": INT32,
                "ep_send_counts": INT32, "expert_scales": FP32},
        source=f"{_OPP}npu_moe_distribute_combine.md",
    ),
    EmulatedOp(
        "npu_moe_re_routing",
        fake=_re_routing_fake,
        # tokens: int8 is the quantised all-to-all output vllm-ascend regroups
        dtypes={"tokens": (*HALF, "int8"), "expert_token_num_per_rank": ("int32", "int64"),
                "per_token_scales": FP32},
        source=f"{_OPP}npu_moe_re_routing.md",
    ),
)
