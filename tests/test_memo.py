"""The signature memo: calls whose tensor metadata already conformed skip the generated checker
(a C++ check from torch's dynamo guards), and nothing that must be caught slips through it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractViolation, ValueRule
from opcontracts._engine import memo

BF16, I32 = torch.bfloat16, torch.int32
UNPERMUTE = Contract("memo_unpermute", {
    "permuted_tokens": Arg("bf16", "N*K H"),
    "sorted_indices": Arg("int32", "N*K"),
    "probs": Arg("bf16", "N K", optional=True),
})


def noop(permuted_tokens, sorted_indices, probs=None, restore_shape=None):
    return "called"


def good(n: int = 4, k: int = 2, h: int = 8):
    return (torch.zeros(n * k, h, dtype=BF16), torch.arange(n * k, dtype=I32),
            torch.full((n, k), 0.5, dtype=BF16))


@pytest.fixture
def counted(monkeypatch):
    """Count the memo's hits: wrap every check it learns."""
    hits: list[int] = []
    real = memo.learn

    def learn(args, static, kwargs=None):
        check = real(args, static, kwargs)
        if check is None:
            return None

        def counting(*a, **k):
            ok = check(*a, **k)
            hits.append(ok)
            return ok
        return counting
    monkeypatch.setattr(memo, "learn", learn)
    return hits


def test_available_on_this_torch():
    assert memo.available()


def test_second_conforming_call_is_answered_by_the_memo(counted):
    f = opcontracts.enforce(UNPERMUTE)(noop)
    with opcontracts.mode("strict"):
        assert f(*good()) == "called"
        assert counted == [] and len(f.__opcontracts_memo__[3]) == 1
        assert f(*good()) == "called"
    assert counted == [True]


@pytest.mark.parametrize("bad", [
    lambda t, i, p: (t, i, p.float()),                          # the incident: fp32 probs
    lambda t, i, p: (t, i.long(), p),                           # int64 indices
    lambda t, i, p: (t, i, torch.zeros(3, 2, dtype=BF16)),      # N*K relation broken, ranks kept
    lambda t, i, p: (t[:6], i[:6], p),                          # same dtypes, 6 != 4*2
    lambda t, i, p: (t, i, p.reshape(8)),                       # rank
])
def test_violations_after_memoisation_are_still_caught(bad):
    f = opcontracts.enforce(UNPERMUTE)(noop)
    with opcontracts.mode("strict"):
        f(*good())
        f(*good())
        with pytest.raises(ContractViolation):
            f(*bad(*good()))


def test_other_sizes_that_conform_are_checked_then_learnt(counted):
    f = opcontracts.enforce(UNPERMUTE)(noop)
    with opcontracts.mode("strict"):
        f(*good(4, 2))
        f(*good(3, 2))
        f(*good(3, 2))
    assert len(f.__opcontracts_memo__[3]) == 2
    assert True in counted


def test_memo_is_bounded():
    f = opcontracts.enforce(UNPERMUTE)(noop)
    with opcontracts.mode("strict"):
        for _ in range(3):
            for n in range(1, memo.CAPACITY + 1):
                f(*good(n, 2))
        assert len(f.__opcontracts_memo__[3]) == memo.CAPACITY


def test_a_call_that_cannot_be_learnt_does_not_drop_a_full_memo():
    f = opcontracts.enforce(UNPERMUTE)(noop)
    for n in range(1, memo.CAPACITY + 1):
        f(*good(n, 2), None)
    for _ in range(3 * memo.CAPACITY):
        f(*good(1, 2), [2, 8])  # a list: not described by a learnt check
    assert len(f.__opcontracts_memo__[4]) == memo.CAPACITY


def test_ever_changing_shapes_drop_the_memo_for_good(counted):
    f = opcontracts.enforce(UNPERMUTE)(noop)
    with opcontracts.mode("strict"):
        for n in range(1, memo.CAPACITY + 2):
            f(*good(n, 2))
        assert f.__opcontracts_memo__[3] == ()
        del counted[:]
        f(*good(1, 2))
        f(*good(1, 2))
        assert counted == [] and f.__opcontracts_memo__[3] == ()
        with pytest.raises(ContractViolation):
            f(*good(1, 2)[:2], torch.zeros(1, 2))


def test_memo_holds_no_tensor():
    f = opcontracts.enforce(UNPERMUTE)(noop)
    args = good()
    refs = [weakref.ref(a) for a in args]
    f(*args)
    f(*args)
    assert f.__opcontracts_memo__[3]
    del args
    gc.collect()
    assert all(r() is None for r in refs)


