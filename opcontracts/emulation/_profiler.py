"""``torch_npu.profiler`` and ``torch_npu.profiler.profiler``: the names code imports (MindSpeed's
training loop and auto-parallel search import them at start-up, and build a profiler only when
asked to profile).

The option classes hold torch_npu's values (``torch_npu/profiler/experimental_config.py`` over
``analysis/prof_common_func/_constant.py``): ``ProfilerLevel``, ``AiCMetrics``, ``ExportType``,
``HostSystem``; ``ProfilerActivity`` has ``CPU`` and ``NPU``.  Profiling itself (``profile``,
``schedule``, ``tensorboard_trace_handler``, ``analyse`` of collected data) needs the NPU's
profiling driver: on the emulation each raises the not-emulated error when called.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable
from typing import Any

__all__ = ["fill_profiler", "fill_profiler_module"]

_OPTIONS: dict[str, dict[str, str]] = {
    "ProfilerLevel": {"Level0": "Level0", "Level1": "Level1", "Level2": "Level2",
                      "Level_none": "Level_none"},
    "AiCMetrics": {"PipeUtilization": "ACL_AICORE_PIPE_UTILIZATION",
                   "ArithmeticUtilization": "ACL_AICORE_ARITHMETIC_UTILIZATION",
                   "Memory": "ACL_AICORE_MEMORY_BANDWIDTH", "MemoryL0": "ACL_AICORE_L0B_AND_WIDTH",
                   "MemoryUB": "ACL_AICORE_MEMORY_UB",
                   "ResourceConflictRatio": "ACL_AICORE_RESOURCE_CONFLICT_RATIO",
                   "L2Cache": "ACL_AICORE_L2_CACHE", "MemoryAccess": "ACL_AICORE_MEMORY_ACCESS",
                   "AiCoreNone": "ACL_AICORE_NONE"},
    "ExportType": {"Db": "db", "Text": "text"},
    "HostSystem": {"CPU": "cpu", "MEM": "mem", "DISK": "disk", "NETWORK": "network",
                   "OSRT": "osrt", "NUMA": "numa"},
}


class ProfilerActivity(enum.Enum):
    """torch_npu's profiler activities (``torch_npu._C._profiler.ProfilerActivity``)."""

    CPU = 0
    NPU = 1


def _needs_driver(qualname: str, not_emulated: Callable[[str, str], str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(not_emulated(qualname, "function")
                                  + ": profiling needs the NPU's profiling driver")
    call.__name__ = qualname.rpartition(".")[2]
    return call


def fill_profiler(module: types.ModuleType, not_emulated: Callable[[str, str], str]) -> None:
    """``torch_npu.profiler``."""
    for name, values in _OPTIONS.items():
        cls = type(name, (), dict(values))
        cls.__module__ = module.__name__
        setattr(module, name, cls)
    ProfilerActivity.__module__ = module.__name__
    module.ProfilerActivity = ProfilerActivity  # type: ignore[attr-defined]

    class _ExperimentalConfig:
        """The profiler's experimental options, recorded as given."""

        def __init__(self, **options: Any) -> None:
            self.__dict__.update(options)

    _ExperimentalConfig.__module__ = module.__name__
    module._ExperimentalConfig = _ExperimentalConfig  # type: ignore[attr-defined]
    module.supported_activities = lambda: {ProfilerActivity.CPU, ProfilerActivity.NPU}  # type: ignore[attr-defined]
    module.supported_profiler_level = lambda: set(_OPTIONS["ProfilerLevel"].values())  # type: ignore[attr-defined]
    module.supported_ai_core_metrics = lambda: set(_OPTIONS["AiCMetrics"].values())  # type: ignore[attr-defined]
    module.supported_export_type = lambda: set(_OPTIONS["ExportType"].values())  # type: ignore[attr-defined]
    for name in ("profile", "schedule", "tensorboard_trace_handler"):
        fn = _needs_driver(f"torch_npu.profiler.{name}", not_emulated)
        fn.__module__ = module.__name__
        setattr(module, name, fn)
    module.__all__ = [*_OPTIONS, "ProfilerActivity", "_ExperimentalConfig",  # type: ignore[attr-defined]
                      "supported_activities", "supported_profiler_level",
                      "supported_ai_core_metrics", "supported_export_type", "profile",
                      "schedule", "tensorboard_trace_handler"]
    module.__doc__ = "opcontracts emulation of torch_npu.profiler (its names; no profiling)."


def fill_profiler_module(module: types.ModuleType, not_emulated: Callable[[str, str], str]) -> None:
    """``torch_npu.profiler.profiler``: ``profile``, ``tensorboard_trace_handler``, ``analyse``."""
    parent = __import__("torch_npu.profiler", fromlist=["profile"])
    module.profile = parent.profile  # type: ignore[attr-defined]
    module.tensorboard_trace_handler = parent.tensorboard_trace_handler  # type: ignore[attr-defined]
    analyse = _needs_driver("torch_npu.profiler.profiler.analyse", not_emulated)
    analyse.__module__ = module.__name__
    module.analyse = analyse  # type: ignore[attr-defined]
    module.__doc__ = "opcontracts emulation of torch_npu.profiler.profiler (no profiling)."
