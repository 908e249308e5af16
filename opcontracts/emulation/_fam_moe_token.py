"""Emulated backward kernels of the MoE token family: the routing-map permute / unpermute grad
ops, one ``EmulatedOp`` entry per op (see ``_family``); their references live in
``opcontracts.reference._grads``.

torch_npu defines them from 2.6.0.post3 on, with the routing-map ops (the wheel digest: the
same schema in every release that has them), so they are ``release_only``: an emulated release
without them has no such op, and ``torch_npu.npu_moe_token_(un)permute_with_routing_map_grad``
is an AttributeError there, as on the real stack.  They are backward kernels (op-plugin
``derivatives.yaml`` names them as the routing-map ops' derivatives; MindSpeed 2.2+'s
``te/pytorch/permutation.py`` calls them from its Python backward): no derivative of their own.

``dtypes`` are CANN's (``cann/ops-transformer``: the ``*_def.cpp`` kernel registrations and the
aclnn docs): the float tensors bf16 / fp16 / fp32, index tensors int32, ``routing_map`` int8 or
bool; the coupling of the float tensors' dtypes is the contracts' (per argument here).
``permuted_token_id`` (int32) is not listed: the kernel reads it only with ``drop_and_pad``
(without, torch_npu and MindSpeed pass ``sorted_indices`` for it and ``out_index`` alike), so
in the probe's mode nothing of it can be misread; its contract still checks it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._family import EmulatedOp

__all__ = ["OPS"]

FLOATS = ("bf16", "fp16", "fp32")
INT32 = ("int32",)
MASK = ("int8", "bool")
_CANN = "CANN ops-transformer moe/moe_token_{}_with_routing_map_grad (op_host *_def.cpp, aclnn doc)"
_PLUGIN = "Ascend/op-plugin op_plugin/ops/opapi/MoeToken{}WithRoutingMapGrad{}OpApi.cpp"


def _permute_grad_fake(permuted_token_out_grad: torch.Tensor, probs_grad: torch.Tensor | None,
                       sorted_indices: torch.Tensor, routing_map: torch.Tensor, experts_num: int,
                       tokens_num: int, drop_and_pad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """op-plugin's ``npu_moe_token_permute_with_routing_map_grad_meta``."""
    out = permuted_token_out_grad.new_empty((tokens_num, permuted_token_out_grad.size(1)))
    if probs_grad is None:
        return out, None
    return out, probs_grad.new_empty((tokens_num, experts_num))


def _unpermute_grad_fake(unpermuted_tokens_grad: torch.Tensor, out_index: torch.Tensor,
                         permuted_token_id: torch.Tensor, routing_map: torch.Tensor | None,
                         permuted_tokens: torch.Tensor | None, probs: torch.Tensor | None,
                         drop_and_pad: bool, restore_shape: Sequence[int]
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """op-plugin's meta of ``npu_moe_token_unpermute_with_routing_map_grad``: both outputs in
    the incoming gradient's dtype."""
    grad = unpermuted_tokens_grad
    out = grad.new_empty((out_index.size(0), grad.size(1)))
    return out, (grad.new_empty(probs.shape) if probs is not None else None)


OPS: tuple[EmulatedOp, ...] = (
    EmulatedOp("npu_moe_token_permute_with_routing_map_grad", fake=_permute_grad_fake,
               dtypes={"permuted_token_out_grad": FLOATS, "probs_grad": FLOATS,
                       "sorted_indices": INT32, "routing_map": MASK},
               release_only=True,
               source=f"{_CANN.format('permute')}; {_PLUGIN.format('Permute', '')}"),
    EmulatedOp("npu_moe_token_unpermute_with_routing_map_grad", fake=_unpermute_grad_fake,
               dtypes={"unpermuted_tokens_grad": FLOATS, "out_index": INT32,
                       "routing_map": MASK,
                       "permuted_tokens": FLOATS, "probs": FLOATS},
               release_only=True,
               source=f"{_CANN.format('unpermute')}; {_PLUGIN.format('Unpermute', 'KernelNpu')}"),
)
