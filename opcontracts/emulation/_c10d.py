"""``torch_npu._C._distributed_c10d``: the HCCL process group's ``Options``, which MindSpeed
builds for Megatron's process groups (``get_nccl_options`` wrapped: an ``hccl_config`` with the
group's name and buffer size).

torch_npu binds ``ProcessGroupHCCL.Options`` (``torch_npu/csrc/distributed/Init.cpp``) with
``op_timeout``, ``is_high_priority_stream``, ``global_ranks_in_group``, ``hccl_config`` and
``group_id``.  There is no HCCL on a CPU machine (``transfer_to_npu`` makes ``nccl`` groups
``gloo``, which takes no backend options): the options are built and read as on the NPU, and
a group made with them is a gloo group.
"""

from __future__ import annotations

import datetime
import types
from typing import Any

__all__ = ["fill_c"]


class _Options:
    """ProcessGroupHCCL.Options: the HCCL settings of one process group."""

    # the fields are attributes of the class, as pybind's def_readwrite makes them (MindSpeed
    # asks hasattr(ProcessGroupHCCL.Options, "hccl_config"))
    op_timeout: datetime.timedelta | None = None
    is_high_priority_stream: bool = False
    global_ranks_in_group: list[int] | None = None
    hccl_config: dict[str, Any] | None = None
    group_id: str = ""

    def __init__(self) -> None:
        self.op_timeout = datetime.timedelta(minutes=30)
        self.is_high_priority_stream = False
        self.global_ranks_in_group = []
        self.hccl_config = {}
        self.group_id = ""


def fill_c(module: types.ModuleType) -> None:
    """``torch_npu._C`` with ``_distributed_c10d.ProcessGroupHCCL.Options``."""
    c10d = types.ModuleType("torch_npu._C._distributed_c10d",
                            "opcontracts emulation of torch_npu's distributed bindings (the HCCL "
                            "process group's Options).")
    hccl = type("ProcessGroupHCCL", (), {"__doc__": "torch_npu's HCCL process group (its Options)."})
    _Options.__name__ = _Options.__qualname__ = "Options"
    _Options.__module__ = c10d.__name__
    hccl.Options = _Options  # type: ignore[attr-defined]
    hccl.__module__ = c10d.__name__
    c10d.ProcessGroupHCCL = hccl  # type: ignore[attr-defined]
    module._distributed_c10d = c10d  # type: ignore[attr-defined]
    module.__doc__ = "opcontracts emulation of torch_npu._C (the distributed bindings MindSpeed reads)."
