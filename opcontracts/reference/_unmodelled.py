"""The shipped contract ops that have no reference, and why: ONE entry per op.

Every op a shipped contract names has a reference (the emulation's kernel, the compare's golden
values, the probe's yardstick) unless it is listed here with the reason no honest reference can
be written from its sources, or what a reference would need that they do not give.  A contract
still guards each of these ops (dtypes, shapes, allowed values); what is missing is the
emulated kernel, the shadow compare and the probe.  ``tests/test_reference.py`` and
``tests/test_contract_packs.py`` hold the list to the shipped contracts both ways (an op is
either here or has a reference, never both); ``docs/shipped-ops.md`` shows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["UNMODELLED"]

_ATB_ATTENTION = ("ATB's plugin op (torch.ops.atb), for which the emulation registers no "
                  "kernel: it stands in for torch_npu's npu namespace only; and the op returns "
                  "nothing (it writes `out` in place), which the compare and the probe "
                  "(outputs only) cannot judge")
_MC2 = ("a collective over the group named by hcom: the output is this rank's share of a "
        "result the other ranks' data decide, and the op takes no rank id, so no single-process "
        "reference knows which share")
_OPTIMIZER = ("updates the optimizer state (var, m, v) in place through the .out overload; the "
              "default overload has no var / m / v argument to compute from, and the compare "
              "and the probe judge returned outputs only")
_FLA = ("fla_npu registers this kernel itself (no torch_npu release has it): the emulation does "
        "not stand in for fla_npu, and the chunked gated delta-rule's intermediate layouts "
        "(per-chunk states, corrected values) are the kernel's own, described in its README by "
        "shape only")

UNMODELLED: Mapping[str, str] = MappingProxyType({
    "_npu_dropout": "random: the kernel's own draws decide the output, so no reference can "
                    "match it; the mask is returned in the kernel's bit layout",
    "npu_hans_encode": "lossless compression into the kernel's own pdf / mantissa / fixed / var "
                       "buffers, whose encoding the doc does not define; only the .out "
                       "overload exists",
    "npu_hans_decode": "decodes the buffers of npu_hans_encode, whose encoding the doc does "
                       "not define; only the .out overload exists",
    "npu_apply_adam": _OPTIMIZER,
    "npu_apply_adam_w": _OPTIMIZER,
    "mindspeed.npu_apply_fused_adamw_v2": "updates param, exp_avg, exp_avg_sq (and max_exp_avg_sq) "
                                          "in place; the emulation has no MindSpeed stand-in "
                                          "for it",
    "mindspeed.npu_apply_fused_ema_adamw": "updates param, exp_avg, exp_avg_sq and the EMA copy "
                                           "in place; the emulation has no MindSpeed stand-in "
                                           "for it",
    "mindspeed.npu_alltoall_allgather_bmm": "an AllToAll over the expert-parallel group and an "
                                            "AllGather over the tensor-parallel group, both named "
                                            "by hcomm strings, before the matmul: the output "
                                            "holds other ranks' tokens, and the op takes no rank "
                                            "id, so no single-process reference knows them",
    "mindspeed.npu_bmm_reducescatter_alltoall": "a ReduceScatter over the tensor-parallel group "
                                                "and an AllToAll over the expert-parallel group "
                                                "after the matmul: this rank's output sums and "
                                                "gathers other ranks' products, and the op takes "
                                                "no rank id",
    "npu_mm_reduce_scatter_base": _MC2,
    "npu_mm_all_reduce_base": _MC2 + "; it does not even take the world size",
    "npu_quant_mm_reduce_scatter": _MC2 + "; its fp8 / hifloat8 / MX modes are Ascend 950's",
    "npu_all_gather_quant_mm": "its quantised modes are fp8 / hifloat8 / MX with per-block "
                               "float8_e8m0 scales (Ascend 950), dtypes this torch has no "
                               "kernels for and the doc gives no rounding for",
    "npu_moe_distribute_dispatch_v2": "a multi-rank all-to-all whose assist_info_for_combine "
                                      "and count outputs are laid out for the kernel's own "
                                      "combine; op-plugin's doc gives their sizes, not their "
                                      "contents",
    "npu_moe_distribute_combine_v2": "consumes dispatch_v2's assist_info_for_combine, whose "
                                     "contents the doc does not define",
    "npu_add_quant_matmul_": "fp8 / hifloat8 / MX matmul accumulated in place (Ascend 950): "
                             "no wheel documents it, and op-plugin's doc gives no rounding for "
                             "the float8_e8m0 scale modes",
    "npu_grouped_matmul_add_": "the in-place form of npu_grouped_matmul_add (whose reference is "
                               "shipped): the emulation has no in-place overload, and the "
                               "compare and the probe would judge an output the call computes "
                               "from an input it overwrites",
    "npu_add_quant_gmm_": "fp8 / hifloat8 / MX grouped matmul accumulated in place (Ascend "
                          "950): the doc gives no rounding for the float8_e8m0 scale modes",
    "npu_grouped_dynamic_mx_quant": "the doc's group_index (start indices) and MindSpeed's "
                                    "calls (its grouped matmul's group_list) disagree, and the "
                                    "per-group scale padding of the meta kernel is not "
                                    "described",
    "npu_dynamic_block_mx_quant": "no wheel and no doc describes it: only its schema and meta "
                                  "kernel (output shapes) are public",
    "npu_block_sparse_attention": "the doc does not say how a block of the mask maps onto "
                                  "partial blocks at the sequence ends, nor what "
                                  "inner_precise changes",
    "atb._npu_reshape_and_cache": "the emulation stands in for torch_npu's npu namespace only, "
                                  "not for ATB's plugin (torch.ops.atb); and the op returns "
                                  "nothing (it writes the caches in place), which the compare "
                                  "and the probe (outputs only) cannot judge",
    "atb._npu_paged_attention": _ATB_ATTENTION,
    "atb._npu_paged_attention_mla": _ATB_ATTENTION,
    "atb._npu_flash_attention": _ATB_ATTENTION,
    "atb._npu_flash_attention_unpad": _ATB_ATTENTION,
    "fla_npu.npu_recompute_w_u_fwd": _FLA,
    "fla_npu.npu_chunk_gated_delta_rule_fwd_h": _FLA,
    "fla_npu.npu_chunk_fwd_o": _FLA,
    "fla_npu.npu_chunk_bwd_dv_local": _FLA,
    "fla_npu.npu_chunk_gated_delta_rule_bwd_dhu": _FLA,
    "fla_npu.npu_chunk_bwd_dqkwg": _FLA,
    "fla_npu.npu_prepare_wy_repr_bwd_da": _FLA,
    "fla_npu.npu_prepare_wy_repr_bwd_full": _FLA,
})
"""op name (as contracts name it) -> why it has no reference."""
