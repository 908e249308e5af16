"""Backward of the differentiable emulated ops.

Two kinds, on purpose:

* ``npu_moe_token_permute``, ``npu_moe_token_unpermute``, ``npu_swiglu`` and (in its family
  module) ``npu_fusion_attention`` have their own backward *kernels* in torch_npu (``*_grad``
  ops, ``npu_swiglu_backward``, with their own dtype support).  Their backward calls those ops
  as torch_npu's generated C++ nodes do: through the ``OpOverload`` captured at install
  (``_captured``), never through a ``torch.ops.npu.<name>`` attribute, so only something at
  the dispatcher sees them (as on an NPU), and the grad kernel's dtype profile applies (the
  incident).  Which grad op, with which arguments, is the release's (``_release``): the
  ``_grad_v2`` ops take the forward tensors' row count and dtype instead of the tensors.
  ``npu_rms_norm``'s backward calls ``npu_rms_norm_backward`` the same way, and
  ``npu_rotary_mul``'s ``npu_rotary_mul_backward``.
* The other differentiable ops (routing-map permute/unpermute) run the composite formula of
  their reference (``opcontracts.reference``: ``Reference.backward``) on the saved inputs.
  (torch_npu's C++ nodes call backward kernels for them, the routing-map ``*_grad`` ops; those
  are emulated ops, ``_fam_moe_token``, which MindSpeed 2.2+'s ``te/pytorch/permutation.py``
  calls from its Python backward, but these nodes do not call them yet.)

Every formula: ``(inputs, outputs, grads) -> {argument name: gradient}`` (see ``_autograd``).
Its node saves what torch_npu's node of the op saves in the release (the wheels'
``Functions.h``, through the digest: ``_ops``); the other tensors reach the formula by shape and
dtype only, as on the NPU, so a saved-tensor hook sees what it would see there and the backward
keeps no more memory alive.
"""

from __future__ import annotations

from typing import Any

from .. import reference
from ._captured import call
from ._release import Structure

__all__ = ["BACKWARDS", "moe_token_backwards"]


# --------------------------------------------------------------------------- through grad ops


def permute_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """``NpuMoeTokenPermuteBackward0`` up to 2.12.0: ``npu_moe_token_permute_grad``."""
    grad_permuted, _ = grads
    _, sorted_indices = outputs
    grad_tokens = call("npu_moe_token_permute_grad", inputs["tokens"], grad_permuted,
                       inputs["indices"], sorted_indices, inputs["padded_mode"])
    return {"tokens": grad_tokens}


