"""The emulated ``npu`` ops: schemas and their registration with the PyTorch dispatcher.

Schemas are torch_npu 2.14.0's (``npu_native_functions_by_codegen.yaml``), read from the wheel
digest shipped in the package (``opcontracts.wheel.digest``); ``_SHORTENED`` lists the ones still
abbreviated. The ops added by family modules are declared there (``_family``).

Per op the registration is:

* ``CompositeExplicitAutograd``: the op's reference (``opcontracts.reference``), entered
  through ``_raw.kernel_view`` so that arguments in a dtype the active profile does not
  support are misread, as on the NPU;
* a fake implementation (``torch.library.register_fake``) for ``torch.compile``;
* for differentiable ops, an ``Autograd`` kernel (``_autograd``) running ``_backward``'s formula.

Everything is registered through one ``torch.library.Library("npu", "FRAGMENT")``; destroying
it removes every definition and kernel again (see :func:`deregister`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.library import Library

from .. import reference
from . import _fakes, _raw
from ._autograd import BackwardFn, make_autograd_kernel
from ._backward import BACKWARDS
from ._family import DIGEST_RELEASE, all_ops, backward_of, digest_schema

__all__ = ["EXTRA_OVERLOADS", "NAMESPACE", "OPS", "OP_NAMES", "OpDef", "deregister",
           "overload_schema", "register", "tensor_args"]

NAMESPACE = "npu"

# The ops of the first packs; their schemas are torch_npu 2.14.0's, read from the wheel digest
# (``_family.digest_schema``), except where an entry of ``_SHORTENED`` still shortens one, until
# the reference takes every argument of the real schema.
_FIRST_PACKS = (
    "npu_moe_token_permute", "npu_moe_token_permute_grad", "npu_moe_token_unpermute",
    "npu_moe_token_unpermute_grad", "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_unpermute_with_routing_map", "npu_moe_init_routing",
    "npu_moe_finalize_routing", "npu_moe_gating_top_k_softmax", "npu_moe_compute_expert_tokens",
    "npu_grouped_matmul", "npu_rms_norm", "npu_swiglu", "npu_rotary_mul",
)
_SHORTENED: dict[str, str] = {
}
SCHEMAS: dict[str, str] = {
    **{name: _SHORTENED.get(name) or digest_schema(name) for name in _FIRST_PACKS},
    **{op.name: op.schema or digest_schema(op.name) for op in all_ops()},
}


@dataclass(frozen=True)
class OpDef:
    """One emulated op: its schema, reference kernel, fake and (optional) backward formula."""

    name: str
    schema: str
    kernel: Callable[..., Any]
    fake: Callable[..., Any]
    backward: BackwardFn | None = None


def _reference(name: str) -> Callable[..., Any]:
    ref = reference.get(name)
    if ref is None:  # pragma: no cover - a schema without a reference is a packaging bug
        raise RuntimeError(f"opcontracts.reference has no reference for emulated op {name!r}")
    return ref.forward


OPS: tuple[OpDef, ...] = tuple(
    OpDef(
        name=name,
        schema=SCHEMAS[name],
        kernel=_reference(name),
        fake=getattr(_fakes, name),
        backward=BACKWARDS.get(name),
    )
    for name in _FIRST_PACKS
) + tuple(
    OpDef(name=op.name, schema=SCHEMAS[op.name], kernel=_reference(op.name), fake=op.fake,
          backward=backward_of(op))
    for op in all_ops()
)
OP_NAMES: tuple[str, ...] = tuple(op.name for op in OPS)

# Overloads registered besides the default one, as torch_npu 2.14.0 defines them: op ->
# (overload, its ``int[]`` arguments that the default overload takes as an int64 ``Tensor``).
# Each runs the default overload's kernel, fake and backward with those arguments turned into
# that tensor (a metadata-only one for the fake), so the two overloads compute the same.
EXTRA_OVERLOADS: dict[str, tuple[str, tuple[str, ...]]] = {
    "npu_grouped_matmul": ("List", ("group_list",)),  # group_list as a list of ints
}


def overload_schema(name: str, overload: str) -> str:
    """The schema string of ``name.overload`` in the emulated release (the wheel digest)."""
    from ..wheel import digest

    for ov in digest.op_schemas(DIGEST_RELEASE).get(name, ()):
        if ov.overload == overload:
            return ov.func
    raise RuntimeError(f"torch_npu {DIGEST_RELEASE} has no overload {name}.{overload}")


def _tensor_of(value: Any, like: Any, fake: bool) -> Any:
    """An ``int[]`` argument as the int64 tensor the default overload takes."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    ref = like[0] if isinstance(like, (list, tuple)) and like else like
    device = ref.device if isinstance(ref, torch.Tensor) else None
    if fake:  # the fakes read sizes only; a fake tensor cannot be built from the values
        return torch.empty((len(value),), dtype=torch.int64, device=device)
    return torch.tensor([int(v) for v in value], dtype=torch.int64, device=device)


