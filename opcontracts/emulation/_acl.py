"""``acl``: CANN's Python API (pyACL), which CANN's ``set_env.sh`` puts on an NPU machine's
``PYTHONPATH`` and MindSpeed imports at start-up (``acl.get_soc_name()`` picks per-SoC code
paths; ``acl.rt`` asks for devices and memory).

pyACL's runtime functions return their ACL error code last (0: success), values before it:
``acl.rt.get_device_count() -> (count, ret)``, ``acl.rt.get_mem_info(attr) -> (free, total,
ret)``, ``acl.rt.set_device(id) -> ret``.  On the emulation they answer for the emulated device
(its SoC, its count, host memory); a device index it does not have is ACL's invalid-device code
(107001), as ``aclrtSetDevice`` returns it.  A real pyACL on ``sys.path`` is never shadowed.
"""

from __future__ import annotations

import types
from typing import Any

from . import _device, _npu_api

__all__ = ["fill_acl"]

ACL_ERROR_RT_INVALID_DEVICEID = 107001
_SUCCESS = 0


def _device_ok(device_id: Any) -> bool:
    module = _device.module()
    return module is not None and 0 <= int(device_id) < module.device_count()


def fill_acl(module: types.ModuleType) -> None:
    """``acl`` with ``get_soc_name`` and ``acl.rt``."""
    rt = types.ModuleType("acl.rt", "opcontracts emulation of pyACL's runtime functions (acl.rt).")

    def get_soc_name():  # type: ignore[no-untyped-def]
        """The emulated SoC (``torch_npu.npu.get_device_name()``)."""
        return _device.reported_soc()

    def get_device_count():  # type: ignore[no-untyped-def]
        device = _device.module()
        return (device.device_count() if device is not None else 0), _SUCCESS

    def get_mem_info(attr=0):  # type: ignore[no-untyped-def]
        free, total = _npu_api.mem_get_info()
        return free, total, _SUCCESS

    def set_device(device_id):  # type: ignore[no-untyped-def]
        if not _device_ok(device_id):
            return ACL_ERROR_RT_INVALID_DEVICEID
        _device.module().set_device(int(device_id))  # type: ignore[union-attr]
        return _SUCCESS

    def reset_device(device_id):  # type: ignore[no-untyped-def]
        return _SUCCESS if _device_ok(device_id) else ACL_ERROR_RT_INVALID_DEVICEID

    for fn in (get_device_count, get_mem_info, set_device, reset_device):
        fn.__module__ = rt.__name__
        setattr(rt, fn.__name__, fn)
    get_soc_name.__module__ = module.__name__
    module.get_soc_name = get_soc_name  # type: ignore[attr-defined]
    module.rt = rt  # type: ignore[attr-defined]
    module.__doc__ = "opcontracts emulation of pyACL (acl): get_soc_name and acl.rt."
