"""CPU emulation of the Ascend NPU fused operators, for machines without torch_npu.

Opt-in and independent of the contract checker: ``import opcontracts`` never imports it.

``install()`` registers the torch_npu MoE / matmul / norm / attention ops as real dispatcher
ops in ``torch.ops.npu`` (reference kernels in plain PyTorch, fake implementations for
``torch.compile``, autograd), and makes ``import torch_npu`` and ``import mindspeed.ops.*``
resolve to thin stand-in modules. The kernels reproduce the failure the project guards
against: under a *kernel dtype profile*, an argument in a dtype the kernel does not support
is silently misread (its bytes reinterpreted as the dtype the kernel assumes), exactly as
the NPU kernels do. Profiles: ``"narrow"`` (default), ``"incident"``, ``"wide"``; see
``PROFILES``.  ``install(device=True)`` also emulates the ``npu`` device (``_device``): npu
tensors over CPU memory, ``torch.npu``, backward on the engine's worker thread as on an NPU.

``install(profile, version="2.13.0")`` reproduces that torch_npu release's structure (which MoE
token ops are autograd-only over an internal ``_npu_*`` op, which grad ops their C++ backward
nodes call: ``structure(version)``), calls backward kernels through captured ``OpOverload``s
as the C++ nodes do, and registers no autograd kernel where torch_npu has no derivative.

Typical use::

    from opcontracts import emulation
    emulation.install("incident")
    import torch_npu
    ...
    emulation.uninstall()
"""

from __future__ import annotations

from ._device import DEFAULT_SOC
from ._device import reserve as reserve_device
from ._install import current_profile, install, installed, installed_release, uninstall
from ._ops import OP_NAMES
from ._profiles import PROFILES, Profile
from ._release import Structure, structure
from ._standins import MODULE_NAMES as STANDIN_MODULES

__all__ = [
    "DEFAULT_SOC",
    "OP_NAMES",
    "PROFILES",
    "STANDIN_MODULES",
    "Profile",
    "Structure",
    "current_profile",
    "install",
    "installed",
    "installed_release",
    "reserve_device",
    "structure",
    "uninstall",
]
