"""Streams, events, device contexts and graphs of the emulated ``npu`` device.

On an NPU, kernels are queued on streams and run asynchronously; events mark points in a
stream and time the work between them; an ``NPUGraph`` captures the kernels a block of code
launches and replays them on the same memory.  On the emulation every op has finished when it
returns, so:

* ``Stream``: ``query()`` is True, ``synchronize()`` / ``wait_stream`` / ``wait_event`` return
  at once; ``torch.npu.stream(s)`` makes ``s`` the current stream for the block
  (``current_stream()`` returns it), as scripts that overlap work expect;
* ``Event(enable_timing=True)``: ``record()`` takes the host clock, so ``elapsed_time(end)``
  is the milliseconds of host time between the two records (the emulation's, not an NPU's);
* ``NPUGraph``: ``with torch.npu.graph(g):`` runs the block and records every op it
  dispatches on its tensors (a ``TorchDispatchMode``); ``g.replay()`` runs the recorded ops
  again in order and writes each result into the tensor the capture returned, so the block's
  output tensors hold the new results, as after a graph replay on the NPU.  Random ops draw
  again from the generator at each replay.  Python code between the ops is not replayed,
  as on the NPU.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["api"]


def api(mod: types.ModuleType) -> dict[str, Any]:
    """The stream, event, device-context and graph names of the device module ``mod``."""
    state: dict[str, Any] = {}

    def _index(device: Any) -> int:
        if device is None:
            return int(mod.current_device())
        if isinstance(device, torch.device):
            return 0 if device.index is None else int(device.index)
        if isinstance(device, str):
            index = torch.device(device).index
            return 0 if index is None else int(index)
        return int(device)

    class Stream:
        """An npu stream (``torch.npu.Stream``): the emulation runs every op when it is
        called, so the stream never has pending work."""

        def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            self.device = torch.device("npu", _index(device))
            self.priority = priority
            self.device_index = self.device.index
            self.device_type = "npu"
            self.npu_stream = id(self)
            self.stream_id = id(self)

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            return None

        def wait_stream(self, stream: Any) -> None:
            return None

        def wait_event(self, event: Any) -> None:
            return None

        def record_event(self, event: Any = None) -> Any:
            event = Event() if event is None else event
            event.record(self)
            return event

        def __enter__(self) -> Stream:
            self._previous = current_stream()
            set_stream(self)
            return self

        def __exit__(self, *exc: Any) -> None:
            set_stream(self._previous)

        def __repr__(self) -> str:
            return f"<torch_npu.npu.Stream device={self.device} npu_stream={self.npu_stream:#x}>"

    def _default() -> Stream:
        if "default" not in state:  # made at first use: "npu" is a device type only then
            state["default"] = Stream()
        return state["default"]  # type: ignore[no-any-return]

    class Event:
        """An npu event (``torch.npu.Event``): ``record`` takes the host clock."""

        def __init__(self, enable_timing: bool = False, blocking: bool = False,
                     interprocess: bool = False, **kwargs: Any) -> None:
            self.enable_timing = enable_timing
            self.blocking = blocking
            self.interprocess = interprocess
            self._time: float | None = None

        def record(self, stream: Any = None) -> None:
            self._time = time.perf_counter()

        def wait(self, stream: Any = None) -> None:
            return None

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            return None

        def elapsed_time(self, end_event: Event) -> float:
            if not (self.enable_timing and end_event.enable_timing):
                raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
            if self._time is None or end_event._time is None:
                raise RuntimeError("Both events must be recorded before calculating elapsed time.")
            return (end_event._time - self._time) * 1000.0

        def __repr__(self) -> str:
            return f"<torch_npu.npu.Event {'recorded' if self._time is not None else 'uninitialized'}>"

    def current_stream(device: Any = None) -> Stream:
        _index(device)
        return state.get("current") or _default()  # type: ignore[no-any-return]

    def default_stream(device: Any = None) -> Stream:
        _index(device)
        return _default()

    def set_stream(stream: Stream | None) -> None:
        if stream is not None:
            state["current"] = stream

    class StreamContext:
        """``torch.npu.stream(s)``: ``s`` is the current stream inside the block."""

        def __init__(self, stream: Stream | None) -> None:
            self.stream = stream
            self._previous: Stream | None = None

        def __enter__(self) -> Stream | None:
            if self.stream is not None:
                self._previous = current_stream()
                set_stream(self.stream)
            return self.stream

        def __exit__(self, *exc: Any) -> None:
            if self._previous is not None:
                set_stream(self._previous)

    def stream(stream: Stream | None) -> StreamContext:
        return StreamContext(stream)

    class device:  # noqa: N801 - torch.npu.device, named as the real one
        """``with torch.npu.device(i):`` device ``i`` is the current device in the block."""

        def __init__(self, device: Any) -> None:
            self.idx = -1 if device is None else _index(device)
            self.prev_idx = -1

        def __enter__(self) -> None:
            if self.idx == -1:
                return
            self.prev_idx = int(mod.current_device())
            if self.idx != self.prev_idx:
                mod.set_device(self.idx)

        def __exit__(self, *exc: Any) -> None:
            if self.idx != -1 and self.prev_idx != self.idx:
                mod.set_device(self.prev_idx)

    class device_of(device):  # noqa: N801
        """``with torch.npu.device_of(tensor):`` the tensor's device in the block."""

        def __init__(self, obj: Any) -> None:
            super().__init__(obj.get_device() if getattr(obj, "is_npu", False) else -1)

    class NPUGraph:
        """``torch.npu.NPUGraph``: capture (``torch.npu.graph``) records the ops a block
        dispatches; ``replay()`` runs them again into the captured outputs."""

        def __init__(self, keep_graph: bool = False) -> None:
            self._steps: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
            self._recorder: _Recorder | None = None

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            if self._recorder is not None:
                raise RuntimeError("NPUGraph.capture_begin: this graph is already capturing")
            self._steps = []
            self._recorder = _Recorder(self._steps)
            self._recorder.__enter__()

        def capture_end(self) -> None:
            if self._recorder is None:
                raise RuntimeError("NPUGraph.capture_end: capture_begin was not called")
            recorder, self._recorder = self._recorder, None
            recorder.__exit__(None, None, None)

        def replay(self) -> None:
            for func, args, kwargs, out in self._steps:
                _replay_step(func, args, kwargs, out)

        def reset(self) -> None:
            self._steps = []

        def pool(self) -> tuple[int, int]:
            return (0, id(self))

        def debug_dump(self, debug_path: str) -> None:
            return None

    class graph:  # noqa: N801 - torch.npu.graph, named as the real one
        """``with torch.npu.graph(g):`` captures the block into ``g``."""

        def __init__(self, npu_graph: NPUGraph, pool: Any = None, stream: Any = None,
                     capture_error_mode: str = "global", **kwargs: Any) -> None:
            self.npu_graph = npu_graph
            self.pool = pool
            self.capture_error_mode = capture_error_mode

        def __enter__(self) -> None:
            mod.synchronize()
            self.npu_graph.capture_begin(pool=self.pool,
                                         capture_error_mode=self.capture_error_mode)

        def __exit__(self, *exc: Any) -> None:
            self.npu_graph.capture_end()

    def graph_pool_handle() -> tuple[int, int]:
        return (0, 0)

    def make_graphed_callables(callables: Any, sample_args: Any, num_warmup_iters: int = 3,
                               allow_unused_input: bool = False, pool: Any = None) -> Any:
        return callables  # run eagerly: the same results, without the graph

    names: dict[str, Any] = {}
    for obj in (Stream, Event, StreamContext, device, device_of, NPUGraph, graph):
        obj.__module__ = mod.__name__
        obj.__qualname__ = obj.__name__
        names[obj.__name__] = obj
    for fn in (current_stream, default_stream, set_stream, stream, graph_pool_handle,
               make_graphed_callables):
        fn.__module__ = mod.__name__
        names[fn.__name__] = fn
    return names


# -- graph capture ----------------------------------------------------------------------------

class _Recorder(TorchDispatchMode):
    """Runs each op as usual and records it with its outputs."""

    def __init__(self, steps: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]]) -> None:
        super().__init__()
        self.steps = steps

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.steps.append((func, args, kwargs, out))
        return out


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _replay_step(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """Run one recorded op again; a new result is written into the tensor the capture
    returned (a view, or an argument the op wrote to, already shares the memory)."""
    fresh = func(*args, **kwargs)
    if getattr(func, "is_view", False):
        return
    inputs = {id(t) for t in _tensors((args, tuple(kwargs.values())))}
    for old, new in zip(_tensors(out), _tensors(fresh), strict=False):
        if id(old) in inputs or old is new:
            continue
        with torch.no_grad():
            old.copy_(new)

