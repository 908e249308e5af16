"""Count the host reads of device values: the cost that matters on an accelerator.

On an NPU or GPU, every read of a device value on the host (``t.item()``, ``bool(t)``, ``if t:``,
``t.tolist()``, ``float(t)``, ``int(t)``, ``t.numpy()``) waits until the device queue has run
up to that value: the host stops running ahead of the kernels.  CPU timings cannot show it, but
the reads can be counted anywhere.

Why the methods are wrapped and not a ``TorchFunctionMode``: a mode does see each read made
during forward (checked on torch 2.13: ``item``, ``__bool__`` for ``bool(t)``, ``if t:`` and
``and``/``or``, ``tolist``, ``__float__`` also for ``math.isfinite(t)``, ``__int__``,
``__index__``, ``numpy``), but the mode stack is thread-local state that the
autograd engine does not carry into backward: a read in a tensor hook, a node hook or an
``autograd.Function.backward`` is invisible to it, and that is exactly where the observers read
gradients.  Wrapping the ``torch.Tensor`` methods (for a dunder, assigning it on the class
updates the type's slot, so ``bool(t)`` and ``if t:`` go through it) counts every read from
Python, in any thread, forward and backward alike.  Reads made inside C++ (an op's own
implementation) are not counted; nothing of ours reads that way.

Copies to the host (``t.cpu()``, ``t.to("cpu")``, ``t.to(device="cpu")``) synchronise too; in a
CPU-only process every tensor is on the host already, so they are counted apart (``copies``)
for what they would cost on a device.

    with HostReads() as reads:
        loss = model(batch); loss.backward()
    reads.total, reads.by_kind        # 3, {"item": 2, "__bool__": 1}
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

__all__ = ["COPIES", "READS", "HostReads"]

READS = ("item", "__bool__", "tolist", "__float__", "__int__", "__index__", "__complex__",
         "numpy")  # an f-string of a tensor (``__format__``) reads through ``item``
COPIES = ("cpu", "to")


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``Tensor.to(...)`` call names the CPU as its device."""
    dev = kwargs.get("device", args[0] if args else None)
    if isinstance(dev, (str, torch.device)):
        try:
            return torch.device(dev).type == "cpu"
        except RuntimeError:
            return False
    return False


class HostReads:
    """Counts host reads (``total``, ``by_kind``) and host copies (``copies``) while active.
    One counter at a time (it wraps ``torch.Tensor``'s methods; they are restored on exit)."""

    _lock = threading.Lock()
    _active: HostReads | None = None

    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter()
        self.copies: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def copies_total(self) -> int:
        return sum(self.copies.values())

    def reset(self) -> None:
        self.by_kind.clear()
        self.copies.clear()

    def _wrap(self, name: str, original: Callable[..., Any], copy: bool) -> Callable[..., Any]:
        by_kind, copies = self.by_kind, self.copies

        @functools.wraps(original)
        def counted(t: Any, *args: Any, **kwargs: Any) -> Any:
            if not copy:
                by_kind[name] += 1
            elif name == "cpu" or _to_host(args, kwargs):
                copies[name] += 1
            return original(t, *args, **kwargs)

        return counted

    def __enter__(self) -> HostReads:
        with HostReads._lock:
            if HostReads._active is not None:
                raise RuntimeError("a HostReads counter is active already")
            HostReads._active = self
            for name in READS + COPIES:
                original = getattr(torch.Tensor, name)
                self._saved[name] = torch.Tensor.__dict__.get(name)
                setattr(torch.Tensor, name, self._wrap(name, original, name in COPIES))
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        with HostReads._lock:
            for name, old in self._saved.items():
                if old is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, old)
            self._saved.clear()
            HostReads._active = None
