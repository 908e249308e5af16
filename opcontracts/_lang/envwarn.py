"""Warnings about settings read from the environment (``OPCONTRACTS_CONTRACTS``, ...).

Such a warning is about the user's start-up, so it is shown at the user's line: the first
frame outside opcontracts, importlib and runpy (the script's ``import opcontracts.patch``, the
``opcontracts`` console script's line), not at opcontracts' own line, whatever chain of calls
and imports reached it.  Each distinct message is shown once per process: the same variable
read twice (``opcontracts run`` applies the patch its import already applied) warns once.

No torch import: ``import opcontracts`` must stay light.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from types import FrameType

__all__ = ["warn_setting", "user_frame"]

_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # opcontracts/
         os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep)
_FROZEN = ("<frozen importlib", "<frozen runpy", "<frozen zipimport")
_RUNPY = os.sep + "runpy.py"

_lock = threading.Lock()
_shown: set[tuple[str, str]] = set()


def _internal(filename: str) -> bool:
    return filename.startswith(_OURS) or filename.startswith(_FROZEN) or filename.endswith(_RUNPY)


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The first frame outside opcontracts, importlib and runpy, or ``None``."""
    f: FrameType | None = start if start is not None else sys._getframe(1)
    while f is not None and _internal(f.f_code.co_filename):
        f = f.f_back
    return f


def warn_setting(variable: str, message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn ``"{variable}: {message}"`` once per process, at the user's start-up line."""
    text = f"{variable}: {message}"
    with _lock:
        if (variable, text) in _shown:
            return
        _shown.add((variable, text))
    f = user_frame(sys._getframe(1))
    if f is None:  # nothing of the user's on the stack (python -m opcontracts ...)
        warnings.warn_explicit(text, category, f"<{variable}>", 0, module=variable)
        return
    g = f.f_globals
    where = (text, category, f.f_code.co_filename, f.f_lineno)
    module = str(g.get("__name__", "<unknown>"))
    registry = g.setdefault("__warningregistry__", {})
    try:
        warnings.warn_explicit(*where, module=module, registry=registry, module_globals=g)
    except ImportError:  # `python -c`: the source lookup through __main__'s loader fails
        warnings.warn_explicit(*where, module=module, registry=registry)


def reset() -> None:
    """Forget which messages were shown (tests)."""
    with _lock:
        _shown.clear()
