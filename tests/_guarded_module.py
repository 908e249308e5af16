"""A throw-away module of functions guarded by test contracts, shared by the observers' tests."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opcontracts import Contract, nan, patch
from opcontracts._engine import registry


@contextlib.contextmanager
def guarded_module(name: str, functions: Mapping[str, Callable[..., Any]],
                   contracts: Sequence[Contract]) -> Iterator[types.ModuleType]:
    """Module ``name`` holding ``functions``, in ``sys.modules``, with ``contracts`` applied by
    the patch.  After: an active NaN sentinel disabled, and the patch, ``sys.modules`` and the
    registry as they were."""
    was_patched = patch.is_applied()
    before = {c.op for c in registry.all_contracts()}
    mod = types.ModuleType(name)
    for attr, fn in functions.items():
        setattr(mod, attr, fn)
    sys.modules[name] = mod
    patch.apply(list(contracts))
    try:
        yield mod
    finally:
        s = nan.active()
        if s is not None:
            s.disable()
        patch.unpatch()
        del sys.modules[name]
        for c in registry.all_contracts():
            if c.op not in before:
                registry.unregister(c.op)
        if was_patched:
            patch.apply()
