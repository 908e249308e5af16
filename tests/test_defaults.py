"""Arguments left at their defaults are checked like explicit ones: the checker knows the
signature's (or the dispatcher schema's) default when it is compiled, so a default that breaks
a rule fails the call that leaves it out, and a default that conforms costs nothing."""

from __future__ import annotations

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractViolation


def _op(x: torch.Tensor, mode: int = 0, k: int = 4, flag: bool = False) -> torch.Tensor:
    return x


CONTRACT = Contract("defaults_op", {"x": Arg("fp32", "N K"), "mode": Arg(allowed=[1, 2]),
                                    "k": Arg(le="K"), "flag": Arg(allowed=[True])})


def test_a_left_out_argument_is_checked_with_its_default() -> None:
    guarded = opcontracts.enforce(CONTRACT)(_op)
    x = torch.zeros(2, 8)
    with opcontracts.mode("strict"):
        with pytest.raises(ContractViolation) as err:
            guarded(x, 1)  # flag left out: False is not allowed
        assert (err.value.arg, err.value.rule) == ("flag", "allowed")
        assert "is False (left out: its default)" in str(err.value)
        with pytest.raises(ContractViolation) as err:
            guarded(x, flag=True)  # mode left out: 0 is not one of 1, 2
        assert err.value.arg == "mode" and "is 0 (left out: its default)" in str(err.value)
        assert guarded(x, 2, flag=True) is x
        # a bound against a size: k = 4 by default, K = 2 here
        with pytest.raises(ContractViolation) as err:
            guarded(torch.zeros(2, 2), 1, flag=True)
        assert err.value.arg == "k" and "left out: its default" in str(err.value)
        assert guarded(torch.zeros(2, 2), 1, k=2, flag=True) is not None


def test_a_conforming_default_adds_no_check() -> None:
    from opcontracts._engine.compile import compile_contract
    from opcontracts._engine.enforce import params_of

    ok = Contract("defaults_ok", {"x": Arg("fp32"), "mode": Arg(allowed=[0, 1])})

    def f(x: torch.Tensor, mode: int = 0) -> torch.Tensor:
        return x

    cc = compile_contract(ok, params_of(f, ok))
    assert "mode is _oc_M" not in cc.fast_source and "mode is _oc_M" not in cc.source_code


def test_schema_defaults_of_a_torch_op(npu) -> None:  # type: ignore[no-untyped-def]
    """A dispatcher op's schema defaults count too: npu_moe_init_routing_v2 leaves
    expert_tokens_num_type at 0 (vllm-ascend's all-to-all path), checked as if passed."""
    from opcontracts._engine.compile import compile_contract
    from opcontracts._engine.enforce import check_call, params_of

    op = getattr(npu.npu_moe_init_routing_v2, "__wrapped__", npu.npu_moe_init_routing_v2)  # the packet
    c = Contract("routing_defaults", {"x": Arg("bf16", "N H"),
                                      "expert_tokens_num_type": Arg(allowed=[1, 2])})
    cc = compile_contract(c, params_of(op, c))
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ContractViolation) as left_out:
        check_call(cc, (x, None), {})
    with pytest.raises(ContractViolation) as explicit:
        check_call(cc, (x, None), {"expert_tokens_num_type": 0})
    assert left_out.value.arg == explicit.value.arg == "expert_tokens_num_type"
    assert "is 0 (left out: its default)" in str(left_out.value)
    check_call(cc, (x, None), {"expert_tokens_num_type": 1})
