"""MindSpeed's batch-matmul communication fusions (contracts/mindspeed/bmm_comm.toml).

Collectives over two groups with no reference (reference/_unmodelled.py says why): these tests
hold the contracts.  The calls of `--moe-bmm-mc2` pass strict; a wrong dtype, a bias that does
not follow x's dtype, a world size the kernel does not take, or a shape that breaks the
documented relations raises naming the argument.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _strict import violation as _violation

import opcontracts

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
AG = "mindspeed.npu_alltoall_allgather_bmm"
RS = "mindspeed.npu_bmm_reducescatter_alltoall"
E, C, H, F, EP, TP = 8, 4, 64, 32, 2, 2


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _ag(**over: Any) -> dict[str, Any]:
    call = {"x": _t(E, C, H // TP), "weight": _t(E // EP, H, F), "group_ep": "ep",
            "group_ep_worldsize": EP, "group_tp": "tp", "group_tp_worldsize": TP, "bias": None,
            "shard_type": 0, "act_type": "None", "need_allgather_out": True}
    return {**call, **over}


def _rs(**over: Any) -> dict[str, Any]:
    call = {"x": _t(E // EP, EP * C, F), "weight": _t(E // EP, F, H), "group_ep": "ep",
            "group_ep_worldsize": EP, "group_tp": "tp", "group_tp_worldsize": TP, "bias": None,
            "shard_type": 0}
    return {**call, **over}


def test_moe_bmm_mc2_calls_pass_strict() -> None:
    with opcontracts.mode("strict"):
        opcontracts.check(AG, **_ag())
        opcontracts.check(AG, **_ag(x=_t(E, C // TP, H), shard_type=1,
                                    bias=_t(E // EP, 1, F, dtype=FP32)))
        opcontracts.check(AG, **_ag(x=_t(E, C, H // TP, dtype=FP16),
                                    weight=_t(E // EP, H, F, dtype=FP16),
                                    bias=_t(E // EP, F, dtype=FP16)))
        opcontracts.check(RS, **_rs())
        # the backward's transposed weight, a non-contiguous view
        opcontracts.check(RS, **_rs(weight=_t(E // EP, H, F).transpose(-1, -2)))
        opcontracts.check(RS, **_rs(bias=_t(E // EP, 1, H // TP, dtype=FP32)))
        opcontracts.check(RS, **_rs(bias=_t(E // EP, H, dtype=FP32), shard_type=1))


@pytest.mark.parametrize(("op", "build", "name"), [
    (AG, _ag, "x"), (AG, _ag, "weight"), (RS, _rs, "x"), (RS, _rs, "weight")])
def test_wrong_dtype_names_the_argument(op: str, build: Any, name: str) -> None:
    call = build()
    call[name] = call[name].float()
    exc = _violation(op, **call)
    assert exc.arg == name and f"argument '{name}'" in str(exc)


@pytest.mark.parametrize(("op", "build"), [(AG, _ag), (RS, _rs)])
def test_bias_follows_x_dtype(op: str, build: Any) -> None:
    """fp16 x takes an fp16 bias, bf16 x an fp32 one: a bf16 bias is the mistake."""
    bias_n = F if op == AG else H // TP
    exc = _violation(op, **build(bias=_t(E // EP, 1, bias_n, dtype=BF16)))
    assert exc.arg == "bias"
    fp16 = build(x=build()["x"].half(), weight=build()["weight"].half(),
                 bias=_t(E // EP, 1, bias_n, dtype=FP32))
    assert _violation(op, **fp16).arg == "bias"


@pytest.mark.parametrize(("op", "build"), [(AG, _ag), (RS, _rs)])
def test_world_sizes_and_shard_type(op: str, build: Any) -> None:
    assert _violation(op, **build(group_ep_worldsize=3)).arg == "group_ep_worldsize"
    assert _violation(op, **build(group_tp_worldsize=64)).arg == "group_tp_worldsize"
    assert _violation(op, **build(shard_type=2)).arg == "shard_type"


def test_shape_relations_name_the_argument() -> None:
    # gathered on C: x carries the whole H of the weight
    exc = _violation(AG, **_ag(shard_type=1))
    assert exc.arg == "x" and "(when shard_type = 1)" in str(exc)
    # too many local experts for the kernel (E/ep <= 32)
    assert _violation(AG, **_ag(x=_t(66, C, H // TP), weight=_t(33, H, F))).arg == "weight"
    # the weight's batch is the local experts of x
    assert _violation(RS, **_rs(weight=_t(E // EP + 1, F, H))).arg == "weight"
    # x's M/tp against the weight's
    assert _violation(RS, **_rs(weight=_t(E // EP, F + 1, H))).arg == "weight"
    # scattered on C: the bias is the whole H
    exc = _violation(RS, **_rs(bias=_t(E // EP, 1, H // TP, dtype=FP32), shard_type=1))
    assert exc.arg == "bias"
