"""Which argument a broken shape relation blames.

Arguments another op produced (``produced_by``: permute's ``sorted_indices``, the experts' output
on its rows) are the side of a relation the caller did not build: they bind the shape names
first, and a relation they fix blames the caller's tensor, with the shape they imply.  When the
contract cannot tell, the message names both tensors and the fix line does not send the user to
change one of them alone.  A fix line never tells the user to change the tensor that was right.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _strict import violation as _violation

import opcontracts
from opcontracts import Arg, Contract, ContractFileError, ContractViolation
from opcontracts._engine.compile import compile_contract
from opcontracts.spec import load_contracts

BF16, I32 = torch.bfloat16, torch.int32
# verl's Dockerfile.ascend_8.3.rc1_a3 stack, the one PR 4888 ran on
VERL = {"torch_npu": "2.7.1.post2", "cann": "8.3.RC1", "soc": "Ascend910_9392"}


@pytest.fixture()
def verl_stack() -> Iterator[None]:
    with opcontracts.versions(**VERL):
        yield


def _unpermute(rows: int, probs: tuple[int, ...] | None, h: int = 64, indices: int | None = None,
               ) -> ContractViolation:
    kw = {} if probs is None else {"probs": torch.rand(*probs).to(BF16)}
    return _violation("npu_moe_token_unpermute", torch.randn(rows, h).to(BF16),
                      torch.randperm(rows if indices is None else indices).to(I32), **kw)


# --------------------------------------------------------------------------- the real call
def test_verl_4888_dense_probs_blame_probs(verl_stack: None) -> None:
    """verl's NPUQwen3VLMoeTextExperts (Qwen3-VL-30B-A3B: top-k 8 of 128 experts, scaled to 4
    tokens) passed the dense (T, E) scatter of the routing weights as probs; permuted_tokens
    (the grouped matmuls' output on permute's rows) and sorted_indices (permute's row_ids_map)
    were right.  The message used to bind N and K from probs and tell the user to pass
    permuted_tokens with shape (512, 64)."""
    T, K, E, H = 4, 8, 128, 64
    e = _unpermute(T * K, (T, E), H)
    assert (e.arg, e.rule) == ("probs", "shape")
    assert "(4, 128)" in e.actual
    assert e.expected.startswith("shape (N K) = (4, 8): N*K = 32 comes from permuted_tokens "
                                 "(32, 64) and sorted_indices (32,)")
    assert "npu_moe_token_permute" in e.expected
    assert e.fix is not None and e.fix.startswith("pass probs with shape (4, 8)")
    assert "probs (4, 128) makes it 512" in e.fix
    assert "pass permuted_tokens" not in e.fix and "pass sorted_indices" not in e.fix
    assert e.bindings == {"H": H, "N": T, "K": K}
    assert str(e).splitlines()[0].startswith("npu_moe_token_unpermute: argument 'probs'")


def test_the_fixed_call_passes(verl_stack: None) -> None:
    """PR 4888's fix gathers routing_weights[batch_idx, router_indices]: (T, K)."""
    opcontracts.check("npu_moe_token_unpermute", torch.randn(32, 64).to(BF16),
                      torch.randperm(32).to(I32), probs=torch.rand(4, 8).to(BF16))


def test_implied_shape_keeps_the_rows_and_solves_k(verl_stack: None) -> None:
    e = _unpermute(128, (64, 8))
    assert e.arg == "probs" and "expected shape (N K) = (64, 2)" in str(e)
    assert e.fix is not None and e.fix.startswith("pass probs with shape (64, 2)")


def test_no_whole_size_solves_it(verl_stack: None) -> None:
    """N*K = 129 from permute's outputs: no (16, k) fits; the relation is stated instead."""
    e = _unpermute(129, (16, 8))
    assert e.arg == "probs"
    assert e.expected.startswith("shape (N K) with N*K = 129")
    assert e.fix is not None and "where N*K = 129" in e.fix and "probs (16, 8) makes it 128" in e.fix
    assert e.bindings == {"H": 64}  # the produced side's, not probs' own


def test_the_caller_tensor_is_blamed_in_every_mode(verl_stack: None) -> None:
    """warn records and fix mode (which cannot repair a shape) name probs too."""
    pt, si, probs = torch.randn(32, 64).to(BF16), torch.randperm(32).to(I32), torch.rand(4, 128).to(BF16)
    @opcontracts.enforce("npu_moe_token_unpermute")
    def unpermute(permuted_tokens: Any, sorted_indices: Any, probs: Any = None) -> int:
        return 0

    with opcontracts.mode("warn"), pytest.warns(opcontracts.ContractWarning, match="'probs'"):
        unpermute(pt, si, probs=probs)
    assert [r.arg for r in opcontracts.report().records] == ["probs"]
    with opcontracts.mode("fix"), pytest.raises(ContractViolation) as info:
        unpermute(pt, si, probs=probs)
    assert info.value.arg == "probs"


# --------------------------------------------------------------------------- who is trusted
def test_produced_tensors_that_disagree_are_both_named(verl_stack: None) -> None:
    """permuted_tokens and sorted_indices both come from permute: the contract cannot tell
    which one is wrong, and the fix does not tell the user to change one of them alone."""
    e = _unpermute(128, (16, 8), indices=96)
    assert e.arg == "sorted_indices"  # where the check failed: the record's key
    msg = str(e)
    assert "to agree with permuted_tokens (128, 64) on N*K" in msg.splitlines()[0]
    assert e.fix is not None
    assert "sorted_indices (96,) gives N*K = 96, permuted_tokens (128, 64) gives 128" in e.fix
    assert "one call" in e.fix
    assert not e.fix.startswith("pass ")


def test_neither_side_produced_names_both() -> None:
    """A user's contract without produced_by: x and w disagree on H.  The old fix line said
    "pass w with shape (64, O)"; it cannot know w is the wrong one."""
    c = Contract("t_mm", {"x": Arg("fp32", "N H"), "w": Arg("fp32", "H O")})
    e = _violation(c, torch.zeros(4, 64), torch.zeros(32, 8))
    assert (e.arg, e.rule) == ("w", "shape")
    assert e.expected == "shape (H O) = (64, 8) to agree with x (4, 64) on H"
    assert e.fix == ("w (32, 8) gives H = 32, x (4, 64) gives 64; the contract cannot tell which "
                     "side is wrong: correct that one so they agree")


def test_a_caller_tensor_against_a_produced_one_stays_blamed() -> None:
    """finalize routing's skip1 is the caller's: H comes from the experts' output on init
    routing's rows, which the message says."""
    with opcontracts.versions(torch_npu="2.10.0", cann="9.0.0", soc="Ascend910_9392"):
        e = _violation("npu_moe_finalize_routing", torch.randn(8, 64).to(BF16), skip1=torch.randn(4, 65).to(BF16),
                       skip2=None, bias=None, scales=torch.rand(4, 2).to(BF16),
                       expanded_src_to_dst_row=torch.randperm(8).to(I32),
                       export_for_source_row=None, drop_pad_mode=0)
    assert e.arg == "skip1"
    assert "H = 64 comes from expanded_permuted_rows (8, 64)" in e.expected
    assert e.fix is not None and e.fix.startswith("pass skip1 with shape (4, 64)")


@pytest.mark.parametrize("wrong", ["scales", "export_for_source_row"])
def test_produced_relations_decide_between_two_caller_tensors(wrong: str) -> None:
    """scales and export_for_source_row (the router's top-k weights and ids) disagree on K; the
    N*K init routing's outputs fix says which one is wrong, whichever the checker met first."""
    T, K, E = 4, 2, 8
    sizes = {"scales": (T, K), "export_for_source_row": (T, K)}
    sizes[wrong] = (T, E)
    with opcontracts.versions(torch_npu="2.10.0", cann="9.0.0", soc="Ascend910_9392"):
        e = _violation("npu_moe_finalize_routing", torch.randn(T * K, 64).to(BF16),
                       skip1=None, skip2=None, bias=None,
                       scales=torch.rand(*sizes["scales"]).to(BF16),
                       expanded_src_to_dst_row=torch.randperm(T * K).to(I32),
                       export_for_source_row=torch.zeros(*sizes["export_for_source_row"]).to(I32),
                       drop_pad_mode=0)
    right = "scales" if wrong != "scales" else "export_for_source_row"
    assert e.arg == wrong
    assert e.expected.startswith("shape (N K) = (4, 2): N*K = 8 comes from expanded_permuted_rows")
    assert f"and {right} (4, 2) agrees" in e.expected
    assert e.fix is not None and e.fix.startswith(f"pass {wrong} with shape (4, 2)")


def test_tensor_list_elements_are_named() -> None:
    """grouped matmul's weight list against group_list (sglang 27748's global counts against
    local experts): neither is produced_by, both are named, the element by its index."""
    with opcontracts.versions(torch_npu="2.10.0", cann="9.0.0", soc="Ascend910_9392"):
        e = _violation("npu_grouped_matmul", [torch.randn(8, 64).to(BF16)],
                       [torch.randn(2, 64, 32).to(BF16)], bias=None, split_item=2, group_type=0,
                       group_list_type=1, group_list=torch.tensor([1, 1, 0, 2, 1, 1, 1, 1]))
    assert e.arg == "group_list"
    assert "to agree with weight[0] (2, 64, 32) on E" in e.expected
    assert e.fix is not None and "weight[0] (2, 64, 32) gives 2" in e.fix
    assert not e.fix.startswith("pass ")


def test_a_user_contract_says_produced_by() -> None:
    """The field on a user's contract: the produced argument wins wherever it is declared."""
    c = Contract("t_combine", {
        "weights": Arg("fp32", "T K"),
        "rows": Arg("fp32", "T*K H", produced_by="my_dispatch"),
    })
    e = _violation(c, torch.zeros(4, 16), torch.zeros(8, 3))
    assert e.arg == "weights" and "(4, 2)" in e.expected and "outputs of my_dispatch" in e.expected
    assert e.fix is not None and e.fix.startswith("pass weights with shape (4, 2)")


def test_an_optional_argument_checked_at_the_end_shows_its_tensor() -> None:
    """The end-of-call check of an optional argument's relation showed "is None" for its value."""
    c = Contract("t_opt", {"a": Arg("fp32", "N*K", optional=True), "b": Arg("fp32", "N K")})
    e = _violation(c, torch.zeros(7), torch.zeros(2, 3))
    assert "is None" not in str(e) and "(7,)" in e.actual


# --------------------------------------------------------------------------- the field
def test_produced_by_in_a_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[[contract]]\nop = "t"\nsignature = ["a", "b"]\n'
                 '[contract.args.a]\nshape = "N"\nproduced_by = "op_a"\n'
                 '[contract.args.b]\nshape = "N"\nproduced_by = ["op_a", "op_b"]\n',
                 encoding="utf-8")
    (c,) = load_contracts(f)
    assert c.args["a"].produced_by == ("op_a",) and c.args["b"].produced_by == ("op_a", "op_b")
    f.write_text('[[contract]]\nop = "t"\n[contract.args.a]\nproduced_by = 3\n', encoding="utf-8")
    with pytest.raises(ContractFileError) as info:
        load_contracts(f)
    assert "c.toml" in str(info.value) and "args.a.produced_by" in str(info.value)
    with pytest.raises(ContractFileError, match="produced_by"):
        Arg(produced_by=[""])


