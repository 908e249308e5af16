"""The ``torch.ops`` namespaces the patch guards, and what fills each with its ops.

* ``torch.ops.npu``: importing torch_npu registers its ops (the patch's import hook retries
  pending targets when ``torch_npu`` finishes importing);
* ``torch.ops.atb``: torch_npu's ATB plugin, ``torch_npu/lib/libop_plugin_atb.so``, which
  ``torch.ops.load_library`` loads: torch_npu's own ``op_plugin/atb/_atb_ops.py`` when NNAL is
  installed, or later code (dlinfer's ``vendor/ascend/pytorch_patch.py``).  No import announces
  it, so while a target in such a namespace is pending the patch wraps
  ``torch.ops.load_library`` (``LibraryWatch``) and retries after each load.  The wrapper costs
  nothing on any op's call path (libraries load a few times per process) and is removed when
  nothing is pending or at ``unpatch``.

A target in any other ``torch.ops`` namespace is guarded the same way once its op exists.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["LIBRARY_NAMESPACES", "OP_NAMESPACES", "LibraryWatch", "missing_op", "namespace_of"]

OP_NAMESPACES: dict[str, str] = {
    "npu": "importing torch_npu registers them",
    "atb": "torch_npu's ATB plugin (lib/libop_plugin_atb.so, which needs NNAL) registers them "
           "when torch.ops.load_library loads it",
}
"""namespace -> what registers its ops (the words a not-found target's reason uses)."""

LIBRARY_NAMESPACES = frozenset({"atb"})
"""The namespaces whose ops arrive with ``torch.ops.load_library``, not with an import."""


def namespace_of(target: str) -> str | None:
    """``"atb"`` for ``torch.ops.atb.X`` (any ``torch.ops`` namespace), else None."""
    parts = target.split(".")
    if len(parts) >= 4 and parts[0] == "torch" and parts[1] == "ops":
        return parts[2]
    return None


def missing_op(namespace: str, op: str) -> str:
    """Why ``torch.ops.<namespace>.<op>`` is not there yet."""
    how = OP_NAMESPACES.get(namespace, "the library defining them registers them")
    return f"torch.ops.{namespace} has no op {op!r} yet ({how})"


class LibraryWatch:
    """While installed, ``torch.ops.load_library`` calls ``on_load`` after each library it
    loads (a library that fails to load raises as before, and ``on_load`` does not run)."""

    def __init__(self, on_load: Callable[[], None]) -> None:
        self._on_load = on_load
        self._lock = threading.Lock()
        self._installed: Any = None  # the wrapper set on torch.ops, while installed
        self._had_own = False  # torch.ops held its own attribute before (another wrapper)
        self._previous: Any = None

    @property
    def installed(self) -> bool:
        return self._installed is not None

    def sync(self, pending: Iterable[str]) -> None:
        """Install while a pending target lives in a library-loaded namespace; else remove."""
        want = any(namespace_of(t) in LIBRARY_NAMESPACES for t in pending)
        if want and not self.installed:
            self.install()
        elif not want and self.installed:
            self.remove()

    def install(self) -> None:
        with self._lock:
            if self._installed is not None:
                return
            ops = torch.ops
            self._had_own = "load_library" in vars(ops)
            self._previous = vars(ops).get("load_library")
            original = ops.load_library  # bound method (or someone's wrapper)
            on_load = self._on_load

            @functools.wraps(original)
            def load_library(path: Any) -> Any:
                result = original(path)
                try:
                    on_load()
                except Exception:  # pragma: no cover - the guard never breaks a load
                    pass
                return result

            ops.load_library = load_library  # type: ignore[method-assign]
            self._installed = load_library

    def remove(self) -> None:
        with self._lock:
            if self._installed is None:
                return
            ops = torch.ops
            if vars(ops).get("load_library") is self._installed:  # nobody wrapped it since
                if self._had_own:
                    ops.load_library = self._previous  # type: ignore[method-assign]
                else:
                    delattr(ops, "load_library")
            self._installed = None
            self._previous = None
