"""Find the caller's frame: the first one outside opcontracts and torch's dispatch glue."""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from types import CodeType, FrameType

__all__ = ["CallSite", "SiteToken", "find_call_site", "site_token", "site_of", "user_frame",
           "warn_at_caller"]

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


def warn_at_caller(message: str, category: type[Warning] = RuntimeWarning,
                   start: FrameType | None = None) -> None:
    """``warnings.warn`` at the user's line: the first frame outside opcontracts and torch
    (``find_call_site``), whatever the depth of opcontracts' own frames between (a fixed
    ``stacklevel`` points at opcontracts' lines as soon as a path is one frame longer: an
    observer's read from ``optimizer.step()``, a backward hook, a layer wrapper).  With no
    such frame (a backward worker thread, the command line's own calls) it is shown at
    ``<opcontracts>``, never at a line of opcontracts or of the launcher.  Deduplicated as
    ``warnings.warn`` does (the frame's ``__warningregistry__``)."""
    f: FrameType | None = start if start is not None else sys._getframe(1)
    while f is not None and (_ours(f.f_code.co_filename)
                             or f.f_code.co_filename.startswith("<frozen importlib")):
        f = f.f_back
    if f is None:
        warnings.warn_explicit(message, category, "<opcontracts>", 0, module="opcontracts",
                               registry=_no_frame_registry)
        return
    g = f.f_globals
    warnings.warn_explicit(message, category, f.f_code.co_filename, f.f_lineno,
                           module=str(g.get("__name__", "?")),
                           registry=g.setdefault("__warningregistry__", {}), module_globals=g)


_no_frame_registry: dict[str | tuple[str, type[Warning], int], int] = {}


# --------------------------------------------------------------------------- the cheap form
# What an observer keeps per call (``site_token``): the caller's code object, line and module,
# no text and no frame (a frame would keep the caller's locals, the job's tensors, alive).  The
# text (``CallSite``) is made only when a finding is reported (``site_of``).  Whether a code
# object is ours is decided once per code object (``_kinds``: code -> its module's name, or
# None for ours), so the walk is a dict lookup per frame instead of the path tests.
SiteToken = tuple[CodeType, int, str]

_kinds: dict[CodeType, str | None] = {}
_kinds_skip = 0  # len(_EXTRA_SKIP) the cache was made with (a new folder clears it)
_KINDS_MAX = 65536  # a process that makes code objects without end (exec) cannot grow it forever


def _first_user(start: FrameType | None) -> FrameType | None:
    """The first frame from ``start`` up whose code is not ours (opcontracts, torch), or None;
    whether a code object is ours is decided once (``_kinds``), so the walk is a dict lookup
    per frame."""
    global _kinds_skip
    kinds = _kinds
    if _kinds_skip != len(_EXTRA_SKIP) or len(kinds) > _KINDS_MAX:
        kinds.clear()
        _kinds_skip = len(_EXTRA_SKIP)
    f = start
    while f is not None:
        code = f.f_code
        try:
            mod = kinds[code]
        except KeyError:
            mod = None if _ours(code.co_filename) else str(f.f_globals.get("__name__", "?"))
            kinds[code] = mod
        if mod is not None:
            return f
        f = f.f_back
    return None


def site_token(start: FrameType | None) -> SiteToken | None:
    """``find_call_site`` without the text: (code, line, module) of the caller, or None.
    About half a microsecond for the usual one or two frames above the wrapper."""
    f = _first_user(start)
    if f is None:
        return None
    code = f.f_code
    return code, f.f_lineno, _kinds.get(code) or "?"


def user_frame(start: FrameType) -> FrameType:
    """The first frame above ``start`` outside opcontracts and torch (``start`` itself when
    there is none): the frame whose code and line key a call site's caches, so calls through
    a guarded packet's ``__call__``, a stand-in module or the observer layer count at the
    user's line, not at ours."""
    return _first_user(start) or start


def site_of(token: SiteToken | None) -> CallSite | None:
    """The ``CallSite`` of a ``site_token`` (made when a finding is reported)."""
    if token is None:
        return None
    code, lineno, mod = token
    return CallSite(code.co_filename, lineno, code.co_name, mod)
