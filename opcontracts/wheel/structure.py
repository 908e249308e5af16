"""The structure of one torch_npu release's MoE token ops, read from the wheel digest.

Which op names reach the MoE token kernels in a release: the emulation registers that structure
(``opcontracts.emulation``), and ``wheel verify`` fails when a release reaches a contracted op's
kernel through an op no contract covers.

torch_npu changed how ``npu_moe_token_(un)permute`` reach their kernels between releases
(``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` and the saved fields of the
generated ``Npu*Backward0`` nodes in ``torch_npu/include/torch_npu/csrc/aten/Functions.h``,
read from the 2.7.1, 2.12.0 and 2.13.0 wheels):

========================  =====================================  ==================================
release has (digest)      forward                                backward op the C++ node calls
========================  =====================================  ==================================
``_npu_moe_token_         public op is ``AutogradPrivateUse1``   ``npu_moe_token_unpermute_grad_v2``
unpermute``               only, calling ``_npu_moe_token_        (``permuted_tokens_size_0``,
(2.7.1.post11, 2.9.0.     unpermute`` (which also returns        ``permuted_tokens_dtype``, and the
post9, 2.10.0.post7,      ``permuted_tokens_for_backward``)      saved ``permuted_tokens_for_
2.11.0.post3, 2.12.0.                                            backward``)
post3, 2.13, 2.14)
otherwise                 plain op (kernel at the backend)       ``npu_moe_token_unpermute_grad``
``npu_moe_token_permute_  plain op                               ``npu_moe_token_permute_grad_v2``
grad_v2`` (from 2.7.1.                                           (``tokens_size_0``, ``tokens_dtype``,
post8; 2.12.0 included)                                          ``num_topK``)
otherwise                 plain op                               ``npu_moe_token_permute_grad``
``_npu_moe_token_         ``..._with_routing_map`` is            (the emulation: the formula on the
unpermute_with_routing_   ``AutogradPrivateUse1`` only, calling  internal op, see ``_backward``)
map`` (from 2.6.0.post3)  the internal op (which also returns
                          ``out_index``, ``permuted_token_id``,
                          ``permute_probs``)
========================  =====================================  ==================================

The routing-map permute's and unpermute's C++ nodes call ``npu_moe_token_permute_with_routing_
map_grad`` / ``npu_moe_token_unpermute_with_routing_map_grad`` (op-plugin ``derivatives.yaml``),
which every release with the routing-map ops has (2.6.0.post3 on: ``routing_map_backwards``).

The presence of the internal / ``_grad_v2`` op in a release's schemas is what tells the
structures apart: in every release the digest holds, ``_npu_moe_token_unpermute`` and
``npu_moe_token_unpermute_grad_v2`` appear together, and each wheel read (2.7.1: neither;
2.12.0: permute v2 only; 2.13.0: both) has exactly the structure its schemas predict.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

__all__ = ["Structure", "structure"]

@dataclass(frozen=True)
class Structure:
    """How one release reaches the MoE token kernels (see the module docstring)."""

    release: str
    unpermute_internal: str | None
    """``_npu_moe_token_unpermute`` when the public op is autograd-only, else None"""
    unpermute_backward: str | None
    """the grad op the unpermute backward node calls (None: the release has no grad op, 2.5.1.post1
    and 2.6.0, so no derivative is assumed)"""
    permute_backward: str | None
    routing_map_internal: str | None
    """``_npu_moe_token_unpermute_with_routing_map`` when the release has it (the public
    routing-map unpermute is then autograd-only over it), else None"""
    routing_map_backwards: tuple[str | None, str | None] = (None, None)
    """the routing-map permute's and unpermute's grad ops (``npu_moe_token_(un)permute_with_
    routing_map_grad``) where the release has them (their C++ nodes call them: op-plugin
    ``derivatives.yaml``), else None each"""

    @property
    def internal_ops(self) -> tuple[str, ...]:
        return tuple(n for n in (self.unpermute_internal, self.routing_map_internal) if n)

    @property
    def backward_ops(self) -> tuple[str, ...]:
        return tuple(n for n in (self.permute_backward, self.unpermute_backward) if n)

    def routes(self) -> dict[str, tuple[str, ...]]:
        """Public op -> the other ops its calls reach in this release (internal, backward)."""
        def present(*names: str | None) -> tuple[str, ...]:
            return tuple(n for n in names if n)

        return {
            "npu_moe_token_permute": present(self.permute_backward),
            "npu_moe_token_unpermute": present(self.unpermute_internal, self.unpermute_backward),
            "npu_moe_token_permute_with_routing_map": present(self.routing_map_backwards[0]),
            "npu_moe_token_unpermute_with_routing_map": present(self.routing_map_internal,
                                                                self.routing_map_backwards[1]),
        }

    def dispatched(self, op: str) -> str:
        """The op name a dispatch mode below autograd sees when ``op`` is called."""
        if op == "npu_moe_token_unpermute" and self.unpermute_internal:
            return self.unpermute_internal
        if op == "npu_moe_token_unpermute_with_routing_map" and self.routing_map_internal:
            return self.routing_map_internal
        return op


@cache
def structure(release: str) -> Structure:
    """The structure of ``release`` (a version the digest knows; KeyError naming the known)."""
    from . import digest

    schemas = digest.load().release(release).schemas
    internal = "_npu_moe_token_unpermute" if "_npu_moe_token_unpermute" in schemas else None
    rm = "_npu_moe_token_unpermute_with_routing_map"

    def first(*names: str) -> str | None:
        return next((n for n in names if n in schemas), None)

    return Structure(
        release=release,
        unpermute_internal=internal,
        unpermute_backward=first("npu_moe_token_unpermute_grad_v2", "npu_moe_token_unpermute_grad")
        if internal else first("npu_moe_token_unpermute_grad"),
        permute_backward=first("npu_moe_token_permute_grad_v2", "npu_moe_token_permute_grad"),
        routing_map_internal=rm if rm in schemas else None,
        routing_map_backwards=(first("npu_moe_token_permute_with_routing_map_grad"),
                               first("npu_moe_token_unpermute_with_routing_map_grad")),
    )
