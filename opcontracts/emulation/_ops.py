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

What differs by torch_npu release is registered per release (``register(release)``,
``_release``): the internal and ``_grad_v2`` ops (and the release-only family ops: the
routing-map ``*_grad`` ops) only where the release defines them (with its schemas), the public unpermute (and routing-map unpermute) as an autograd-only kernel calling
``_npu_moe_token_unpermute`` (``_npu_moe_token_unpermute_with_routing_map``) where it is one
(``_nodes``), and the permute / unpermute backward through the release's grad op,
captured once as an ``OpOverload`` (``_captured``).

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
from . import _captured, _fakes, _glue, _philox, _raw, _release
from ._autograd import BackwardFn, make_autograd_kernel
from ._backward import BACKWARDS, moe_token_backwards
from ._family import DIGEST_RELEASE, all_ops, backward_of, digest_schema
from ._nodes import autograd_only

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
    release_only: bool = False
    """registered only where the installed release defines the op (``_release``)"""
    writes: str | None = None
    """the argument an in-place op writes and returns (``EmulatedOp.writes``)"""


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
        release_only=name in _release.RELEASE_ONLY,
    )
    for name in _FIRST_PACKS
) + tuple(
    OpDef(name=op.name, schema=SCHEMAS[op.name], kernel=_reference(op.name), fake=op.fake,
          backward=backward_of(op), release_only=op.release_only, writes=op.writes)
    for op in all_ops()
)
# The ops later releases route the MoE token ops through: same aclnn kernels (and profiles:
# ``_profiles``) as the public / ``_grad`` ops, schemas from the installed release (``_release``);
# with the family ops only some releases define (``EmulatedOp.release_only``), the release-only
# ops, defined where the installed release's schemas have them.
_RELEASE_OPS = (*_release.SAME_KERNEL, *sorted(_release.RELEASE_ONLY),
                *(op.name for op in all_ops() if op.release_only))
