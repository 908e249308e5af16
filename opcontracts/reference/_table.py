"""The shipped references: ONE entry per op (see the package docstring for how to add one)."""

from __future__ import annotations

from . import (
    _examples,
    _fam_attention,
    _fam_attention_v3,
    _fam_gemm_comm,
    _fam_misc,
    _fam_moe_serving,
    _fam_norm_quant,
    _fam_quant_prep,
    _grads,
    _matmul,
    _mindspeed,
    _moe,
    _norm,
)
from ._entry import Reference

_DOCS = "torch_npu 2.13/2.14 _op_plugin_docs.py"
_MS = "MindSpeed master, docs/ops/"
_RM_GRAD_SOURCE = (
    "CANN aclnnMoeTokenPermuteWithRoutingMapGrad / aclnnMoeTokenUnpermuteWithRoutingMapGrad "
    "(cann/ops-transformer moe/*_with_routing_map_grad docs); Ascend/op-plugin "
    "op_plugin/ops/opapi/MoeToken*WithRoutingMapGrad*OpApi.cpp (output allocations), "
    "op_plugin/config/derivatives.yaml")

SHIPPED: tuple[Reference, ...] = (
    # MoE permute family (CANN aclnnMoeTokenPermute / aclnnMoeTokenUnpermute)
    Reference("npu_moe_token_permute", _moe.npu_moe_token_permute,
              example=_examples.permute, source=f"{_DOCS}; CANN aclnnMoeTokenPermute"),
    Reference("npu_moe_token_permute_grad", _moe.npu_moe_token_permute_grad,
              example=_examples.permute_grad, grad_of="npu_moe_token_permute",
              source=f"{_DOCS} (derivatives of npu_moe_token_permute)"),
    Reference("npu_moe_token_unpermute", _moe.npu_moe_token_unpermute,
              example=_examples.unpermute, source=f"{_DOCS}; CANN aclnnMoeTokenUnpermute"),
    Reference("npu_moe_token_unpermute_grad", _moe.npu_moe_token_unpermute_grad,
              example=_examples.unpermute_grad, grad_of="npu_moe_token_unpermute",
              source=f"{_DOCS} (derivatives of npu_moe_token_unpermute)"),
    # the ops later releases route them through (opcontracts.emulation._release)
    Reference("_npu_moe_token_unpermute", _moe._npu_moe_token_unpermute,
              example=_examples.internal_unpermute,
              source=f"{_DOCS} (npu_moe_token_unpermute's kernel; torch_npu 2.13.0 "
                     "npu_native_functions_by_codegen.yaml)"),
    Reference("npu_moe_token_unpermute_grad_v2", _moe.npu_moe_token_unpermute_grad_v2,
              example=_examples.unpermute_grad_v2, grad_of="npu_moe_token_unpermute",
              source=f"{_DOCS} (torch_npu 2.13.0 Functions.h: NpuMoeTokenUnpermuteBackward0)"),
    Reference("npu_moe_token_permute_grad_v2", _moe.npu_moe_token_permute_grad_v2,
              example=_examples.permute_grad_v2, grad_of="npu_moe_token_permute",
              source=f"{_DOCS} (torch_npu 2.12.0 Functions.h: NpuMoeTokenPermuteBackward0)"),
    Reference("npu_moe_token_permute_with_routing_map",
              _moe.npu_moe_token_permute_with_routing_map,
              backward=_grads.permute_with_routing_map_backward,
              example=_examples.permute_routing,
              source=f"{_DOCS}; CANN aclnnMoeTokenPermuteWithRoutingMap"),
    Reference("npu_moe_token_unpermute_with_routing_map",
              _moe.npu_moe_token_unpermute_with_routing_map,
              backward=_grads.unpermute_with_routing_map_backward,
              example=_examples.unpermute_routing,
              source=f"{_DOCS}; CANN aclnnMoeTokenUnpermuteWithRoutingMap"),
    Reference("_npu_moe_token_unpermute_with_routing_map",
              _moe._npu_moe_token_unpermute_with_routing_map,
              backward=_grads.internal_unpermute_with_routing_map_backward,
              example=_examples.unpermute_routing,
              source=f"{_DOCS} (npu_moe_token_unpermute_with_routing_map's kernel; torch_npu "
                     "2.13.0 npu_native_functions_by_codegen.yaml)"),
    # their backward kernels (derivatives.yaml; MindSpeed 2.2+'s te/pytorch/permutation.py)
    Reference("npu_moe_token_permute_with_routing_map_grad",
              _grads.npu_moe_token_permute_with_routing_map_grad,
              example=_examples.permute_routing_grad,
              grad_of="npu_moe_token_permute_with_routing_map", source=_RM_GRAD_SOURCE),
    Reference("npu_moe_token_unpermute_with_routing_map_grad",
              _grads.npu_moe_token_unpermute_with_routing_map_grad,
              example=_examples.unpermute_routing_grad,
              grad_of="npu_moe_token_unpermute_with_routing_map", source=_RM_GRAD_SOURCE),
    # MoE routing family
    Reference("npu_moe_init_routing", _moe.npu_moe_init_routing,
              example=_examples.init_routing, source=f"{_DOCS}; CANN aclnnMoeInitRouting"),
    Reference("npu_moe_finalize_routing", _moe.npu_moe_finalize_routing,
              example=_examples.finalize_routing,
              source=f"{_DOCS}; CANN aclnnMoeFinalizeRouting"),
    Reference("npu_moe_gating_top_k_softmax", _moe.npu_moe_gating_top_k_softmax,
              example=_examples.gating, source=f"{_DOCS}; CANN aclnnMoeGatingTopKSoftmax"),
    Reference("npu_moe_compute_expert_tokens", _moe.npu_moe_compute_expert_tokens,
              example=_examples.expert_tokens,
              source=f"{_DOCS}; CANN aclnnMoeComputeExpertTokens"),
    # grouped matmul, norms, activations (fusion attention: _fam_attention)
    Reference("npu_grouped_matmul", _matmul.npu_grouped_matmul,
              backward=_grads.grouped_matmul_backward, example=_examples.grouped_matmul,
              source=f"{_DOCS}; CANN aclnnGroupedMatmulV4 (non-quantized)"),
    Reference("npu_rms_norm_backward", _grads.npu_rms_norm_backward,
              example=_examples.rms_norm_backward, grad_of="npu_rms_norm",
              source=f"{_DOCS} (npu_rms_norm); torch_npu 2.13.0 Functions.h (NpuRmsNormBackward0)"),
    Reference("npu_rms_norm", _norm.npu_rms_norm, backward=_grads.rms_norm_backward,
              example=_examples.rms_norm, source=_DOCS),
    Reference("npu_swiglu", _norm.npu_swiglu, backward=_grads.swiglu_backward,
              example=_examples.swiglu, source=_DOCS),
    Reference("npu_rotary_mul_backward", _grads.npu_rotary_mul_backward,
              example=_examples.rotary_mul_backward, grad_of="npu_rotary_mul",
              source=f"{_DOCS} (npu_rotary_mul); torch_npu Functions.cpp "
                     "(NpuRotaryMulBackward0: npu_rotary_mul_backward(grad, self, r1, r2, "
                     "rotary_mode))"),
    Reference("npu_rotary_mul", _norm.npu_rotary_mul, backward=_grads.rotary_mul_backward,
              example=_examples.rotary_mul, source=_DOCS),
    # MindSpeed ops (contract op names mindspeed.<fn>)
    Reference("mindspeed.npu_moe_token_unpermute", _mindspeed.npu_moe_token_unpermute,
              example=_examples.unpermute, source=f"{_MS}npu_moe_token_unpermute.md"),
    Reference("mindspeed.npu_moe_token_permute", _mindspeed.npu_moe_token_permute,
              example=_examples.permute, source=f"{_MS}npu_moe_token_permute.md"),
    Reference("mindspeed.npu_gmm", _mindspeed.npu_gmm, example=_examples.gmm,
              source=f"{_MS}gmm.md"),
    Reference("mindspeed.npu_gmm_v2", _mindspeed.npu_gmm_v2, example=_examples.gmm_v2,
              source=f"{_MS}gmm.md"),
    Reference("mindspeed.npu_rotary_position_embedding",
              _mindspeed.npu_rotary_position_embedding, example=_examples.rope,
              source=f"{_MS}npu_rotary_position_embedding.md"),
    Reference("mindspeed.npu_ring_attention_update", _mindspeed.npu_ring_attention_update,
              example=_examples.ring, source=f"{_MS}npu_ring_attention_update.md"),
)

# the families: each family module holds its own entries
SHIPPED += (_fam_attention.REFERENCES + _fam_norm_quant.REFERENCES + _fam_gemm_comm.REFERENCES
            + _fam_moe_serving.REFERENCES + _fam_attention_v3.REFERENCES
            + _fam_quant_prep.REFERENCES + _fam_misc.REFERENCES)
