"""Contracts for torch_npu ops public code calls: the in-place accumulations
(npu_grouped_matmul_add_, npu_add_quant_matmul_: Ascend 950, no reference) and the preparation
ops (npu_quantize's div_mode cases, npu_format_cast).

A right call passes strict; a wrong dtype or shape raises naming the argument; the versions and
chips a contract speaks for are the ones it applies on.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _strict import violation as _violation

import opcontracts

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I64 = torch.int64


@pytest.fixture
def a5() -> Iterator[None]:
    with opcontracts.versions(torch_npu="2.14.0", cann="9.0.0", soc="Ascend950PR"):
        yield


def _applies(op: str, **versions: str) -> bool:
    """Whether a contract of ``op`` applies on the stack ``versions`` states."""
    from opcontracts._engine import registry

    with opcontracts.versions(**versions):
        return registry.resolve(op) is not None


def _gmm_add(**over: Any) -> dict[str, Any]:
    call = {"self": torch.zeros(4, 64, 32), "x": torch.zeros(20, 64, dtype=BF16),
            "weight": torch.zeros(20, 32, dtype=BF16),
            "group_list": torch.tensor([5, 11, 15, 20])}
    return {**call, **over}


def test_grouped_matmul_add_inplace_as_mindspeed_calls_it(a5: None) -> None:
    with opcontracts.mode("strict"):
        opcontracts.check("npu_grouped_matmul_add_", **_gmm_add())
    exc = _violation("npu_grouped_matmul_add_", **_gmm_add(self=torch.zeros(4, 64, 32, dtype=BF16)))
    assert exc.arg == "self" and "argument 'self'" in str(exc)
    assert _violation("npu_grouped_matmul_add_",
                      **_gmm_add(weight=torch.zeros(20, 32, dtype=FP16))).arg == "weight"
    assert _violation("npu_grouped_matmul_add_",
                      **_gmm_add(self=torch.zeros(4, 64, 33))).arg in ("self", "weight")
    assert _violation("npu_grouped_matmul_add_",
                      **_gmm_add(group_list=torch.tensor([5, 11, 15, 20], dtype=torch.int32))
                      ).arg == "group_list"


def test_grouped_matmul_add_inplace_speaks_for_the_documented_releases() -> None:
    """The in-place op is in the schema from 2.5.1.post1, documented (with the out-of-place
    one) only from the 2.13 doc group: no contract applies before."""
    a5 = {"cann": "9.0.0", "soc": "Ascend950PR"}
    assert not _applies("npu_grouped_matmul_add_", torch_npu="2.7.1.post4", **a5)
    assert _applies("npu_grouped_matmul_add_", torch_npu="2.7.1.post11", **a5)


def _quant_add(**over: Any) -> dict[str, Any]:
    call = {"self": torch.zeros(32, 48), "x1": torch.zeros(64, 32, dtype=torch.int8),
            "x2": torch.zeros(64, 48, dtype=torch.int8),
            "x2_scale": torch.zeros(1, 48, 2, dtype=torch.uint8),
            "x1_scale": torch.zeros(1, 32, 2, dtype=torch.uint8), "group_sizes": [1, 1, 32]}
    return {**call, **over}


def test_add_quant_matmul_inplace(a5: None) -> None:
    with opcontracts.mode("strict"):
        opcontracts.check("npu_add_quant_matmul_", **_quant_add())
    exc = _violation("npu_add_quant_matmul_", **_quant_add(self=torch.zeros(32, 48, dtype=BF16)))
    assert exc.arg == "self" and "argument 'self'" in str(exc)
    assert _violation("npu_add_quant_matmul_",
                      **_quant_add(x1=torch.zeros(2, 64, 32, dtype=torch.int8))).arg == "x1"
    assert _violation("npu_add_quant_matmul_", **_quant_add(self=torch.zeros(32))).arg == "self"


def test_add_quant_matmul_is_ascend_950s() -> None:
    stack = {"torch_npu": "2.14.0", "cann": "9.0.0"}
    assert not _applies("npu_add_quant_matmul_", soc="Ascend910B3", **stack)
    assert _applies("npu_add_quant_matmul_", soc="Ascend950DT", **stack)


def test_quantize_div_mode_chooses_the_zero_points_rules() -> None:
    x = torch.randn(4, 8)
    scales = torch.rand(8) + 0.5
    with opcontracts.mode("strict"):
        # div_mode True (the default): integer (or bf16) zero points
        opcontracts.check("npu_quantize", x, scales, torch.zeros(8, dtype=torch.int32),
                          torch.qint8, 1)
        # div_mode False: zero points in scales' dtype and shape
        opcontracts.check("npu_quantize", x, scales, torch.zeros(8), torch.qint8, 1, False)
    exc = _violation("npu_quantize", x, scales, torch.zeros(8), torch.qint8, 1, True)
    assert exc.arg == "zero_points" and "div_mode" in str(exc)
    exc = _violation("npu_quantize", x, scales, torch.zeros(8, dtype=torch.int32), torch.qint8, 1,
                     False)
    assert exc.arg == "zero_points"
    assert _violation("npu_quantize", x, scales, torch.zeros(4), torch.qint8, 1, False
                      ).arg == "zero_points"
    # fp16 scales only with div_mode False
    assert _violation("npu_quantize", x, scales.half(), None, torch.qint8, 1, True).arg == "scales"
    # left out, div_mode is the schema's default (True) of the release pinned
    with opcontracts.versions(torch_npu="2.14.0"):
        assert _violation("npu_quantize", x, scales.half(), None, torch.qint8).arg == "scales"
    assert _violation("npu_quantize", x.double(), scales, None, torch.qint8).arg == "self"


class _Format(enum.IntEnum):  # torch_npu.Format is an IntEnum
    ND = 2
    FRACTAL_NZ = 29


def test_format_cast_takes_any_tensor_and_format() -> None:
    with opcontracts.mode("strict"):
        opcontracts.check("npu_format_cast", torch.zeros(1, 2, 32, 16, dtype=FP16), 29)
        opcontracts.check("npu_format_cast", torch.zeros(4, 4, dtype=torch.int8), _Format.ND)
        # the npu_format_cast.Tensor overload: a destination tensor in acl_format's place
        opcontracts.check("npu_format_cast", torch.zeros(4, 4), torch.zeros(4, 4))
    exc = _violation("npu_format_cast", [1.0, 2.0], 2)
    assert exc.arg == "self" and "argument 'self'" in str(exc)


def test_dtype_cast_casts_as_the_doc_shows_and_its_gradient_comes_back(npu: Any) -> None:
    """torch_npu 2.14.0 doc: ``npu_dtype_cast([0, 0.5, -1.], dtype=torch.int)`` is ``[0, 0, -1]``;
    the node keeps no tensor and casts the gradient back to the input's dtype."""
    got = npu.npu_dtype_cast(torch.tensor([0.0, 0.5, -1.0]), dtype=torch.int)
    assert got.dtype == torch.int32 and got.tolist() == [0, 0, -1]
    x = torch.rand(3, 4, requires_grad=True)
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = npu.npu_dtype_cast(x, torch.float16)
    assert y.dtype == FP16 and not kept  # NpuDtypeCastBackward0 saves nothing
    (y.float() * 2).sum().backward()
    assert x.grad is not None and x.grad.dtype == FP32 and torch.equal(x.grad, torch.full((3, 4), 2.0))
    with opcontracts.mode("strict"):
        opcontracts.check("npu_dtype_cast", torch.zeros(2, dtype=BF16), torch.float32)
    with pytest.raises(NotImplementedError, match="hifloat8"):
        npu.npu_dtype_cast(torch.rand(2), 290)  # torch_npu.hifloat8: not emulated