def test_shipped_producers_are_ops_with_contracts() -> None:
    """Every op a shipped produced_by names is one the shipped contracts know (a typo would
    only print a wrong name in a message)."""
    from opcontracts._engine.registry import shipped_contracts_dir

    contracts = load_contracts(shipped_contracts_dir())
    ops = {c.op for c in contracts}
    named = {(c.op, n, p) for c in contracts for n, a in c.args.items() for p in a.produced_by or ()}
    assert named, "no shipped contract says produced_by"
    assert {p for _, _, p in named} <= ops, sorted(p for _, _, p in named if p not in ops)
    marked = {(op, n) for op, n, _ in named}
    for op in ("npu_moe_token_unpermute", "mindspeed.npu_moe_token_unpermute",
               "npu_moe_token_unpermute_with_routing_map", "npu_moe_token_unpermute_grad"):
        assert {(op, "permuted_tokens"), (op, "sorted_indices")} <= marked, op
    assert ("npu_moe_finalize_routing", "expanded_src_to_dst_row") in marked
    assert not any(n in ("probs", "scales", "group_list") for _, n in marked)


def test_list_shows_who_produces_an_argument(capsys: pytest.CaptureFixture[str]) -> None:
    from opcontracts.cli import main

    main(["list", "mindspeed.npu_moe_token_unpermute"])
    out = capsys.readouterr().out
    assert "sorted_indices   int32, (N*K), values: a permutation of [0, numel), produced by " \
        "mindspeed.npu_moe_token_permute" in out
    assert "probs            bf16, (N K), optional\n" in out