OPS += tuple(
    OpDef(name=name, schema=digest_schema(name), kernel=_reference(name), fake=getattr(_fakes, name),
          release_only=True)
    for name in _release.SAME_KERNEL
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


def _before(fn: Callable[..., Any], hook: Callable[[Any], None] | None,
            after: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """``fn`` with ``hook`` given its bound arguments (defaults applied) first, and with
    ``after(arguments, result)`` making what it returns; ``fn`` itself when there is neither.
    ``hook`` may set arguments (a draw), which ``fn`` then gets."""
    if hook is None and after is None:
        return fn
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if hook is not None:
            hook(bound.arguments)
        out = fn(*bound.args, **bound.kwargs)
        return out if after is None else after(bound.arguments, out)

    return entry


def _glued(name: str, fn: Callable[..., Any], fake: bool = False) -> Callable[..., Any]:
    """``fn`` behind the checks torch_npu's C++ glue makes for ``name`` (``_glue``), if any,
    and its outputs as the glue hands them back (``_glue.outputs``)."""
    after = _glue.outputs(name)
    return _before(fn, _glue.checks(name),
                   None if after is None else functools.partial(after, fake=fake))


def _drawing(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` given the NPU generator's draw where the kernel's glue takes one (``_philox``:
    fusion attention's dropout seed and offset); the fake draws nothing."""
    return _before(fn, _philox.DRAWS.get(name))


def _opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run as a C++ kernel runs: below autograd, so the plain-PyTorch ops inside it record
    no graph.  An op without an autograd kernel then gets torch's autograd fallback, as on the NPU
    (torch_npu's ``VariableFallbackKernel.cpp``, mode ``warn``): a backward through it warns
    "an autograd kernel was not registered" and sends no gradient to its inputs."""

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return fn(*args, **kwargs)

    return kernel


def _writing_into(kernel: Callable[..., Any], reference_fn: Callable[..., Any], arg: str
                  ) -> Callable[..., Any]:
    """An in-place op's kernel: the reference's result (``kernel``) copied into argument
    ``arg`` (as the caller passed it, not the profile's view of it), which is returned."""
    signature = inspect.signature(reference_fn)

    @functools.wraps(reference_fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        target = signature.bind(*args, **kwargs).arguments[arg]
        result = kernel(*args, **kwargs)
        target.copy_(result.to(target.dtype))
        return target

    return entry


def _exists(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register(release: str = DIGEST_RELEASE) -> Library:
    """Define every op of ``release`` in the ``npu`` namespace; the returned Library owns all
    registrations.

    Raises RuntimeError when one of the ops is already defined (a real torch_npu, or another
    emulation), before registering anything; KeyError when the digest has no such release.
    """
    structure = _release.structure(release)
    schemas = _release_schemas(release)
    ops = [op for op in OPS if not op.release_only or op.name in schemas]
    taken = [op.name for op in ops if _exists(op.name)]
    if taken:
        raise RuntimeError(
            f"torch.ops.{NAMESPACE} already defines {', '.join(taken)}: a real torch_npu or another "
            "emulation is loaded; opcontracts.emulation will not shadow it"
        )
    # no autograd kernel where torch_npu has no derivative (the fallback's behaviour, ``_opaque``)
    by_release = moe_token_backwards(structure)  # the derivatives the release's structure decides
    backwards: dict[str, BackwardFn | None] = {
        **dict.fromkeys(_release.NO_DERIVATIVE_OPS), **by_release}
    lib = Library(NAMESPACE, "FRAGMENT")
    try:
        for op in ops:
            lib.define(schemas[op.name] if op.release_only else op.schema)
        _captured.capture(NAMESPACE, tuple(op.name for op in ops))
        internal = {public: name for public, name in _release.INTERNAL_OF.items()
                    if name in structure.internal_ops}
        for op in ops:
            backward = backwards.get(op.name, op.backward)
            recomputes = getattr(backward, "recomputes", False)  # needs every input (``_family``)
            _register_op(lib, op, backward, internal=internal.get(op.name),
                         saves=None if recomputes else _node_saves(
                             op.name, release if op.release_only or op.name in by_release
                             else DIGEST_RELEASE))
        _register_format_forms(lib)
    except BaseException:
        _captured.clear()
        lib._destroy()
        raise
    return lib


def _register_format_forms(lib: Library) -> None:
    """torch_npu's other forms of the format cast, over the default overload and the storage
    format it keeps (``_formats``): ``npu_format_cast.Tensor`` (to another tensor's format),
    ``npu_format_cast_`` (in place, to another tensor's format) and ``npu_format_cast_
    .acl_format`` (in place, to a format): the values stay, the storage's format changes.
    CompositeImplicitAutograd: a cast and a format change on any device, traced through."""
    from ..wheel import digest
    from . import _formats

    schemas = {f"{s.name}.{s.overload}" if s.overload else s.name: s.func
               for op in ("npu_format_cast", "npu_format_cast_")
               for s in digest.op_schemas(DIGEST_RELEASE).get(op, ())}
    cast = getattr(torch.ops, NAMESPACE).npu_format_cast.default

    def to_format_of(self: torch.Tensor, dst: torch.Tensor, *, customize_dtype: int | None = None,
                     input_dtype: int | None = None) -> torch.Tensor:
        return cast(self, _formats.format_of(dst), customize_dtype=customize_dtype,  # type: ignore[no-any-return]
                    input_dtype=input_dtype)

    def in_place(self: torch.Tensor, fmt: int) -> torch.Tensor:
        _formats.set_format(self, _formats.storage_format(self.dim(), fmt))
        return self

    def in_place_like(self: torch.Tensor, src: torch.Tensor, *,
                      customize_dtype: int | None = None,
                      input_dtype: int | None = None) -> torch.Tensor:
        return in_place(self, _formats.format_of(src))

    def in_place_to(self: torch.Tensor, acl_format: int, *, customize_dtype: int | None = None,
                    input_dtype: int | None = None) -> torch.Tensor:
        return in_place(self, acl_format)

    for name, fn in (("npu_format_cast.Tensor", to_format_of), ("npu_format_cast_", in_place_like),
                     ("npu_format_cast_.acl_format", in_place_to)):
        if name in schemas:
            lib.define(schemas[name])
            lib.impl(name, fn, "CompositeImplicitAutograd")


def _node_saves(op: str, node_release: str) -> tuple[str | int, ...] | None:
    """What torch_npu's autograd node of ``op`` saves in ``node_release``, from the wheel digest
    (the wheels' ``Functions.h``); None where it has no node for the op (then everything is
    saved).  The node release is the installed one for the ops whose derivative the release's
    structure decides (the MoE token family, the release-only ops), ``DIGEST_RELEASE`` for the
    others, registered with its schemas and its derivatives (a node of an older release would
    not keep an argument a 2.14.0 schema has: fusion attention's ``sink``)."""
    from ..wheel import digest

    return digest.load().release(node_release).node_saves(op)


def _release_schemas(release: str) -> dict[str, str]:
    """The schema strings of the release-only ops that ``release`` defines."""
    from ..wheel import digest

    have = digest.op_schemas(release)
    return {name: have[name][0].func for name in _RELEASE_OPS if name in have}


def _register_op(lib: Library, op: OpDef, backward: BackwardFn | None, internal: str | None,
                 saves: tuple[str | int, ...] | None = None) -> None:
    """``internal``: the op the release's ``AutogradPrivateUse1``-only kernel of ``op`` calls;
    ``saves``: what its autograd node keeps (``make_autograd_kernel``)."""
    view_name = op.name
    # the schema's name: ``op`` or ``op.overload`` for an op without a default overload
    entry_name = op.schema.split("(", 1)[0].strip()
    qualified = f"{NAMESPACE}::{entry_name}"
    public_only = internal is not None
    if internal is not None:  # the release's AutogradPrivateUse1-only kernel (``_nodes``)
        autograd_kernel, below = autograd_only(_captured.overload(internal))
        lib.impl(op.name, autograd_kernel, "Autograd", with_keyset=True)
        lib.impl(op.name, below, "CompositeExplicitAutograd")
    else:
        kernel = _drawing(op.name, _through(_raw.kernel_view, view_name, op.kernel))
        if op.writes is not None:
            kernel = _writing_into(kernel, op.kernel, op.writes)
        lib.impl(entry_name, _opaque(_glued(op.name, kernel)), "CompositeExplicitAutograd")
    torch.library.register_fake(
        qualified, _glued(op.name, _through(_raw.fake_view, view_name, op.fake), fake=True),
        lib=lib)
    if backward is not None and not public_only:
        overload = getattr(getattr(torch.ops, NAMESPACE), op.name).default
        lib.impl(op.name, make_autograd_kernel(overload, backward, saves), "Autograd",
                 with_keyset=True)
    if op.name in EXTRA_OVERLOADS:
        _register_overload(lib, op, *EXTRA_OVERLOADS[op.name], backward=backward)
    if _out_schema(op.name) is not None:
        _register_out(lib, op)


def _out_schema(name: str) -> Any:
    """The ``.out`` overload of ``name`` in the emulated release's schemas, or None."""
    from ..wheel import digest

    return next((ov for ov in digest.op_schemas(DIGEST_RELEASE).get(name, ())
                 if ov.overload == "out"), None)


def _register_out(lib: Library, op: OpDef) -> None:
    """``name.out`` as torch_npu defines it (torch_npu's NPU-graph handlers call it): the
    default overload's kernel (and fake), its outputs written into the ``(a!)`` tensors, which
    it returns; arguments the default overload lacks (``workspace``) are ignored."""
    out = _out_schema(op.name)
    lib.define(out.func)
    parsed = torch._C.parse_schema(f"{NAMESPACE}::{out.func}")
    written = [a.name for a in parsed.arguments if a.alias_info is not None and a.alias_info.is_write]
    default = {a.name for a in torch._C.parse_schema(f"{NAMESPACE}::{op.schema}").arguments}

    def writing(fn: Callable[..., Any], fake: bool) -> Callable[..., Any]:
        def entry(*args: Any, **kwargs: Any) -> Any:
            targets = [kwargs.pop(n) for n in written]
            results = fn(*args, **{k: v for k, v in kwargs.items() if k in default})
            for t, r in zip(targets, results, strict=True):
                if not fake:
                    t.resize_(r.shape).copy_(r)
            return tuple(targets)

        return entry

    lib.impl(f"{op.name}.out", writing(_opaque(_through(_raw.kernel_view, op.name, op.kernel)), False),
             "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{op.name}.out",
                                writing(_through(_raw.fake_view, op.name, op.fake), True), lib=lib)


def _register_overload(lib: Library, op: OpDef, overload: str, names: tuple[str, ...],
                       backward: BackwardFn | None) -> None:
    qualified = f"{op.name}.{overload}"
    lib.define(overload_schema(op.name, overload))
    lib.impl(qualified, _opaque(_glued(qualified, _through(_raw.kernel_view, op.name,
                                                           _with_tensors(op.kernel, names)))),
             "CompositeExplicitAutograd")
    torch.library.register_fake(
        f"{NAMESPACE}::{qualified}",
        _glued(qualified, _through(_raw.fake_view, op.name, _with_tensors(op.fake, names, fake=True)),
               fake=True),
        lib=lib)
    if backward is not None:
        ov = getattr(getattr(getattr(torch.ops, NAMESPACE), op.name), overload)
        lib.impl(qualified, make_autograd_kernel(ov, _backward_with_tensors(backward, names)),
                 "Autograd", with_keyset=True)


def deregister(lib: Library) -> None:
    """Undo :func:`register`: ``Library._destroy`` drops the definitions, kernels and fakes and
    clears the cached ``torch.ops.npu.<name>`` packets (wrappers set on them go too)."""
    _captured.clear()
    lib._destroy()
