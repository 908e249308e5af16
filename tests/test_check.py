"""Every rule kind of the generated checker, with a passing and a failing call."""

from __future__ import annotations

import linecache
import traceback

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractViolation, ValueRule
from opcontracts._engine import registry

bf16, f32, i32, i64 = torch.bfloat16, torch.float32, torch.int32, torch.int64


def t(*shape, dtype=bf16):
    return torch.zeros(*shape, dtype=dtype)


def guard(contract):
    @opcontracts.enforce(contract)
    def f(*args, **kwargs):
        return "called"

    return f


UNPERMUTE = Contract(
    "unpermute",
    {
        "permuted_tokens": Arg("bf16", "N*K H"),
        "sorted_indices": Arg("int32", "N*K"),
        "probs": Arg("bf16", "N K", optional=True),
    },
    source="MindSpeed docs/ops/npu_moe_token_unpermute.md",
)


@opcontracts.enforce(UNPERMUTE)
def unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    return "called"


def violation(fn, *a, **k) -> ContractViolation:
    with opcontracts.mode("strict"), pytest.raises(ContractViolation) as ei:
        fn(*a, **k)
    return ei.value


def test_conforming_call_passes_in_strict():
    with opcontracts.mode("strict"):
        assert unpermute(t(8, 16), t(8, dtype=i32), t(4, 2)) == "called"
        assert unpermute(t(8, 16), t(8, dtype=i32)) == "called"
        assert unpermute(permuted_tokens=t(8, 16), sorted_indices=t(8, dtype=i32), probs=None) == "called"


def test_dtype_violation_message_has_everything():
    e = violation(unpermute, t(8, 16), t(8, dtype=i32), t(4, 2, dtype=f32))
    assert (e.op, e.arg, e.rule) == ("unpermute", "probs", "dtype")
    assert e.expected == "bfloat16" and "float32" in e.actual
    assert e.fix == "probs = probs.to(torch.bfloat16)"
    assert e.source == "MindSpeed docs/ops/npu_moe_token_unpermute.md"
    assert e.call_site is not None and e.call_site.startswith(__file__)
    msg = str(e)
    for part in ("unpermute", "'probs'", "float32", "bfloat16", "probs.to(torch.bfloat16)",
                 "MindSpeed docs", "test_check.py"):
        assert part in msg


def test_n_times_k_relation():
    e = violation(unpermute, t(8, 16), t(8, dtype=i32), t(4, 3))
    assert e.rule == "shape" and e.bindings == {"N": 4, "K": 3, "H": 16}
    e = violation(unpermute, t(8, 16), t(6, dtype=i32))
    assert e.arg == "sorted_indices" and e.rule == "shape"


def test_rank():
    e = violation(unpermute, t(8, 16, 1), t(8, dtype=i32))
    assert e.rule == "rank" and "(8, 16, 1)" in e.actual


def test_none_only_for_optional():
    e = violation(unpermute, t(8, 16), None)
    assert e.rule == "missing" and e.arg == "sorted_indices"


def test_non_tensor():
    e = violation(unpermute, [1, 2], t(8, dtype=i32))
    assert e.rule == "type" and "list" in e.actual


def test_missing_required_arg_lets_original_raise():
    @opcontracts.enforce(UNPERMUTE)
    def real(permuted_tokens, sorted_indices, probs=None):
        return 1

    with opcontracts.mode("strict"), pytest.raises(TypeError, match="sorted_indices") as ei:
        real(t(8, 16))
    assert not isinstance(ei.value, ContractViolation)


def test_fixed_sizes_any_and_ellipsis():
    f = guard(Contract("f", {"x": Arg(shape="... S 4"), "y": Arg(shape="_ S")}))
    with opcontracts.mode("strict"):
        f(t(2, 3, 5, 4), t(9, 5))
        f(t(5, 4), t(1, 5))
    assert violation(f, t(5, 3), t(1, 5)).rule == "shape"
    assert violation(f, t(4), t(1, 4)).rule == "rank"
    assert violation(f, t(2, 5, 4), t(1, 6)).bindings == {"S": 5}


