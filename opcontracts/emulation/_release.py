"""The torch_npu release the emulation reproduces: its structure (``opcontracts.wheel.structure``,
from the wheel digest) and the emulation's facts about the ops that differ by release."""

from __future__ import annotations

from ..wheel.structure import Structure, structure

__all__ = ["INTERNAL_OF", "NO_DERIVATIVE_OPS", "RELEASE_ONLY", "SAME_KERNEL", "Structure",
           "structure"]

NO_DERIVATIVE_OPS = frozenset({
    "npu_grouped_matmul", "npu_all_gather_base_mm", "npu_alltoallv_gmm", "npu_gmm_alltoallv",
})
"""Ops torch_npu registers no derivative for (no op-plugin ``derivatives.yaml`` entry in any
branch, no ``VariableType`` kernel in ``libtorch_npu.so``): the emulation registers no autograd
kernel for them, so torch's autograd fallback warns and sends no gradient, as on the NPU."""

SAME_KERNEL = {
    "_npu_moe_token_unpermute": "npu_moe_token_unpermute",
    "_npu_moe_token_unpermute_with_routing_map": "npu_moe_token_unpermute_with_routing_map",
    "npu_moe_token_unpermute_grad_v2": "npu_moe_token_unpermute_grad",
    "npu_moe_token_permute_grad_v2": "npu_moe_token_permute_grad",
}
"""The ops only some releases define, and the op whose aclnn kernel (and dtype profile) they
run: the same kernel under another name, with the row count and dtype of a forward tensor given
instead of the tensor (``_grad_v2``), or with the outputs its backward reads added (the
internal ``_npu_*`` ops)."""

INTERNAL_OF = {
    "npu_moe_token_unpermute": "_npu_moe_token_unpermute",
    "npu_moe_token_unpermute_with_routing_map": "_npu_moe_token_unpermute_with_routing_map",
}
"""Public op -> the internal op its ``AutogradPrivateUse1``-only kernel calls, in the releases
that define the internal op (``Structure.unpermute_internal`` / ``routing_map_internal``)."""

RELEASE_ONLY = frozenset({
    "npu_moe_token_permute_with_routing_map", "npu_moe_token_unpermute_with_routing_map",
})
"""Ops of the first packs only some releases define (the routing-map ops: from 2.6.0.post3, the
wheel digest): registered where the release's schemas have them, so on an older release
``torch_npu.npu_moe_token_permute_with_routing_map`` is an AttributeError, as on the real stack
(the family ops say the same with ``EmulatedOp.release_only``)."""
