"""What fake tensors cannot do, said as one line at the user's line.

A fake tensor has no values: reading one (``.item()``, ``.tolist()``, ``int(t)``, ``if t:``,
``f"{loss:.3f}"``, ``.numpy()``) or making a tensor whose shape depends on values
(``torch.nonzero``, ``x[mask]``, ``torch.unique``, ``torch.bincount``) stops the step inside
torch's fake tensor machinery.  ``explain`` turns such an exception into one message naming
the user's line (the innermost frame outside torch, opcontracts and the standard library), what
it did, and the two ways on: give preflight the value, or skip that part, both through
``opcontracts.preflight.active()`` (docs/preflight.md).
"""

from __future__ import annotations

import linecache
import os
import sysconfig
from types import TracebackType

__all__ = ["explain", "user_line"]

_STDLIB = tuple(os.path.abspath(p) + os.sep for p in
                {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})

_HOW = ("give preflight the value (`n = 4096 if opcontracts.preflight.active() else "
        "t.item()`), or skip that part (`if not opcontracts.preflight.active(): ...`); "
        "see docs/preflight.md")

# what the op that failed means at the user's line
_VALUE_READ = "reads a tensor's value (.item(), .tolist(), int()/float()/bool() of a tensor, " \
              "a tensor in an if or while)"
_SHAPE_FROM_VALUES = {
    "nonzero": "makes a tensor whose shape depends on values (torch.nonzero, x[mask], "
               "torch.where(cond))",
    "bincount": "makes a tensor whose shape depends on values (torch.bincount)",
    "_unique2": "makes a tensor whose shape depends on values (torch.unique)",
    "unique_dim": "makes a tensor whose shape depends on values (torch.unique)",
    "unique_consecutive": "makes a tensor whose shape depends on values (torch.unique_consecutive)",
    "repeat_interleave": "makes a tensor whose shape depends on values (torch.repeat_interleave "
                         "with tensor repeats)",
    "masked_select": "makes a tensor whose shape depends on values (torch.masked_select)",
}


def _ours(filename: str) -> bool:
    from .._engine.callsite import _ours as engine_ours

    return engine_ours(filename) or os.path.abspath(filename).startswith(_STDLIB)


def user_line(tb: TracebackType | None) -> tuple[str, int, str] | None:
    """(file, line, source) of the innermost frame of ``tb`` outside torch, opcontracts and the
    standard library: the user's line that set off what failed."""
    found = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not _ours(name):
            found = (name, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    return found[0], found[1], linecache.getline(found[0], found[1]).strip()


def _what(exc: BaseException) -> str | None:
    """What the user's line did that fake tensors cannot, from the exception; None: not that."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    func = getattr(exc, "func", None)
    name = str(getattr(func, "__name__", func or "")).split(".")[0]
    if isinstance(exc, DataDependentOutputException):
        return _VALUE_READ
    if isinstance(exc, DynamicOutputShapeException):
        return _SHAPE_FROM_VALUES.get(name, f"makes a tensor whose shape depends on values "
                                            f"(aten.{name})")
    if isinstance(exc, UnsupportedOperatorException):
        return f"calls aten.{name}, which has no fake (meta) kernel: preflight cannot run it"
    kind = type(exc).__name__
    if kind in ("GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound"):
        return "branches on a value computed from tensors (a data-dependent branch)"
    text = str(exc)
    if isinstance(exc, RuntimeError) and ".numpy() is not supported" in text:
        return "reads a tensor's values (.numpy())"
    if isinstance(exc, TypeError) and "FakeTensor.__format__" in text:
        return "formats a tensor's value (f\"{t:.3f}\")"
    if isinstance(exc, RuntimeError) and ("data pointer" in text or "data_ptr" in text):
        return "reads a tensor's memory (data_ptr(), a C extension reading the values)"
    return None


_DATA = os.sep + os.path.join("torch", "utils", "data") + os.sep
_LOADER = ("a torch DataLoader, which reads values (its random seed, the samples it collates); "
           "give the step a batch of the right shape instead (`batch = torch.zeros(B, S, "
           "dtype=torch.long, device='npu') if opcontracts.preflight.active() else "
           "next(batches)`)")


def _through_data_loader(tb: TracebackType | None) -> bool:
    while tb is not None:
        if _DATA in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def explain(exc: BaseException) -> str | None:
    """One message for an exception fake tensors caused, at the user's line; None for any
    other exception (the script's own error)."""
    what = _what(exc)
    if what is None:
        return None
    if _through_data_loader(exc.__traceback__):
        what = f"runs {_LOADER}"
    where = user_line(exc.__traceback__)
    if where is None:
        at = "the script"
    else:
        at = f"{where[0]}:{where[1]}" + (f": `{where[2]}`" if where[2] else "")
    return (f"preflight stopped at {at}: it {what}; fake tensors have shapes and dtypes, not "
            f"values. To go on, {_HOW}")