def permute_backward_v2(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """``NpuMoeTokenPermuteBackward0`` from 2.12.0 (``Functions.h`` saves ``tokens_scalar_type``,
    ``tokens_sym_argsize_0``, ``indices_dim``, ``indices_sym_argsize_minus_1``):
    ``npu_moe_token_permute_grad_v2``."""
    grad_permuted, _ = grads
    _, sorted_indices = outputs
    tokens, indices = inputs["tokens"], inputs["indices"]
    topk = 1 if indices.dim() == 1 else indices.size(-1)
    grad_tokens = call("npu_moe_token_permute_grad_v2", grad_permuted, sorted_indices,
                       tokens.size(0), tokens.dtype, topk, inputs["padded_mode"])
    return {"tokens": grad_tokens}


def unpermute_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """``NpuMoeTokenUnpermuteBackward0`` where the public op is a plain op (2.7.1, 2.12.0):
    ``npu_moe_token_unpermute_grad``."""
    probs = inputs["probs"]
    grad_permuted, grad_probs = call(
        "npu_moe_token_unpermute_grad", inputs["permuted_tokens"], grads,
        inputs["sorted_indices"], probs, inputs["padded_mode"], inputs["restore_shape"])
    return {"permuted_tokens": grad_permuted, "probs": grad_probs if probs is not None else None}


def internal_unpermute_backward(inputs: dict[str, Any], outputs: Any, grads: Any
                                ) -> dict[str, Any]:
    """``NpuMoeTokenUnpermuteBackward0`` of ``_npu_moe_token_unpermute`` (2.13.0's
    ``Functions.h``: it saves ``permuted_tokens_scalar_type``, ``permuted_tokens_sym_argsize_0``,
    ``probs``, ``sorted_indices`` and the output ``permuted_tokens_for_backward``):
    ``npu_moe_token_unpermute_grad_v2``."""
    permuted, probs = inputs["permuted_tokens"], inputs["probs"]
    _, for_backward = outputs
    grad, _ = grads
    grad_permuted, grad_probs = call(
        "npu_moe_token_unpermute_grad_v2", grad, inputs["sorted_indices"], permuted.size(0),
        permuted.dtype, probs, inputs["padded_mode"], inputs["restore_shape"], for_backward)
    return {"permuted_tokens": grad_permuted, "probs": grad_probs if probs is not None else None}


def swiglu_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """torch_npu's derivative of ``npu_swiglu`` (op-plugin ``derivatives.yaml``: ``self:
    npu_swiglu_backward(grad, self, dim)``): the backward kernel, with its own dtype profile."""
    return {"self": call("npu_swiglu_backward", grads, inputs["self"], inputs["dim"])}


def rms_norm_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """``NpuRmsNormBackward0`` (saves gamma, self and rstd): ``npu_rms_norm_backward``, the
    backward kernel with its own dtype profile (rstd's gradient is not used)."""
    dx, dgamma = call("npu_rms_norm_backward", grads[0], inputs["self"], inputs["gamma"],
                      outputs[1])
    return {"self": dx, "gamma": dgamma}


def rotary_mul_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """``NpuRotaryMulBackward0`` (saves self, r1, r2): ``npu_rotary_mul_backward(grad, self, r1,
    r2, rotary_mode)``, the backward kernel with its own dtype profile."""
    dx, dr1, dr2 = call("npu_rotary_mul_backward", grads, inputs["self"], inputs["r1"],
                        inputs["r2"], inputs["rotary_mode"])
    return {"self": dx, "r1": dr1, "r2": dr2}


def moe_token_backwards(structure: Structure) -> dict[str, Any]:
    """The permute / unpermute formulas of ``structure``'s release, by the op carrying the
    derivative (the internal op where the public unpermute, or the public routing-map
    unpermute, is autograd-only: ``_nodes``)."""
    permute = {None: None, "npu_moe_token_permute_grad": permute_backward,
               "npu_moe_token_permute_grad_v2": permute_backward_v2}
    table: dict[str, Any] = {"npu_moe_token_permute": permute[structure.permute_backward]}
    if structure.unpermute_internal is not None:
        table[structure.unpermute_internal] = internal_unpermute_backward
    else:  # no grad op in the release (2.5.1.post1, 2.6.0): no derivative
        table["npu_moe_token_unpermute"] = unpermute_backward if structure.unpermute_backward else None
    if structure.routing_map_internal is not None:  # the formula, on the internal op's output
        ref = reference.get(structure.routing_map_internal)
        table[structure.routing_map_internal] = ref.backward if ref is not None else None
    return table


def _backwards() -> dict[str, Any]:
    table: dict[str, Any] = {
        "npu_moe_token_permute": permute_backward,
        "npu_moe_token_unpermute": unpermute_backward,
    }  # (the 2.7.1 structure; ``moe_token_backwards`` gives the installed release's)
    for name in reference.names():
        ref = reference.get(name)
        if ref is not None and ref.backward is not None and not name.startswith("mindspeed."):
            table[name] = ref.backward
    table["npu_swiglu"] = swiglu_backward  # through its backward kernel, not the formula
    table["npu_rms_norm"] = rms_norm_backward  # likewise
    table["npu_rotary_mul"] = rotary_mul_backward  # likewise
    return table


BACKWARDS = _backwards()