def test_even_dimension_binds_half():
    f = guard(Contract("swiglu", {"x": Arg(shape="... 2*D")}))
    with opcontracts.mode("strict"):
        f(t(3, 8))
    assert violation(f, t(3, 7)).rule == "shape"


def test_shape_alternatives_by_rank():
    f = guard(Contract("permute", {"tokens": Arg(shape="N H"),
                                   "indices": Arg(shape=["N K", "N"])}))
    with opcontracts.mode("strict"):
        f(t(4, 8), t(4, 2))
        f(t(4, 8), t(4))
    assert violation(f, t(4, 8), t(3)).rule == "shape"
    assert violation(f, t(4, 8), t(4, 2, 1)).rule == "rank"


def test_rank_field():
    f = guard(Contract("gate", {"x": Arg(rank=[2, 3])}))
    with opcontracts.mode("strict"):
        f(t(2, 3))
        f(t(2, 3, 4))
    assert violation(f, t(2)).rule == "rank"


def test_same_dtype_and_exception_table():
    f = guard(Contract("rm", {"tokens": Arg(["bf16", "fp16", "fp32"]),
                              "probs": Arg(same_dtype_as="tokens", optional=True,
                                           same_dtype_except={"bf16": ["fp32"]})}))
    with opcontracts.mode("strict"):
        f(t(2), t(2))
        f(t(2), t(2, dtype=f32))  # fp32 probs with bf16 tokens is allowed
        f(t(2, dtype=f32), t(2, dtype=f32))
    e = violation(f, t(2, dtype=torch.float16), t(2, dtype=f32))
    assert e.rule == "same_dtype" and e.fix == "probs = probs.to(tokens.dtype)"


def test_same_shape():
    f = guard(Contract("r", {"a": Arg(shape="N K"), "b": Arg(same_shape_as="a")}))
    with opcontracts.mode("strict"):
        f(t(2, 3), t(2, 3, dtype=i32))
    assert violation(f, t(2, 3), t(3, 2)).rule == "same_shape"


def test_device_agreement_uses_devices():
    f = guard(Contract("d", {"a": Arg(), "b": Arg()}, same_device=True))
    meta = torch.empty(2, device="meta")
    with opcontracts.mode("strict"):
        f(t(2), t(2))
        f(meta, torch.empty(3, device="meta"))
    # meta and cpu both report get_device() == -1: the rule compares torch.device objects
    assert meta.get_device() == t(2).get_device() == -1
    e = violation(f, t(2), meta)
    assert e.rule == "device" and e.arg == "b" and "meta" in e.actual


def test_same_device_is_opt_in():
    class Dev(torch.Tensor):
        def get_device(self):
            return 1

    f = guard(Contract("d", {"a": Arg(), "b": Arg()}))
    with opcontracts.mode("strict"):
        f(t(2), t(2).as_subclass(Dev))


def test_contiguous():
    f = guard(Contract("c", {"a": Arg(contiguous=True)}))
    with opcontracts.mode("strict"):
        f(t(2, 3))
    e = violation(f, t(2, 3).t())
    assert e.rule == "contiguous" and e.fix == "a = a.contiguous()"


def test_tensor_list():
    f = guard(Contract("gmm", {"x": Arg("bf16", "_ H", list=True, max_len=3),
                               "weight": Arg("bf16", "H _", list=True)}))
    with opcontracts.mode("strict"):
        f([t(2, 4), t(5, 4)], [t(4, 8), t(4, 8)])
    e = violation(f, [t(2, 4), t(5, 4, dtype=f32)], [t(4, 8)])
    assert e.arg == "x[1]" and e.rule == "dtype" and e.fix == "x[1] = x[1].to(torch.bfloat16)"
    assert violation(f, [t(2, 4)] * 4, [t(4, 8)]).rule == "list_len"
    assert violation(f, t(2, 4), [t(4, 8)]).rule == "type"
    assert violation(f, [t(2, 4)], [t(5, 8)]).rule == "shape"


