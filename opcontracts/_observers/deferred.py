"""Values judged on the device and read back once: what keeps an observer from stalling it.

On an accelerator every host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``)
waits for the device queue to drain.  An observer that reads once per guarded call (the NaN
sentinel's finiteness check, the compare's metrics) turns every guarded call into a
synchronisation.  Instead, each check leaves a few numbers on the device (a float32 sum, a
vector of metrics: a few bytes, no read) together with what it needs to become a finding
(``payload``), and ``Pending.read`` fetches all of them in one transfer per device at a step
boundary, in the order the checks were made.  The NaN sentinel and the shadow compare share
this one mechanism, and ``StepBoundary`` (the end of ``optimizer.step()``, for a long run)
is where both read.

Bounded: ``Pending`` reads by itself when ``limit`` values are waiting (a run that never asks
for a result still holds at most ``limit`` small tensors and their payloads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Pending", "StepBoundary"]

P = TypeVar("P")


class Pending(Generic[P]):
    """Device values waiting to be read, each with its payload, in the order they came.

    ``on_full`` is called (outside the lock) when ``limit`` values are waiting: the owner reads
    them then, so that memory stays bounded in a run that never asks.

    Kept flat (the tensors in one list, how many belong to each payload in another), so that
    adding is two list operations and the read stacks the one list: the NaN sentinel adds
    two scalars per checked tensor, a few hundred a step."""

    def __init__(self, limit: int = 4096, on_full: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.on_full = on_full
        self._lock = threading.Lock()
        self._parts: list[torch.Tensor] = []
        self._widths: list[int] = []  # tensors of each payload, in ``_parts``
        self._payloads: list[P] = []

    def __len__(self) -> int:
        return len(self._payloads)

    def add(self, value: torch.Tensor | Sequence[torch.Tensor], payload: P) -> None:
        """Keep ``value`` (a device tensor of a few numbers, or several: not read now) with
        ``payload``; ``read`` gives its numbers flattened, in order."""
        with self._lock:
            if isinstance(value, torch.Tensor):
                self._parts.append(value)
                self._widths.append(1)
            else:
                self._parts.extend(value)
                self._widths.append(len(value))
            self._payloads.append(payload)
            full = len(self._payloads) >= self.limit
        if full and self.on_full is not None:
            self.on_full()

    def add_many(self, parts: list[torch.Tensor], payloads: list[P], width: int) -> None:
        """``add`` for several payloads at once, ``width`` tensors each (in order in
        ``parts``): one lock for a whole call's checks."""
        with self._lock:
            self._parts.extend(parts)
            self._widths.extend([width] * len(payloads))
            self._payloads.extend(payloads)
            full = len(self._payloads) >= self.limit
        if full and self.on_full is not None:
            self.on_full()

    def clear(self) -> None:
        with self._lock:
            self._parts, self._widths, self._payloads = [], [], []

    def read(self) -> list[tuple[P, list[float]]]:
        """Every waiting (payload, numbers), in order, in ONE host read per device (the values
        are concatenated on their device first); nothing waits afterwards."""
        with self._lock:
            parts, widths, payloads = self._parts, self._widths, self._payloads
            self._parts, self._widths, self._payloads = [], [], []
        if not payloads:
            return []
        w0 = widths[0]
        if len(parts) == w0 * len(payloads) and widths.count(w0) == len(widths):
            # the NaN sentinel's case: every payload ``w0`` scalars; one flat list, sliced
            try:
                stacked = torch.stack(parts)
            except RuntimeError:  # sizes that differ, or several devices: the general path
                stacked = None
            if stacked is not None and stacked.numel() == len(parts):  # scalars
                flat = stacked.view(-1).tolist()  # the one read
                return [(p, flat[i * w0:(i + 1) * w0]) for i, p in enumerate(payloads)]
        rows = _numbers(parts)
        out: list[tuple[P, list[float]]] = []
        pos = 0
        for payload, w in zip(payloads, widths):
            if w == 1:
                out.append((payload, rows[pos]))
            else:
                got: list[float] = []
                for r in rows[pos:pos + w]:
                    got.extend(r)
                out.append((payload, got))
            pos += w
        return out


def _numbers(parts: list[torch.Tensor]) -> list[list[float]]:
    """The numbers of each tensor of ``parts``, in ONE host read per device."""
    if not parts:
        return []
    try:  # the common case: parts of one size on one device, stacked (no reshape each)
        rows = torch.stack(parts).reshape(len(parts), -1).tolist()  # the one read
    except RuntimeError:  # sizes that differ, or several devices
        pass
    else:
        return rows  # type: ignore[no-any-return]
    numbers: list[list[float]] = [[] for _ in parts]
    by_device: dict[torch.device, list[int]] = {}
    for j, x in enumerate(parts):
        by_device.setdefault(x.device, []).append(j)
    for idx in by_device.values():
        # cat promotes (float32 checks with float64 metrics): the one read of this device
        flat = [parts[j].reshape(-1) for j in idx]
        joined = torch.cat(flat).tolist()
        pos = 0
        for j, x in zip(idx, flat):
            n = x.numel()
            numbers[j] = joined[pos:pos + n]
            pos += n
    return numbers


class StepBoundary:
    """Call ``callback`` after every ``optimizer.step()`` of any ``torch.optim.Optimizer``
    (torch's global step post-hook) until ``remove()``: the natural end of a training step,
    where an observer reads what the step left on the device."""

    def __init__(self, callback: Callable[[], object]) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            callback()

        self._handle: Any = register_optimizer_step_post_hook(hook)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
