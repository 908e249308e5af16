"""NPU storage formats on the emulation: ``torch_npu.get_npu_format`` and the format cast's
forms (``npu_format_cast`` to a format or to another tensor's, ``npu_format_cast_`` in place),
as torch_npu keeps them per storage (``opcontracts/emulation/_formats.py``), on the emulated
npu device and on CPU tensors; the values never change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

ND, NCHW, NZ, NCDHW = 2, 0, 29, 30


@pytest.fixture(params=["device", "cpu"])
def where(request: pytest.FixtureRequest, emulated: Callable[..., None]) -> Callable[..., Any]:
    """Tensors on the emulated npu device, or CPU tensors without it."""
    emulated("wide", device=request.param == "device")
    if request.param == "device":
        return lambda t: t.npu()
    return lambda t: t


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_new_tensor_has_the_base_format_of_its_dims(where: Callable[..., Any]) -> None:
    import torch_npu

    fmts = [torch_npu.get_npu_format(where(torch.zeros(*([2] * n)))) for n in (1, 2, 3, 4, 5)]
    assert fmts == [ND, ND, ND, NCHW, NCDHW]  # torch_npu's GuessBaseFormat
    assert str(fmts[0]) == "ND" and isinstance(fmts[0], torch_npu.Format)


def test_a_cast_gives_the_format_and_keeps_the_values(where: Callable[..., Any]) -> None:
    import torch_npu

    t = where(torch.rand(15, 17).half())
    nz = torch_npu.npu_format_cast(t, NZ)
    assert torch_npu.get_npu_format(nz) == NZ and str(torch_npu.get_npu_format(nz)) == "FRACTAL_NZ"
    assert torch_npu.get_npu_format(t) == ND  # the source keeps its own
    assert torch.equal(nz.cpu(), t.cpu()) and nz.shape == t.shape
    assert torch_npu.get_npu_format(nz.view(-1)) == NZ  # a view shares its storage's format
    back = torch_npu.npu_format_cast(nz, ND)
    assert torch_npu.get_npu_format(back) == ND and torch.equal(back.cpu(), t.cpu())
    # the format it already has: the same storage back, no copy
    assert _ptr(torch_npu.npu_format_cast(nz, NZ)) == _ptr(nz)
    assert _ptr(torch_npu.npu_format_cast(t, ND)) == _ptr(t)
    # NZ needs two dims: a 1-D tensor stays ND
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast(where(torch.rand(12)), NZ)) == ND


def test_in_place_and_to_another_tensors_format(where: Callable[..., Any]) -> None:
    import torch_npu

    t = where(torch.rand(8, 16).half())
    values, ptr = t.cpu().clone(), _ptr(t)
    assert torch_npu.npu_format_cast_(t, NZ) is t
    assert torch_npu.get_npu_format(t) == NZ and _ptr(t) == ptr
    torch_npu.npu_format_cast_(t, ND)
    assert torch_npu.get_npu_format(t) == ND and torch.equal(t.cpu(), values)
    ref = torch_npu.npu_format_cast(where(torch.rand(8, 16).half()), NZ)
    src = where(torch.rand(8, 16).half())
    like = torch_npu.npu_format_cast(src, ref)  # npu_format_cast.Tensor: ref's format
    assert torch_npu.get_npu_format(like) == NZ and torch.equal(like.cpu(), src.cpu())
    torch_npu.npu_format_cast_(src, ref)  # in place, to ref's format
    assert torch_npu.get_npu_format(src) == NZ


def test_the_gradient_passes_through_the_cast(where: Callable[..., Any]) -> None:
    import torch_npu

    x = where(torch.rand(4, 8)).requires_grad_()
    y = torch_npu.npu_format_cast(x, NZ)
    (y * 3).sum().backward()
    assert x.grad is not None and torch.equal(x.grad.cpu(), torch.full((4, 8), 3.0))


def test_traced_tensors_keep_no_format_and_trace(where: Callable[..., Any]) -> None:
    """Fake tensors (``FakeTensorMode``, ``torch.export``'s tracing) have no storage to keep a
    format on: they read as their base format, and a cast traces as one op."""
    import torch_npu
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        nz = torch_npu.npu_format_cast(torch.empty(8, 16, dtype=torch.float16), NZ)
        assert nz.shape == (8, 16) and torch_npu.get_npu_format(nz) == ND

    class Cast(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch_npu.npu_format_cast(x, NZ) * 2

    x = where(torch.rand(8, 16).half())
    ep = torch.export.export(Cast(), (x,), strict=False)
    assert "npu_format_cast" in ep.graph_module.code
    assert torch.equal(ep.module()(x).cpu(), x.cpu() * 2)