def test_scalar_allowed_and_bounds():
    f = guard(Contract("s", {"x": Arg(shape="N E"), "k": Arg(ge=1, le="E"),
                             "padded_mode": Arg(allowed=[False])}))
    with opcontracts.mode("strict"):
        f(t(2, 8), 8, False)
    assert violation(f, t(2, 8), 9, False).rule == "bound"
    assert violation(f, t(2, 8), 0, False).rule == "bound"
    e = violation(f, t(2, 8), 2, True)
    assert e.rule == "allowed" and e.arg == "padded_mode"


def test_value_checks_run_only_when_enabled():
    f = guard(Contract("u", {"idx": Arg("int32", "M", values=ValueRule(permutation=True))}))
    dup = torch.tensor([0, 0, 2], dtype=i32)
    with opcontracts.mode("strict"):
        f(dup)  # values are not read by default
        prev = opcontracts.set_value_checks(True)
        try:
            f(torch.tensor([2, 0, 1], dtype=i32))
            e = violation(f, dup)
        finally:
            opcontracts.set_value_checks(prev)
    assert e.rule == "value" and "occurs more than once" in e.actual


@pytest.mark.parametrize("rule, good, bad, fragment", [
    (ValueRule(nonnegative=True, nondecreasing=True, last="M"), [1, 3, 5], [1, 3, 4], "ends with 4"),
    (ValueRule(nondecreasing=True), [1, 1, 2], [2, 1, 3], "decreases"),
    (ValueRule(nonnegative=True), [0, 1], [-1, 2], "negative"),
    (ValueRule(sum="M"), [2, 3], [2, 2], "sums to 4"),
    (ValueRule(lt="E"), [0, 3], [0, 4], ">= E"),
])
def test_value_rules(rule, good, bad, fragment):
    f = guard(Contract("g", {"x": Arg(shape="M _"), "w": Arg(shape="E _"),
                             "gl": Arg(shape="_", values=rule)}))
    opcontracts.set_value_checks(True)
    try:
        with opcontracts.mode("strict"):
            f(t(5, 2), t(4, 2), torch.tensor(good))
        e = violation(f, t(5, 2), t(4, 2), torch.tensor(bad))
    finally:
        opcontracts.set_value_checks(False)
    assert fragment in e.actual


def test_generated_source_is_in_linecache_and_tracebacks():
    cc = unpermute.__opcontracts__
    assert "def check_unpermute(" in cc.source_code
    assert linecache.getline(cc.filename, 1).startswith("def check_unpermute(")
    lines = traceback.format_list([(cc.filename, 1, "check_unpermute", None)])
    assert "def check_unpermute" in "".join(lines)


def test_no_inspect_bind_per_call(monkeypatch):
    import inspect

    def boom(*a, **k):
        raise AssertionError("Signature.bind called on the hot path")

    monkeypatch.setattr(inspect.Signature, "bind", boom)
    monkeypatch.setattr(inspect.Signature, "bind_partial", boom)
    with opcontracts.mode("strict"):
        assert unpermute(t(8, 16), t(8, dtype=i32), t(4, 2)) == "called"


def test_check_without_calling():
    opcontracts.register(UNPERMUTE, replace=True)
    try:
        opcontracts.check("unpermute", t(8, 16), t(8, dtype=i32), t(4, 2))
        with opcontracts.mode("off"), pytest.raises(ContractViolation):
            opcontracts.check("unpermute", t(8, 16), t(8, dtype=i32), t(4, 2, dtype=f32))
    finally:
        from opcontracts._engine import registry

        registry.unregister("unpermute")
    with pytest.raises(opcontracts.UnknownOpError):
        opcontracts.check("unpermute", t(8, 16))


