"""Reference implementations of the fused ops, in plain PyTorch: one home for the emulation, the
shadow compare and the probe.

A reference computes what the op's documentation says it computes, at the precision it is given
(fp32 math for fp16/bf16/fp32 inputs, fp64 for fp64), on any device, differentiably: autograd
through it is the reference backward.  It never modifies its inputs.

* the emulation (``opcontracts.emulation``) is "the reference plus a dtype profile": its kernels
  are these functions, entered through the profile's misreading of unsupported dtypes;
* the shadow compare (``opcontracts.compare``) runs the reference on up-cast copies of each
  guarded call's inputs and judges the op's outputs (and the gradients it sends back) against it;
* the probe (``opcontracts probe``) runs the op over a dtype grid on the reference's example
  inputs and reports which dtypes give correct numbers.

Lookup is by op name, as contracts name ops: torch_npu ops by their own name
(``npu_moe_token_unpermute``; ``torch.ops.npu.X``, ``torch_npu.X`` and ``npu::X`` are accepted),
MindSpeed ops as ``mindspeed.<function>`` (``mindspeed.ops.<module>.<function>`` is accepted).

Users add their own::

    from opcontracts import reference
    reference.register("my_op", my_reference_fn)      # same parameters as the op
    reference.get("my_op")                            # Reference(name, forward, ...)

**Adding a shipped op**: in the family module it belongs to
(``_fam_attention.py``, ``_fam_norm_quant.py``, ``_fam_gemm_comm.py``, ``_fam_moe_serving.py``)
write its forward, its example builder (the probe's and the compare test's starting point) and
ONE ``Reference(...)`` entry in that module's ``REFERENCES`` (name, forward, example, source;
``backward`` only for a composite formula (what its node saves comes from the wheels'
``Functions.h``, through the digest), ``grad_of`` for a ``*_grad`` op); ``_table.py``
appends every family's entries.  The emulation's side is one ``EmulatedOp`` entry in the
emulation's family module of the same name (``opcontracts/emulation/_family.py``).  The ops of
the first packs keep their entries in ``_table.py``.  A shipped op with no reference is listed
in ``_unmodelled.py`` with the reason (``unmodelled(name)``).

This package imports nothing from the rest of opcontracts (the emulation imports it, never the
reverse); ``import opcontracts.reference`` does not import torch until a reference is looked up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ._entry import BackwardFn, Reference

__all__ = ["Reference", "canonical", "get", "names", "register", "unmodelled", "unregister"]

_lock = threading.RLock()
_refs: dict[str, Reference] = {}
_loaded = False


def canonical(name: str) -> str:
    """The lookup key for an op name or target path (see the module docstring)."""
    n = name.strip()
    if n.endswith(".default"):
        n = n[: -len(".default")]
    for prefix in ("torch.ops.npu.", "torch_npu.", "npu::"):
        if n.startswith(prefix):
            return n[len(prefix):]
    if n.startswith("mindspeed.ops."):
        return "mindspeed." + n.rsplit(".", 1)[-1]
    return n


def _load() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        from ._table import SHIPPED

        for ref in SHIPPED:
            _refs.setdefault(ref.name, ref)
        _loaded = True


def register(name: str, fn: Callable[..., Any], *, backward: BackwardFn | None = None,
             example: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
             source: str = "", grad_of: str | None = None, replace: bool = False) -> Reference:
    """Register ``fn`` as the reference of op ``name`` (a contract's op name).  ``replace`` is
    needed to override an existing one (a shipped reference included)."""
    if not callable(fn):
        raise TypeError(f"reference for {name!r} must be callable, not {type(fn).__name__}")
    key = canonical(name)
    if not key:
        raise ValueError("reference name must not be empty")
    _load()
    with _lock:
        if key in _refs and not replace:
            raise ValueError(f"op {key!r} already has a reference ({_refs[key].forward!r}); "
                             "pass replace=True to override it")
        ref = Reference(key, fn, backward, example, source, grad_of)
        _refs[key] = ref
        return ref


def unregister(name: str) -> None:
    """Forget the reference of ``name`` (a shipped one comes back only in a new process)."""
    _load()
    with _lock:
        _refs.pop(canonical(name), None)


def get(name: str) -> Reference | None:
    """The reference of op ``name``, or None when it has none."""
    _load()
    return _refs.get(canonical(name))


def unmodelled(name: str) -> str | None:
    """Why shipped op ``name`` has no reference (``_unmodelled.UNMODELLED``), or None: the
    contract guards its calls; no emulated kernel, compare or probe exists for it."""
    from ._unmodelled import UNMODELLED

    return UNMODELLED.get(canonical(name))


def names() -> list[str]:
    """Every op with a reference, sorted."""
    _load()
    with _lock:
        return sorted(_refs)
