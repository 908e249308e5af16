"""An op's parameters as one torch_npu release's schema states them, defaults included.

A guard on a real ``torch.ops.npu`` packet binds a call to the op's dispatcher schema, so an
argument left out is judged at the schema's default (``expert_tokens_num_flag=False``).
``opcontracts.check(op, ...)`` has no packet to read: it takes the same parameters from the
wheel digest, for the torch_npu release detected or pinned (``set_versions``), so a call is
judged as the kernel would see it.  Nothing here imports torch.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

from .._engine.compile import Param

__all__ = ["params_for"]

_NPU = "torch.ops.npu."


def _default(text: str | None) -> tuple[bool, Any]:
    """(whether the schema's default could be read, its value)."""
    if text is None:
        return False, None
    try:
        return True, ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


@functools.lru_cache(maxsize=512)
def _params(release: str, op: str) -> tuple[Param, ...] | None:
    from .digest import DigestError, op_schemas

    try:
        schemas = op_schemas(release)
    except (KeyError, DigestError, OSError, ValueError):  # a release the digest does not hold
        return None
    found = schemas.get(op)
    if not found:
        return None
    out = []
    only_out = found[0].overload == "out"  # an op whose one schema is its out overload
    for p in found[0].params:
        has, value = _default(p.default)
        if only_out and p.kw_only and not has:  # given by name, or all in one out=(...)
            has = True
        out.append(Param(p.name, "KEYWORD_ONLY" if p.kw_only else "POSITIONAL_OR_KEYWORD",
                         value, has))
    if only_out and not any(p.name == "out" for p in out):
        # torch_npu's Python binding takes the out tensors as one out=(...) tuple
        # (npu_hans_encode(x, statistic, reshuff, out=(pdf, mantissa, fixed, var)))
        out.append(Param("out", "KEYWORD_ONLY", None, True))
    out_overload = next((s for s in found[1:] if s.overload == "out"), None)
    if out_overload is not None:  # a call with the out tensors binds too, as the guard binds it
        have = {p.name for p in out}
        out += [Param(p.name, "KEYWORD_ONLY", None, True)
                for p in out_overload.params if p.name not in have]
        if "out" not in have:  # torch_npu's Python binding takes them as one out=(...) tuple
            out.append(Param("out", "KEYWORD_ONLY", None, True))
    return tuple(out)


def params_for(targets: tuple[str, ...], release: str | None) -> list[Param] | None:
    """The default overload's parameters of the ``torch.ops.npu`` op among ``targets`` in
    torch_npu ``release``; None when no target is one, the release is unknown or the digest
    does not hold it (the caller falls back to the contract's own signature)."""
    if not release:
        return None
    for t in targets:
        if t.startswith(_NPU):
            got = _params(release, t[len(_NPU):])
            return list(got) if got is not None else None
    return None
