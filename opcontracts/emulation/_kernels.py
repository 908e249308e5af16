"""The emulated kernels' math: the references of ``opcontracts.reference``, re-exported.

The emulation is "the reference plus a dtype profile": ``_ops`` registers each reference as the
op's CPU kernel, entered through ``_raw.kernel_view`` so that an argument in a dtype the active
profile does not support is misread first, as on the NPU.  This module only gathers the names
(the kernels by op name, and the helpers the fakes and backward formulas share) so the rest of
the emulation has one place to import them from; the math lives in ``opcontracts.reference``.
"""

from __future__ import annotations

from ..reference._attention import (
    attention_heads,
    attention_layout_to_bnsd,
    attention_scores,
    bnsd_to_attention_layout,
    expand_kv,
    npu_fusion_attention,
)
from ..reference._matmul import group_sizes, grouped_weights, is_grouped, npu_grouped_matmul
from ..reference._moe import (
    npu_moe_compute_expert_tokens,
    npu_moe_finalize_routing,
    npu_moe_gating_top_k_softmax,
    npu_moe_init_routing,
    npu_moe_token_permute,
    npu_moe_token_permute_grad,
    npu_moe_token_permute_with_routing_map,
    npu_moe_token_unpermute,
    npu_moe_token_unpermute_grad,
    npu_moe_token_unpermute_with_routing_map,
    num_out_rows,
    routing_map_out_rows,
)
from ..reference._norm import npu_rms_norm, npu_rotary_mul, npu_swiglu, rms_norm_dims, rotated
from ..reference._util import fit, gather_rows, safe_index, scatter_add_rows

__all__ = [
    "attention_heads",
    "attention_layout_to_bnsd",
    "attention_scores",
    "bnsd_to_attention_layout",
    "expand_kv",
    "fit",
    "gather_rows",
    "group_sizes",
    "grouped_weights",
    "is_grouped",
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
    "rms_norm_dims",
    "rotated",
    "routing_map_out_rows",
    "safe_index",
    "scatter_add_rows",
]