def test_keywords_and_constants_are_part_of_the_learnt_call(counted):
    f = opcontracts.enforce(UNPERMUTE)(noop)
    t, i, p = good()
    with opcontracts.mode("strict"):
        for _ in range(2):
            f(t, i, None)
            f(t, i, probs=p)
            f(t, i, p, restore_shape=None)
            f(t, i, p, 7)
        assert counted == [True] * 4
        assert set(f.__opcontracts_memo__) == {3, (2, "probs"), (3, "restore_shape"), 4}
        with pytest.raises(ContractViolation):
            f(t, i, probs=p.float())
        with pytest.raises(ContractViolation):
            f(t, i.long(), None)
        with pytest.raises(ContractViolation):
            f(t, i, p.float(), restore_shape=None)
        del counted[:]
        # other constants than the learnt ones: not matched (the check learns them in turn)
        f(t, i, p, 8)
        f(t, i, p, 7.0)
        f(t, i, p, True)
        f(t, i, p, restore_shape=1)
    assert True not in counted


def test_nan_and_objects_are_not_learnt():
    f = opcontracts.enforce(UNPERMUTE)(noop)
    f(*good(), float("nan"))
    f(*good(), object())
    f(*good(), restore_shape=[1, 2])
    assert f.__opcontracts_memo__ == {}


def test_learnt_checks_are_readable_generated_code():
    import inspect

    f = opcontracts.enforce(UNPERMUTE)(noop)
    t, i, p = good()
    f(t, i, None, restore_shape=3)
    src = inspect.getsource(f.__opcontracts_memo__[(3, "restore_shape")][0])
    assert "_2 is None" in src and "restore_shape == _crestore_shape" in src
    assert "_same(_0, _1)" in src


def test_contiguity_rules_pin_strides():
    f = opcontracts.enforce(Contract("memo_contig", {"x": Arg("fp32", "M N", contiguous=True)}))(
        lambda x: x)
    x = torch.zeros(4, 4)
    with opcontracts.mode("strict"):
        f(x)
        f(x)
        with pytest.raises(ContractViolation, match="contiguous"):
            f(x.t())


def test_strides_do_not_matter_without_a_contiguity_rule(counted):
    f = opcontracts.enforce(Contract("memo_strided", {"x": Arg("fp32", "M M")}))(lambda x: x)
    x = torch.zeros(4, 4)
    f(x)
    f(x.t())
    assert counted == [True]


def test_value_checks_turned_on_later_are_not_bypassed():
    f = opcontracts.enforce(Contract("memo_values", {
        "idx": Arg("int32", "M", values=ValueRule(nonnegative=True))}))(lambda idx: idx)
    with opcontracts.mode("strict"):
        f(torch.arange(4, dtype=I32))
        f(torch.arange(4, dtype=I32))
        prev = opcontracts.set_value_checks(True)
        try:
            with pytest.raises(ContractViolation):
                f(torch.tensor([0, -1, 2, 3], dtype=I32))
        finally:
            opcontracts.set_value_checks(prev)


def test_autograd_state_and_parameters_are_separate_signatures():
    f = opcontracts.enforce(UNPERMUTE)(noop)
    t, i, p = good()
    with opcontracts.mode("strict"):
        f(t, i, p)
        f(t.requires_grad_(), i, p)
        f(t, i, torch.nn.Parameter(p))
        assert len(f.__opcontracts_memo__[3]) == 3
        with pytest.raises(ContractViolation):
            f(t, i, torch.nn.Parameter(p.float()))


def test_memo_off_by_environment(monkeypatch):
    monkeypatch.setattr(memo, "_state", [None])
    monkeypatch.setenv("OPCONTRACTS_MEMO", "0")
    assert not memo.available()
    f = opcontracts.enforce(UNPERMUTE)(noop)
    with opcontracts.mode("strict"):
        f(*good())
        f(*good())
        assert not f.__opcontracts_memo__.get(3)
        with pytest.raises(ContractViolation):
            f(*good()[:2], good()[2].float())


def test_a_torch_without_the_private_api_leaves_the_memo_off(monkeypatch):
    def broken(*a, **k):
        raise TypeError("TensorGuards() takes no arguments")
    monkeypatch.setattr(memo, "_state", [None])
    monkeypatch.setattr(memo, "_build", broken)
    assert not memo.available()
    f = opcontracts.enforce(UNPERMUTE)(noop)
    with opcontracts.mode("strict"):
        assert f(*good()) == "called"
        with pytest.raises(ContractViolation):
            f(*good()[:2], good()[2].float())