def _with_tensors(fn: Callable[..., Any], names: tuple[str, ...], fake: bool = False
                  ) -> Callable[..., Any]:
    """``fn`` (a kernel or fake of the default overload) called with ``names`` as tensors."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        first = next(iter(bound.arguments.values()), None)
        for n in names:
            if n in bound.arguments:
                bound.arguments[n] = _tensor_of(bound.arguments[n], first, fake)
        return fn(*bound.args, **bound.kwargs)

    return entry


def _backward_with_tensors(backward: BackwardFn, names: tuple[str, ...]) -> BackwardFn:
    def formula(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
        first = next(iter(inputs.values()), None)
        return backward({**inputs, **{n: _tensor_of(inputs.get(n), first, False)
                                      for n in names if n in inputs}}, outputs, grads)

    return formula


def tensor_args() -> Mapping[str, frozenset[str]]:
    """Per op, the names of its Tensor / Tensor[] arguments (what a profile may restrict)."""
    result: dict[str, frozenset[str]] = {}
    for op in OPS:
        schema = torch._C.parse_schema(f"{NAMESPACE}::{op.schema}")
        result[op.name] = frozenset(
            a.name for a in schema.arguments if "Tensor" in str(a.type)
        )
    return result


def _through(view: Callable[[str, str, Any], Any], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with each argument first passed through ``view(name, arg, value)``."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        for arg, value in bound.arguments.items():
            bound.arguments[arg] = view(name, arg, value)
        return fn(*bound.args, **bound.kwargs)

    return entry


def _exists(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> Library:
    """Define every op in the ``npu`` namespace; the returned Library owns all registrations.

    Raises RuntimeError when one of the ops is already defined (a real torch_npu, or another
    emulation), before registering anything.
    """
    taken = [name for name in OP_NAMES if _exists(name)]
    if taken:
        raise RuntimeError(
            f"torch.ops.{NAMESPACE} already defines {', '.join(taken)}: a real torch_npu or another "
            "emulation is loaded; opcontracts.emulation will not shadow it"
        )
    lib = Library(NAMESPACE, "FRAGMENT")
    try:
        for op in OPS:
            lib.define(op.schema)
            lib.impl(op.name, _through(_raw.kernel_view, op.name, op.kernel), "CompositeExplicitAutograd")
            torch.library.register_fake(
                f"{NAMESPACE}::{op.name}", _through(_raw.fake_view, op.name, op.fake), lib=lib
            )
            if op.backward is not None:
                overload = getattr(getattr(torch.ops, NAMESPACE), op.name).default
                lib.impl(op.name, make_autograd_kernel(overload, op.backward), "Autograd", with_keyset=True)
            if op.name in EXTRA_OVERLOADS:
                _register_overload(lib, op, *EXTRA_OVERLOADS[op.name])
    except BaseException:
        lib._destroy()
        raise
    return lib


def _register_overload(lib: Library, op: OpDef, overload: str, names: tuple[str, ...]) -> None:
    qualified = f"{op.name}.{overload}"
    lib.define(overload_schema(op.name, overload))
    lib.impl(qualified, _through(_raw.kernel_view, op.name, _with_tensors(op.kernel, names)),
             "CompositeExplicitAutograd")
    torch.library.register_fake(
        f"{NAMESPACE}::{qualified}",
        _through(_raw.fake_view, op.name, _with_tensors(op.fake, names, fake=True)), lib=lib)
    if op.backward is not None:
        ov = getattr(getattr(getattr(torch.ops, NAMESPACE), op.name), overload)
        lib.impl(qualified, make_autograd_kernel(ov, _backward_with_tensors(op.backward, names)),
                 "Autograd", with_keyset=True)


def deregister(lib: Library) -> None:
    """Undo :func:`register`: ``Library._destroy`` drops the definitions, kernels and fakes and
    clears the cached ``torch.ops.npu.<name>`` packets (wrappers set on them go too)."""
    lib._destroy()
