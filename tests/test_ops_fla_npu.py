"""fla_npu's gated delta-net backward chunk kernels (contracts/fla_npu/gated_delta_rule.toml).

No reference models them (reference/_unmodelled.py says why): these tests hold the contracts
themselves.  A call as MindSpeed-MM's Qwen3.5 backward makes it (GVA: H_v = 2 H_k, varlen B = 1,
fp32 gate and beta) passes strict; a wrong dtype or shape raises naming the argument; the two
rules the fla_npu sources disagree on take either text.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _strict import violation as _violation

import opcontracts

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HK, HV, T, K, V, C, NC = 2, 4, 128, 128, 128, 64, 2
VARLEN = {"cu_seqlens": [0, 64, 128], "chunk_indices": [0, 0, 1, 0]}


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _dhu() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return ((_t(1, HK, T, K), _t(1, HK, T, K), _t(1, HV, T, K), _t(1, HV, T, V), _t(1, HV, T, V)),
            {"scale": K ** -0.5, "chunk_size": C, "g": _t(1, HV, T, dtype=FP32), "gK": None,
             "h0": None, "dht": None, **VARLEN})


def _dqkwg() -> tuple[tuple[Any, ...], dict[str, Any]]:
    h = _t(1, HV, NC, K, V)
    return ((_t(1, HK, T, K), _t(1, HK, T, K), _t(1, HV, T, V), _t(1, HV, T, dtype=FP32), h,
             _t(1, HV, T, V), h.clone(), _t(1, HV, T, V), C), {"scale": K ** -0.5, **VARLEN})


def _da() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return ((_t(1, HK, T, K), _t(1, HV, T, V), _t(1, HV, T, dtype=FP32), _t(1, HV, T, C),
             _t(1, HV, T, K), _t(1, HV, T, V), _t(1, HV, T, dtype=FP32)),
            {"chunk_size": C, **VARLEN})


def _full() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return ((_t(1, HK, T, K), _t(1, HV, T, V), _t(1, HV, T, dtype=FP32), _t(1, HV, T, C),
             _t(1, HV, T, C), _t(1, HV, T, K), _t(1, HV, T, V), _t(1, HV, T, dtype=FP32), C),
            dict(VARLEN))


CALLS = {
    "fla_npu.npu_chunk_gated_delta_rule_bwd_dhu": (_dhu, ["q", "k", "w", "d_o", "dv"]),
    "fla_npu.npu_chunk_bwd_dqkwg": (_dqkwg, ["q", "k", "v", "g", "h", "dox", "dh", "dv"]),
    "fla_npu.npu_prepare_wy_repr_bwd_da": (_da, ["k", "v", "beta", "A", "dw", "du", "g"]),
    "fla_npu.npu_prepare_wy_repr_bwd_full": (_full, ["k", "v", "beta", "A", "dA", "dw", "du",
                                                     "g"]),
}


def _named(op: str) -> dict[str, Any]:
    build, names = CALLS[op]
    args, kwargs = build()
    return {**dict(zip(names + ["chunk_size"], args)), **kwargs}


@pytest.mark.parametrize("op", CALLS)
def test_mindspeed_mm_call_passes_strict(op: str) -> None:
    args, kwargs = CALLS[op][0]()
    with opcontracts.mode("strict"):
        opcontracts.check(op, *args, **kwargs)


@pytest.mark.parametrize(("op", "name"), [(op, n) for op, (_, names) in CALLS.items()
                                          for n in names])
def test_wrong_dtype_names_the_argument(op: str, name: str) -> None:
    call = _named(op)
    call[name] = call[name].to(torch.float64)
    exc = _violation(op, **call)
    assert exc.arg == name and exc.rule == "dtype"
    assert f"argument '{name}'" in str(exc)


@pytest.mark.parametrize(("op", "name", "shape"), [
    ("fla_npu.npu_chunk_gated_delta_rule_bwd_dhu", "w", (1, HV, T + 1, K)),
    ("fla_npu.npu_chunk_gated_delta_rule_bwd_dhu", "g", (1, HV + 1, T)),
    ("fla_npu.npu_chunk_bwd_dqkwg", "h", (1, HV, NC, K, V + 1)),
    ("fla_npu.npu_prepare_wy_repr_bwd_da", "A", (1, HV, T + 1, C)),
    ("fla_npu.npu_prepare_wy_repr_bwd_full", "g", (1, HV, T - 1)),
])
def test_wrong_shape_names_the_argument(op: str, name: str, shape: tuple[int, ...]) -> None:
    call = _named(op)
    call[name] = _t(*shape, dtype=call[name].dtype)
    exc = _violation(op, **call)
    assert exc.arg == name and f"argument '{name}'" in str(exc)


def test_fp32_state_gradient_is_caught() -> None:
    """dqkwg's h / dh are fp16/bf16 only: an fp32 state (fla's Triton path keeps it in fp32)
    is the kind of mix-up the guard exists for."""
    call = _named("fla_npu.npu_chunk_bwd_dqkwg")
    call["dh"] = call["dh"].float()
    exc = _violation("fla_npu.npu_chunk_bwd_dqkwg", **call)
    assert exc.arg == "dh"


@pytest.mark.parametrize("op", ["fla_npu.npu_prepare_wy_repr_bwd_da",
                                "fla_npu.npu_prepare_wy_repr_bwd_full"])
def test_chunk_size_must_be_a_last_axis(op: str) -> None:
    call = _named(op)
    call["chunk_size"] = 128  # allowed on its own, but A was built for 64-token chunks
    exc = _violation(op, **call)
    assert exc.arg == "chunk_size" and "C = 64" in str(exc)
    call["chunk_size"] = 32
    assert _violation(op, **call).arg == "chunk_size"


def test_sources_disagreements_let_either_text_through() -> None:
    """prepare_wy_repr_bwd_full's dw: the pinned README says k's heads, later docs the value
    heads (what dqkwg returns); bwd_dhu's g: optional in the pinned README."""
    call = _named("fla_npu.npu_prepare_wy_repr_bwd_full")
    with opcontracts.mode("strict"):
        opcontracts.check("fla_npu.npu_prepare_wy_repr_bwd_full", **call)
        call["dw"] = _t(1, HK, T, K)
        opcontracts.check("fla_npu.npu_prepare_wy_repr_bwd_full", **call)
        dhu = _named("fla_npu.npu_chunk_gated_delta_rule_bwd_dhu")
        dhu["g"] = None
        opcontracts.check("fla_npu.npu_chunk_gated_delta_rule_bwd_dhu", **dhu)
    call["dw"] = _t(1, HV, T, K + 1)  # the feature size still binds with k's
    assert _violation("fla_npu.npu_prepare_wy_repr_bwd_full", **call).arg == "dw"
