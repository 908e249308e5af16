"""Guards under ``torch.compile`` with dynamic shapes (issue 22): ``mark_dynamic`` dims.

A contract's shape relations are comparisons of sizes; traced with symbolic sizes they become
dynamo guards between symbols (``rows == N*K``), so marking every dim of the same quantity
dynamic compiles once for all sizes.  A relation between a dim marked dynamic and static dims
pins it to a constant, as the op's own shape function does: dynamo then refuses the
``mark_dynamic`` (``ConstraintViolationError``); ``maybe_mark_dynamic`` lets it specialise.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

import opcontracts
from opcontracts import Arg, Contract, ContractViolation

C = Contract("cdyn", {"x": Arg("bf16", "N*K H"), "p": Arg("bf16", "N K"), "w": Arg("bf16", "H")},
             source="test")


@opcontracts.enforce(C)
def combine(x, p, w):
    return (x * w).float().sum() + p.float().sum()


def step(x, p, w):
    return combine(x, p, w) * 2


def args(n: int, k: int = 2, h: int = 8, rows: int | None = None, pdtype=torch.bfloat16):
    x = torch.randn(n * k if rows is None else rows, h).bfloat16()
    return x, torch.rand(n, k).to(pdtype), torch.randn(h).bfloat16()


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _marked(a, *dims):
    for t, d in dims:
        torch._dynamo.mark_dynamic(a[t], d)
    return a


@pytest.mark.parametrize("mode", ["strict", "warn", "fix"])
def test_the_same_quantity_marked_dynamic_everywhere_compiles_once(mode):
    cnt = CompileCounterWithBackend("aot_eager")
    g = torch.compile(step, backend=cnt, fullgraph=True)
    with opcontracts.mode(mode):
        for n in (4, 6, 11):
            a = _marked(args(n), (0, 0), (1, 0))  # x's rows and p's N: both the token count
            assert torch.allclose(g(*a), step(*a))
    assert cnt.frame_count == 1  # no recompile per token count: nothing was specialised


def test_a_violation_is_still_found_with_symbolic_sizes():
    g = torch.compile(step, backend="aot_eager")
    with opcontracts.mode("strict"):
        g(*_marked(args(4), (0, 0), (1, 0)))
        bad = _marked(args(6, rows=13), (0, 0), (1, 0))  # 13 rows, not 6*2
        with pytest.raises(ContractViolation) as e:
            g(*bad)
    assert "N*K" in str(e.value) and "13" in str(e.value)
    with opcontracts.mode("strict"), pytest.raises(ContractViolation, match="float32"):
        g(*_marked(args(6, pdtype=torch.float32), (0, 0), (1, 0)))


def test_a_relation_to_static_dims_pins_a_dim_marked_dynamic():
    g = torch.compile(step, backend="aot_eager", fullgraph=True)
    a = _marked(args(4), (0, 0))  # x's rows only; p (N, K) static: rows can only be 8
    with opcontracts.mode("strict"), pytest.raises(ConstraintViolationError):
        g(*a)
    torch._dynamo.reset()
    with opcontracts.mode("off"):  # no check traced: nothing pins it
        g(*_marked(args(4), (0, 0)))


def test_maybe_mark_dynamic_lets_the_relation_specialise():
    g = torch.compile(step, backend="aot_eager", fullgraph=True)
    a = args(4)
    torch._dynamo.maybe_mark_dynamic(a[0], 0)
    with opcontracts.mode("strict"):
        assert torch.allclose(g(*a), step(*a))