def test_none_for_a_required_argument_without_rules_is_caught():
    f = guard(Contract("bare", {"a": Arg(), "b": Arg("bf16")}))
    assert violation(f, None, t(2)).rule == "missing"
    assert violation(f, t(2), None).rule == "missing"


def test_a_size_bound_by_an_optional_argument_is_compared_by_a_later_required_one():
    f = guard(Contract("o", {"probs": Arg(shape="N K", optional=True), "x": Arg(shape="N H")}))
    with opcontracts.mode("strict"):
        f(t(4, 2), t(4, 8))
        f(None, t(3, 8))  # N unbound by probs: x binds it
    e = violation(f, t(4, 2), t(3, 8))
    assert e.arg == "x" and e.rule == "shape" and e.bindings["N"] == 4


def test_dtype_if_present_allows_a_mode_chosen_by_an_optional_argument():
    c = Contract("q", {"x": Arg("bf16"), "w": Arg("bf16", dtype_if_present={"scale": ["int8"]}),
                       "scale": Arg(optional=True)})
    f = guard(c)
    with opcontracts.mode("strict"):
        f(t(2), t(2))
        f(t(2), t(2, dtype=torch.int8), t(2))  # quantized weight with its scale
    e = violation(f, t(2), t(2, dtype=torch.int8))  # without it: a violation
    assert e.arg == "w" and "int8 when scale is passed" in e.expected
    other = Contract("q", {"x": Arg("bf16"),
                           "w": Arg("bf16", dtype_if_present={"scale": ["int8", "uint8"]}),
                           "scale": Arg(optional=True)}, when={"cann": ">=99"})
    merged = registry.merge_contracts([c, other])
    assert merged.args["w"].dtype_if_present == {"scale": ("int8",)}
    with pytest.raises(opcontracts.ContractFileError, match="dtype_if_present"):
        Contract("q", {"w": Arg("bf16", dtype_if_present={"nope": ["int8"]})})


def test_cases_hold_when_arguments_have_given_values():
    """group_list cumulative (type 0) or counts (type 1), as grouped matmul reads it; a value
    left out counts as the target's default; rules say when they hold."""
    c = Contract("gl", {"x": Arg("bf16", "M K"), "group_list": Arg("int64", "G", optional=True),
                        "group_list_type": Arg(allowed=[0, 1])},
                 cases=[{"if": {"group_list_type": 0}, "source": "doc A",
                         "args": {"group_list": {"optional": True,
                                                 "values": {"nondecreasing": True, "last": "M"}}}},
                        {"if": {"group_list_type": 1},
                         "args": {"group_list": {"optional": True, "values": {"sum": "M"}}}},
                        {"if": {"group_list_type": [1]}, "args": {"x": {"shape": "_ 4"}}}])

    @opcontracts.enforce(c)
    def gmm(x, group_list=None, group_list_type=0):
        return x

    x = t(6, 4)
    prev = opcontracts.set_value_checks(True)
    try:
        with opcontracts.mode("strict"):
            gmm(x, torch.tensor([2, 6]))
            gmm(x, torch.tensor([2, 4]), 1)
            gmm(t(6, 5), torch.tensor([2, 6]))  # the K rule is type 1's only
        e = violation(gmm, x, torch.tensor([2, 4]))  # the default, 0: cumulative
        assert e.arg == "group_list" and "(when group_list_type = 0)" in e.expected
        assert e.source == "doc A"
        assert violation(gmm, x, torch.tensor([2, 6]), 1).arg == "group_list"
        assert violation(gmm, t(6, 5), torch.tensor([2, 4]), 1).arg == "x"
    finally:
        opcontracts.set_value_checks(prev)
    with pytest.raises(opcontracts.ContractFileError, match="cases.0.if.nope"):
        Contract("q", {"x": Arg("bf16")}, cases=[{"if": {"nope": 1}, "args": {"x": {}}}])