# --------------------------------------------------------------------------- the hot path
def test_order_is_decided_when_compiling() -> None:
    """The produced argument is checked first in the generated code, and the optimistic checker
    (every conforming call) has the same lines as without the field: nothing per call."""
    args = {"weights": Arg("fp32", "T K"), "rows": Arg("fp32", "T*K H")}
    plain = compile_contract(Contract("t_order", args))
    marked = compile_contract(Contract("t_order", {
        **args, "rows": Arg("fp32", "T*K H", produced_by="my_dispatch")}))
    assert plain.fast_source.index("weights.dtype") < plain.fast_source.index("rows.dtype")
    assert marked.fast_source.index("rows.dtype") < marked.fast_source.index("weights.dtype")
    # the same tests, and the relation checked at the end without sentinel tests
    assert marked.fast_source.count("if ") == plain.fast_source.count("if ")
    assert "is not _oc_U" not in marked.fast_source and "_oc_V" not in marked.fast_source


def test_a_produced_argument_checked_against_a_caller_one_keeps_its_place() -> None:
    """same_dtype_as a caller's argument: the caller's own dtype rule speaks first."""
    c = Contract("t_grad", {
        "grad": Arg(["bf16", "fp32"], "N H"),
        "saved": Arg(["bf16", "fp32"], "N H", same_dtype_as="grad", produced_by="fwd"),
    })
    e = _violation(c, torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=BF16))
    assert (e.arg, e.rule) == ("grad", "dtype")
