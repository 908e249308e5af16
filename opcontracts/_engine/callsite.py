"""Find the caller's frame: the first one outside opcontracts and torch's dispatch glue."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import FrameType

__all__ = ["CallSite", "find_call_site"]

# the opcontracts package (this file is opcontracts/_engine/callsite.py)
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


# torch's own frames (dispatch modes, autograd engine entry, dynamo's wrappers, _ops.py) sit
# between our wrapper and the user's line; the call site is the first frame in neither package.
_TORCH_DIR = _torch_dir()
_SKIP_SUFFIXES = (os.sep + "contextlib.py", os.sep + "functools.py")
_EXTRA_SKIP: list[str] = []  # folders of stand-in modules (the emulation) also count as ours


def _ours(filename: str) -> bool:
    if filename.startswith(_PKG_DIR) and os.sep + "tests" + os.sep not in filename:
        return True
    if filename.startswith("<opcontracts"):
        return True
    if filename.startswith(_TORCH_DIR) or filename.endswith(_SKIP_SUFFIXES):
        return True
    return any(filename.startswith(p) for p in _EXTRA_SKIP)


@dataclass(frozen=True)
class CallSite:
    filename: str
    lineno: int
    function: str
    module: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


def find_call_site(start: FrameType | None = None) -> CallSite | None:
    f: FrameType | None = start if start is not None else sys._getframe(1)
    while f is not None and _ours(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return None
    return CallSite(f.f_code.co_filename, f.f_lineno, f.f_code.co_name,
                    str(f.f_globals.get("__name__", "?")))
