"""Backward of the differentiable emulated ops.

Two kinds, on purpose:

* ``npu_moe_token_permute``, ``npu_moe_token_unpermute``, ``npu_swiglu`` and (in its family
  module) ``npu_fusion_attention`` have their own backward *kernels* in torch_npu (``*_grad``
  ops, ``npu_swiglu_backward``, with their own dtype support). Their backward calls those ops
  through ``torch.ops.npu.<name>``, looked up at call time, so a wrapper installed on that
  attribute sees backward calls, and the grad kernel's dtype profile applies (the incident).
* The other differentiable ops (routing-map permute/unpermute, grouped matmul, rms_norm,
  rotary_mul) run the composite formula of their reference
  (``opcontracts.reference``: ``Reference.backward``) on the saved inputs. The facts table
  names no backward kernels for them, so no profile applies to their backward.

Every formula: ``(inputs, outputs, grads) -> {argument name: gradient}`` (see ``_autograd``).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import reference

__all__ = ["BACKWARDS"]


def _ops() -> Any:
    """``torch.ops.npu``, resolved at call time (never cached)."""
    return torch.ops.npu


# --------------------------------------------------------------------------- through grad ops


def permute_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    grad_permuted, _ = grads
    _, sorted_indices = outputs
    grad_tokens = _ops().npu_moe_token_permute_grad(
        inputs["tokens"],
        grad_permuted,
        inputs["indices"],
        sorted_indices,
        inputs["padded_mode"],
    )
    return {"tokens": grad_tokens}


def unpermute_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    probs = inputs["probs"]
    grad_permuted, grad_probs = _ops().npu_moe_token_unpermute_grad(
        inputs["permuted_tokens"],
        grads,
        inputs["sorted_indices"],
        probs,
        inputs["padded_mode"],
        inputs["restore_shape"],
    )
    return {"permuted_tokens": grad_permuted, "probs": grad_probs if probs is not None else None}


def swiglu_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """torch_npu's derivative of ``npu_swiglu`` (op-plugin ``derivatives.yaml``: ``self:
    npu_swiglu_backward(grad, self, dim)``): the backward kernel, with its own dtype profile."""
    return {"self": _ops().npu_swiglu_backward(grads, inputs["self"], inputs["dim"])}


def _backwards() -> dict[str, Any]:
    table: dict[str, Any] = {
        "npu_moe_token_permute": permute_backward,
        "npu_moe_token_unpermute": unpermute_backward,
    }
    for name in reference.names():
        ref = reference.get(name)
        if ref is not None and ref.backward is not None and not name.startswith("mindspeed."):
            table[name] = ref.backward
    table["npu_swiglu"] = swiglu_backward  # through its backward kernel, not the formula
    return table


BACKWARDS = _backwards()
