"""Values judged on the device and read back once: what keeps an observer from stalling it.

On an accelerator every host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``)
waits for the device queue to drain.  An observer that reads once per guarded call (the NaN
sentinel's finiteness check, the compare's metrics) turns every guarded call into a
synchronisation.  Instead, each check leaves a few numbers on the device (a tensor's smallest
and largest element, a vector of metrics: a few bytes, no read) together with what it needs to
become a finding (``payload``), and the waiting numbers are fetched in one transfer per device
at a step boundary, in the order the checks were made.  Two containers, one contract:

* ``Slots``: fixed-width checks written in place (``out=``) into buffers made once and reused
  from read to read; the NaN sentinel's, a few hundred numbers a step, where allocating and
  stacking a tensor per number was most of the cost;
* ``Pending``: device tensors of any size, each kept as it came (the shadow compare's metric
  vectors, the culprit's NaN and inf counts).

``StepBoundary`` (the end of ``optimizer.step()``, for a long run) is where both observers read.

Bounded: each reads by itself when ``limit`` checks are waiting (a run that never asks for a
result holds at most ``limit`` checks and their payloads).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Pending", "Slots", "StepBoundary"]

P = TypeVar("P")


class Pending(Generic[P]):
    """Device values waiting to be read, each with its payload, in the order they came.

    ``on_full`` is called (outside the lock) when ``limit`` values are waiting: the owner reads
    them then, so that memory stays bounded in a run that never asks.

    Kept flat (the tensors in one list, how many belong to each payload in another), so that
    the read stacks the one list."""

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
            # every payload ``w0`` scalars (the culprit's counts): one flat list, sliced
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


class _Buffer:
    """One (device, dtype)'s numbers: chunks allocated once and reused from read to read, and a
    0-d view of each element (made once, when its position is first reached), which a check
    writes into with ``out=``."""

    __slots__ = ("chunks", "views", "n", "cap", "dtype", "device")

    CHUNK = 1024  # numbers per chunk: 512 checks of the NaN sentinel

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.chunks: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        self.n = 0  # numbers written since the last read
        self.cap = 0  # numbers the chunks hold (len(views))
        self.dtype = dtype
        self.device = device
        self.grow(1)

    def grow(self, end: int) -> None:
        """Chunks enough for ``end`` numbers."""
        while end > self.cap:
            chunk = torch.empty(self.CHUNK, dtype=self.dtype, device=self.device)
            self.chunks.append(chunk)
            self.views.extend(chunk.unbind())
            self.cap = len(self.views)

    def written(self, n: int) -> list[torch.Tensor]:
        """The first ``n`` numbers, as a view of each chunk they are in (nothing copied)."""
        full, rest = divmod(n, self.CHUNK)
        parts = self.chunks[:full]
        if rest:
            parts.append(self.chunks[full][:rest])
        return parts


class Slots(Generic[P]):
    """Fixed-width checks (``width`` numbers each: the NaN sentinel's smallest and largest
    element of a tensor) computed on the device straight into buffers made once, each with its
    payload, in the order they came; read back in ONE host read per device.

    Why in place (``out=`` into 0-d views of a reused buffer per device and dtype) rather than
    ``Pending``'s new tensors: a reduction that returns new 0-d tensors allocates two per
    checked tensor, and the read must stack them, a view each (~80 of the read's ~190 us on
    the demo's 6-layer step); written in place, a check allocates nothing and the read is one
    slice of a buffer per device.  The buffers are overwritten after each read: the read waits for the
    device (``tolist``), so every number has been consumed by then.

    Use: ``put_many(items, reduce)`` with the (tensor, payload) pairs of one observed call."""

    def __init__(self, width: int = 2, limit: int = 4096,
                 on_full: Callable[[], None] | None = None) -> None:
        self.width = width
        self.limit = limit
        self.on_full = on_full
        self.lock = threading.Lock()
        self._buffers: dict[tuple[torch.dtype, torch.device], _Buffer] = {}
        # per check, in execution order: its buffer, its position there, its payload
        self._checks: list[tuple[_Buffer, int, P]] = []

    def __len__(self) -> int:
        return len(self._checks)

    def put_many(self, items: list[tuple[torch.Tensor, P]],
                 reduce: Callable[..., object]) -> None:
        """``reduce(x, out=views)`` for each (x, payload) of ``items``, in order: each check's
        ``width`` numbers written into the buffer of ``x``'s dtype and device, one lock for
        all (an observer's whole call); reads (``on_full``) afterwards when ``limit`` checks
        are waiting.  The hot path of the NaN sentinel: per check a dict lookup, the
        position, the reduction; no other call."""
        w = self.width
        with self.lock:
            buffers = self._buffers
            checks = self._checks
            for x, payload in items:
                key = (x.dtype, x.device)
                buf = buffers.get(key)
                if buf is None:
                    buffers[key] = buf = _Buffer(x.dtype, x.device)
                pos = buf.n
                end = buf.n = pos + w
                if end > buf.cap:
                    buf.grow(end)
                checks.append((buf, pos, payload))
                views = buf.views
                out = (views[pos], views[pos + 1]) if w == 2 else tuple(views[pos:end])
                try:
                    reduce(x, out=out)
                except BaseException:
                    for v in out:  # the slot is taken: finite, not a stale number
                        v.fill_(0)
                    raise
            full = len(checks) >= self.limit
        if full and self.on_full is not None:
            self.on_full()

    def clear(self) -> None:
        with self.lock:
            self._take()

    def _take(self) -> tuple[list[tuple[_Buffer, int, P]], list[tuple[_Buffer, int]]]:
        """The waiting checks and the buffers they wrote (with how much), emptied for reuse."""
        checks, self._checks = self._checks, []
        used = [(b, b.n) for b in self._buffers.values() if b.n]
        for b, _ in used:
            b.n = 0
        return checks, used

    def read(self, only_nonfinite: bool = False) -> list[tuple[P, list[float]]]:
        """Every waiting (payload, numbers), in order, in ONE host read per device; with
        ``only_nonfinite``, only those with a NaN or an infinity among their numbers (a read
        whose numbers are all finite is told by their sum, without a loop over the checks)."""
        with self.lock:
            checks, used = self._take()
            if not checks:
                return []
            by_device: dict[torch.device, list[tuple[_Buffer, int]]] = {}
            for b, n in used:
                by_device.setdefault(b.device, []).append((b, n))
            where: dict[int, tuple[list[float], int]] = {}  # id(buffer) -> (numbers, offset)
            finite = True
            for bufs in by_device.values():
                parts = [p for b, n in bufs for p in b.written(n)]
                # the one read of this device (cat promotes several dtypes to the widest)
                flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
                off = 0
                for b, n in bufs:
                    where[id(b)] = (flat, off)
                    off += n
                # a NaN or an infinity makes the sum non-finite; finite numbers of a float32 or
                # narrower dtype cannot overflow a double's sum (a float64 one can: then the
                # loop below decides, exactly)
                finite = finite and math.isfinite(sum(flat))
        if only_nonfinite and finite:
            return []
        w = self.width
        isfinite = math.isfinite
        out: list[tuple[P, list[float]]] = []
        for b, pos, payload in checks:
            flat, off = where[id(b)]
            nums = flat[off + pos:off + pos + w]
            if only_nonfinite and all(isfinite(x) for x in nums):
                continue
            out.append((payload, nums))
        return out


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
