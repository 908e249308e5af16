"""NPU storage formats on the emulation: what ``torch_npu.get_npu_format`` reports of a tensor
and what ``npu_format_cast`` (and its in-place and ``.Tensor`` forms) does to it.

torch_npu keeps a format per storage (its storage descriptor): a new tensor has its base
format, guessed from its dims (``InferFormat::GuessBaseFormat``: 5 dims NCDHW, 4 NCHW, else
ND); ``npu_format_cast`` gives a tensor in another format, the same tensor's storage when the
format is already that one, and NZ asked of fewer than 2 dims gives ND
(``InferFormat::GuessStorageFormat``).  Public code decides on it: vllm-ascend casts weights to
FRACTAL_NZ (29) and checks it, torch_npu's fused optimizers compare a parameter's format with
its gradient's, kernels pick a path by ``get_npu_format(t) in (0, 2)``.

The emulation stores every format's values as ND bytes (the values never change) and keeps the
format's name on the storage: on the CPU storage an npu tensor's memory is (``_device``: the
npu storage's ``_opcontracts_cpu``), which its views and the kernels' CPU views share, so a
format the kernel sets is the one ``get_npu_format`` reads afterwards.  What it does not know:
the base format of a storage made with other dims than the tensor now has (a 4-D tensor viewed
as 2-D reports ND here, NCHW on the NPU).
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Any

import torch

__all__ = ["Format", "base_format", "format_of", "get_npu_format", "set_format",
           "storage_format"]

_ATTR = "_opcontracts_npu_format"
class Format(IntEnum):
    """torch_npu's ``Format`` (``torch_npu/npu/_format.py``): the ACL storage formats, an int
    each; ``str()`` is the name."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33
    NC = 35
    NCL = 47
    FRACTAL_NZ_C0_16 = 50
    FRACTAL_NZ_C0_32 = 51
    FRACTAL_NZ_C0_2 = 52
    FRACTAL_NZ_C0_4 = 53
    FRACTAL_NZ_C0_8 = 54

    def __str__(self) -> str:
        return self.name


NCHW, ND, FRACTAL_NZ, NCDHW = (int(f) for f in (Format.NCHW, Format.ND, Format.FRACTAL_NZ,
                                                Format.NCDHW))


def base_format(ndim: int) -> int:
    """``InferFormat::GuessBaseFormat``: the format of a new tensor of ``ndim`` dims."""
    return NCDHW if ndim == 5 else NCHW if ndim == 4 else ND


def storage_format(ndim: int, fmt: int) -> int:
    """The format a cast to ``fmt`` gives a tensor of ``ndim`` dims: NZ needs 2 dims
    (``InferFormat::GuessStorageFormat``: fewer give ND)."""
    return ND if fmt == FRACTAL_NZ and ndim < 2 else int(fmt)


def _storage(t: torch.Tensor) -> Any:
    """The storage object the format lives on: an npu tensor's CPU storage (shared by its views
    and the kernels' CPU views of it), else the tensor's own."""
    s = t.untyped_storage()
    return getattr(s, "_opcontracts_cpu", s)


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` has no memory of its own to keep a format on: a meta tensor, or a fake one
    (torch's ``is_fake``: a ``FakeTensor``, or a functional or subclass wrapper of fakes, as
    ``torch.export`` and AOT tracing hand the glue).  No fake can exist before torch's fake
    tensor module is imported, so it is not imported here."""
    if t.device.type == "meta":
        return True
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and bool(fake.is_fake(t))


def format_of(t: torch.Tensor) -> int:
    """The format ``t``'s storage has: the one a cast set, else the base format of its dims."""
    if _traced(t):
        return base_format(t.dim())
    fmt = getattr(_storage(t), _ATTR, None)
    return base_format(t.dim()) if fmt is None else int(fmt)


def set_format(t: torch.Tensor, fmt: int) -> None:
    """Give ``t``'s storage the format ``fmt`` (a traced tensor has none to keep)."""
    if not _traced(t):
        setattr(_storage(t), _ATTR, int(fmt))


def get_npu_format(tensor: torch.Tensor) -> Format:
    """``torch_npu.get_npu_format``: the tensor's storage format, as torch_npu's ``Format``."""
    return Format(format_of(tensor))
