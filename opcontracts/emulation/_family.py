"""Emulated ops declared by family modules: one ``EmulatedOp`` entry per op, in one place.

The ops of the first packs are declared across ``_ops.SCHEMAS``, ``_fakes``, ``_profiles`` and
``_backward``.  Every op added since lives in a family module (``_fam_attention``,
``_fam_norm_quant``, ``_fam_gemm_comm``, ``_fam_moe_serving``) as one entry::

    EmulatedOp(
        "npu_add_rms_norm",
        fake=_add_rms_norm_fake,                  # output shapes and dtypes, no data
        dtypes={"x1": FLOATS, "x2": FLOATS, "gamma": FLOATS},   # what the docs list (first:
                                                  # the dtype the kernel assumes)
        profiles={"narrow": {"x1": BF16}},        # per-profile overrides, when sources differ
        backward=AUTOGRAD,                        # trained through: autograd of the reference
        source="torch_npu 2.14.0 _op_plugin_docs.py",
    )

and its plain-PyTorch reference, the kernel, lives in ``opcontracts.reference`` under the same
name.  The schema is the real one, from the wheel digest (torch_npu 2.14.0,
``npu_native_functions_by_codegen.yaml``), unless ``schema=`` says otherwise; ``dtypes`` feeds
every profile (``narrow``, ``incident``, ``wide``), so a wrongly typed argument is misread as
the first dtype listed, as a raw kernel would.  ``backward`` is a formula ``(inputs, outputs,
grads) -> {arg: grad}``, ``AUTOGRAD`` (autograd through the reference's forward),
``NO_DERIVATIVE`` (torch_npu has none: a backward through the op raises, as torch_npu's
not-implemented fallback does) or None (no autograd kernel: PyTorch's fallback).
``release_only=True``: only the releases whose schemas have the op define it (the routing-map
grad ops, from 2.6.0.post3).  ``writes="self"``: an in-place op (``npu_scatter_nd_update_``);
its kernel writes the reference's result into that argument and returns it.

Nothing here imports the enforcer: the emulation stays below everything that checks calls.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

import torch

from .. import reference

__all__ = ["AUTOGRAD", "NO_DERIVATIVE", "EmulatedOp", "FAMILIES", "all_ops", "digest_schema",
           "backward_of"]

BackwardFn = Callable[[dict[str, Any], Any, Any], dict[str, Any]]

AUTOGRAD = "autograd"
"""``EmulatedOp.backward``: the gradients are autograd's, through the reference's forward."""

NO_DERIVATIVE = "no derivative"
"""``EmulatedOp.backward``: torch_npu registers no derivative; backward through the op raises
``RuntimeError: derivative for 'npu::<op>' is not implemented``, as on the NPU."""

FAMILIES = ("_fam_attention", "_fam_norm_quant", "_fam_gemm_comm", "_fam_moe_serving",
            "_fam_moe_token", "_fam_quant_prep", "_fam_misc")
"""The family modules of this package, in registration order."""

DIGEST_RELEASE = "2.14.0"
"""The torch_npu release whose schemas the emulation registers."""


@dataclass(frozen=True)
class EmulatedOp:
    """One emulated op of a family module (see the module docstring)."""

    name: str
    fake: Callable[..., Any]
    dtypes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    profiles: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    backward: BackwardFn | str | None = None
    schema: str | None = None
    source: str = ""
    release_only: bool = False
    """defined only in the releases whose schemas (the wheel digest) have the op, with that
    release's schema (``_ops.register``)"""
    writes: str | None = None
    """the argument an in-place op writes and returns (``Tensor(a!) self -> Tensor(a!)``): the
    kernel copies the reference's result into it (the reference itself never writes)"""

    def profile(self, name: str) -> dict[str, tuple[str, ...]]:
        """The dtypes this kernel reads correctly under profile ``name``."""
        return {**self.dtypes, **self.profiles.get(name, {})}


@lru_cache(maxsize=1)
def all_ops() -> tuple[EmulatedOp, ...]:
    """Every family module's ops, in ``FAMILIES`` order."""
    out: list[EmulatedOp] = []
    for fam in FAMILIES:
        out.extend(importlib.import_module(f"{__package__}.{fam}").OPS)
    return tuple(out)


@cache
def digest_schema(name: str, release: str = DIGEST_RELEASE) -> str:
    """The op's schema string in ``release``, from the wheel digest shipped in the package."""
    from ..wheel import digest

    overloads = digest.op_schemas(release).get(name)
    if not overloads:  # pragma: no cover - a family entry for an op the wheel lacks
        raise RuntimeError(f"torch_npu {release} has no op {name!r} (wheel digest)")
    return overloads[0].func


def _through_reference(name: str) -> BackwardFn:
    def backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
        ref = reference.get(name)
        assert ref is not None
        leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point()}
        with torch.enable_grad():
            out = ref.forward(**{**inputs, **leaves})
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))]
        gs = list(grads if isinstance(grads, (tuple, list)) else (grads,))
        pairs = [(o, g) for o, g in zip(outs, gs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if not pairs:
            return {}
        got = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()),
                                  [g.to(o.dtype) for o, g in pairs], allow_unused=True)
        return {k: g for k, g in zip(leaves, got) if g is not None}

    # it runs the forward again, so its node keeps every input, whatever torch_npu's node (whose
    # formula needs less: format cast's keeps nothing) keeps: more memory than on the NPU
    backward.recomputes = True  # type: ignore[attr-defined]
    return backward


def _not_implemented(name: str) -> BackwardFn:
    def backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
        raise RuntimeError(f"derivative for 'npu::{name}' is not implemented (torch_npu has no "
                           "backward for it; the opcontracts emulation raises as it does)")

    return backward


def backward_of(op: EmulatedOp) -> BackwardFn | None:
    """The formula the emulation's autograd kernel runs for ``op`` (None: no autograd)."""
    if op.backward == AUTOGRAD:
        return _through_reference(op.name)
    if op.backward == NO_DERIVATIVE:
        return _not_implemented(op.name)
    if callable(op.backward):
        return op.backward
    return None
