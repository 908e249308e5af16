"""The loaded modules that hold one of a set of objects: the one sweep the patch and the
observer layer share.

The patch's alias sweeps (``_attach.patcher``: ``from x import f`` rebound to the guard, and
back at unpatch) and the observer layer's (``_observers.layer``: the guards rebound to the
layer's wrappers, and back) run over every loaded module: ~9,000 in a torch_npu + Megatron +
MindSpeed process, ~60 names each, and almost none holds what is looked for.  So a module is
tested in one pass in C (``id`` of each value, a set test), with no bytecode per name; only a
module that holds one is walked by name, by the caller.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, KeysView, Set
from typing import Any

__all__ = ["holding"]


def holding(ids: KeysView[int] | Set[int], *, skip_prefix: str | tuple[str, ...] = ()
            ) -> Iterator[tuple[str, types.ModuleType, dict[str, Any]]]:
    """(name, module, namespace) of the loaded modules holding an object whose ``id`` is in
    ``ids`` (a snapshot of ``sys.modules``: safe while modules change; a module whose name
    starts with ``skip_prefix`` is left out).  The caller still checks each hit by identity
    (an ``id`` may be reused by another object)."""
    if not ids:
        return
    for modname, mod in list(sys.modules.items()):
        if mod is None or modname.startswith(skip_prefix):
            continue
        d = getattr(mod, "__dict__", None)
        if type(d) is not dict or ids.isdisjoint(map(id, d.values())):
            continue
        yield modname, mod, d
