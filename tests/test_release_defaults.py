"""A call is judged as its kernel sees it: arguments left out at the release's schema default,
and value rules scoped by the release whose glue decides them."""

from __future__ import annotations

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractViolation
from opcontracts._engine.registry import merge_contracts
from opcontracts.wheel.release_params import params_for


def _init_routing_args() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 64, dtype=torch.float16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]], dtype=torch.int32)
    return x, ids


def test_params_come_from_the_release_schema_with_defaults() -> None:
    params = params_for(("torch.ops.npu.npu_moe_init_routing_v2",), "2.10.0.post4")
    assert params is not None
    flag = next(p for p in params if p.name == "expert_tokens_num_flag")
    assert flag.has_default and flag.default is False and flag.kind == "KEYWORD_ONLY"
    assert params_for(("torch.ops.npu.npu_moe_init_routing_v2",), None) is None
    assert params_for(("torch.ops.npu.npu_moe_init_routing_v2",), "0.0.1") is None
    assert params_for(("mindspeed.ops.gmm.npu_gmm",), "2.10.0.post4") is None


def test_a_left_out_flag_is_judged_at_its_default_and_the_310p_call_passes() -> None:
    # vllm-ascend's 310P AllGather dispatch leaves expert_tokens_num_flag at its default False;
    # op-plugin's docs allow False (no count output), so it must not be a false alarm
    x, ids = _init_routing_args()
    with opcontracts.versions(torch_npu="2.10.0.post4", cann="9.1.0", soc="Ascend310P3"):
        opcontracts.check("npu_moe_init_routing_v2", x, ids, active_num=8, expert_num=4,
                          drop_pad_mode=0, active_expert_range=[0, 4], quant_mode=-1,
                          row_idx_type=0)
        # the default is read: a rule on a left-out argument still bites (drop_pad_mode 1)
        with pytest.raises(ContractViolation, match="drop_pad_mode"):
            opcontracts.check("npu_moe_init_routing_v2", x, ids, active_num=8, expert_num=4,
                              drop_pad_mode=1)


def _ksplit() -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, object]]:
    x = [torch.randn(64, 20, dtype=torch.bfloat16)]
    w = [torch.randn(20, 32, dtype=torch.bfloat16)]
    return x, w, {"bias": None, "group_list": torch.tensor([5, 6, 4, 5]), "split_item": 3,
                  "group_type": 2, "group_list_type": 1}


@pytest.mark.parametrize("release", ["2.5.1", "2.7.1", "2.8.0.post2", "2.9.0"])
def test_the_k_split_is_rejected_where_the_release_glue_rejects_it(release: str) -> None:
    x, w, kw = _ksplit()
    with opcontracts.versions(torch_npu=release, cann="8.2.RC1", soc="Ascend910B3"):
        with pytest.raises(ContractViolation, match="group_type") as exc:
            opcontracts.check("npu_grouped_matmul", x, w, **kw)
    assert "only support -1 and 0" in str(exc.value)


@pytest.mark.parametrize("release", ["2.7.1.post4", "2.8.0.post4", "2.9.0.post2", "2.14.0"])
def test_the_k_split_passes_from_the_releases_that_have_it(release: str) -> None:
    x, w, kw = _ksplit()
    with opcontracts.versions(torch_npu=release, cann="8.3.RC1", soc="Ascend910B3"):
        opcontracts.check("npu_grouped_matmul", x, w, **kw)


def test_merged_contracts_allow_only_the_values_both_allow() -> None:
    a = Contract("op", {"mode": Arg(allowed=[-1, 0, 2], optional=True)})
    b = Contract("op", {"mode": Arg(allowed=[0, -1], optional=True)})
    assert merge_contracts([a, b]).args["mode"].allowed == (-1, 0)
    assert merge_contracts([b, a]).args["mode"].allowed == (0, -1)
    c = Contract("op", {"mode": Arg(allowed=[5], optional=True)})
    assert merge_contracts([a, c]).args["mode"].allowed == (5,)  # disjoint: the narrower one


@pytest.mark.parametrize("release", ["2.5.1", "2.10.0.post4"])
def test_a_call_with_out_tensors_binds_to_the_release_schema(release: str) -> None:
    """torch_npu's Python binding takes the out overload's tensors as ``out=(var, m, v)``
    (DeepSpeed's NPU fused Adam): ``check`` binds that call instead of failing with a
    TypeError, and the out overload's own names bind too."""
    names = [p.name for p in params_for(("torch.ops.npu.npu_apply_adam",), release) or []]
    assert names[-4:] == ["var", "m", "v", "out"]
    grad, state = torch.randn(8), [torch.randn(8), torch.zeros(8), torch.zeros(8)]
    with opcontracts.versions(torch_npu=release, soc="Ascend910B3"):
        opcontracts.check("npu_apply_adam", 0.9, 0.999, 1e-3, 0.9, 0.999, 1e-8, grad,
                          False, False, out=tuple(state))
        opcontracts.check("npu_apply_adam", 0.9, 0.999, 1e-3, 0.9, 0.999, 1e-8, grad,
                          False, False, var=state[0], m=state[1], v=state[2])


def test_an_op_whose_only_schema_is_its_out_overload_takes_one_out_tuple() -> None:
    """npu_hans_encode has no functional overload, only ``.out`` with four keyword-only out
    tensors: MindSpeed's activation compression calls it as ``npu_hans_encode(x, statistic,
    reshuff, out=(pdf, mantissa, fixed, var))``.  ``check`` binds that call (it raised a
    TypeError) and still judges it; the out tensors by name bind too."""
    names = [p.name for p in params_for(("torch.ops.npu.npu_hans_encode",), "2.7.1.post4") or []]
    assert names == ["input", "statistic", "reshuff", "pdf", "mantissa", "fixed", "var", "out"]
    x = torch.randn(64, 2, 256, dtype=torch.bfloat16)
    outs = (torch.zeros(256, dtype=torch.int32), torch.zeros(16384, dtype=torch.bfloat16),
            torch.zeros(4096, dtype=torch.bfloat16), torch.zeros(32768, dtype=torch.bfloat16))
    with opcontracts.versions(torch_npu="2.7.1.post4", soc="Ascend910B3"):
        opcontracts.check("npu_hans_encode", x, True, False, out=outs)
        opcontracts.check("npu_hans_encode", x, True, False, pdf=outs[0], mantissa=outs[1],
                          fixed=outs[2], var=outs[3])
        with pytest.raises(ContractViolation, match="input"):
            opcontracts.check("npu_hans_encode", x.to(torch.int32), True, False, out=outs)
