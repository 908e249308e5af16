"""Preflight's fake device: torch's FakeTensorMode, with the device memory its tensors would take.

Why fake tensors: a tensor under ``FakeTensorMode`` has a dtype, a shape, strides and a device
but no memory, and every op computes only its outputs' metadata (the meta kernels, and the
emulation's fakes for the NPU ops, ``emulation/_fakes.py``).  A full-size training step then
costs the Python of its ops, not their FLOPs or their bytes, and the guards judge the fake
tensors' dtypes and shapes as they would the real ones.

What this adds to the fake mode:

* the device memory: every storage on the ``npu`` device that an op creates is counted while
  it lives (``weakref.finalize`` on the storage, whose Python object torch keeps as long as
  the storage lives), so ``peak`` is the most the step held at once: what the real run would
  need per device (parameters, gradients, optimizer state, activations), before the
  allocator's fragmentation and the workspace of the kernels;
* ``Module.to(dtype)`` / ``.npu()`` on a model of fake parameters: torch swaps a fake
  parameter's contents (``torch.utils.swap_tensors``), which refuses a tensor with a weak
  reference, and the fake mode's memo keeps one to every tensor it made.  While the mode is
  entered, ``swap_tensors`` first empties that memo (a cache of real-to-fake conversions: a
  real tensor converted again afterwards gets a new fake, nothing else changes).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.utils
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves

__all__ = ["FakeDevice", "DEVICE_TYPE"]

DEVICE_TYPE = "npu"


class _CountingMode(FakeTensorMode):
    """A FakeTensorMode that counts the bytes of the live ``npu`` storages its ops create."""

    def __init__(self, counter: _Memory) -> None:
        # real tensors met inside (a batch read from a file, a constant made before) become
        # fake ones: the script's data pipeline runs as it is
        super().__init__(allow_non_fake_inputs=True)
        self._counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        counter = self._counter
        if isinstance(out, FakeTensor):
            if out.device.type == DEVICE_TYPE:
                counter.see(out)
        elif isinstance(out, (tuple, list)):
            for t in tree_leaves(out):
                if isinstance(t, FakeTensor) and t.device.type == DEVICE_TYPE:
                    counter.see(t)
        return out


class _Memory:
    """Live bytes of the device's storages, and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.storages = 0
        self._seen: dict[int, int] = {}
        self._lock = threading.Lock()

    def see(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen:
            return
        n = int(storage.nbytes())
        with self._lock:
            self._seen[key] = n
            self.live += n
            self.storages += 1
            if self.live > self.peak:
                self.peak = self.live
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            n = self._seen.pop(key, 0)
            self.live -= n


class FakeDevice:
    """Enter: tensors made inside are fake (``FakeTensorMode``), the ``npu`` ones counted.

    ``peak`` / ``live``: device bytes (the most held at once / held now).  Not reentrant."""

    def __init__(self) -> None:
        self.memory = _Memory()
        self.mode = _CountingMode(self.memory)
        self._swap: Any = None

    @property
    def peak(self) -> int:
        return self.memory.peak

    @property
    def live(self) -> int:
        return self.memory.live

    def __enter__(self) -> FakeDevice:
        original = torch.utils.swap_tensors
        memo = self.mode.fake_tensor_converter.meta_converter.tensor_memo

        def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
            if isinstance(t1, FakeTensor) or isinstance(t2, FakeTensor):
                memo.clear()  # its weak references would make the swap refuse
            original(t1, t2)

        self._swap = original
        torch.utils.swap_tensors = swap_tensors  # type: ignore[assignment]
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            torch.utils.swap_tensors = self._swap
