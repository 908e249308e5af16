"""Objects built for a stand-in module, put into it named as the real module names them (their
``__module__`` and ``__qualname__``: a traceback, a ``repr`` and a contract's target read the
real module's names)."""

from __future__ import annotations

import types
from typing import Any


def own(module: types.ModuleType, objects: list[Any], *, public: bool = True) -> None:
    """Put ``objects`` into ``module`` under their names; with ``public`` they are its
    ``__all__``."""
    for obj in objects:
        obj.__module__ = module.__name__
        obj.__qualname__ = obj.__name__
        setattr(module, obj.__name__, obj)
    if public:
        module.__all__ = [obj.__name__ for obj in objects]  # type: ignore[attr-defined]
