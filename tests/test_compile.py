"""torch.compile: no graph breaks on conforming calls, and every mode behaves as in eager."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractViolation, ContractWarning

C = Contract("cscale", {"x": Arg("bf16", "N H"), "w": Arg("bf16", "H")}, source="test")


@opcontracts.enforce(C)
def scale(x, w):
    return x * w


def step(x, w):
    return scale(x, w).float().sum()


def helper(x, w):  # a violation nested one level down (the reorderable-logging trap)
    return scale(x, w)


def nested(x, w):
    return helper(x, w).float().sum()


X = torch.randn(4, 8).bfloat16()
W = torch.randn(8).bfloat16()


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["strict", "warn", "fix", "off"])
def test_zero_graph_breaks_on_conforming_calls(mode):
    with opcontracts.mode(mode):
        e = torch._dynamo.explain(step)(X, W)
    assert e.graph_break_count == 0 and e.graph_count == 1


def test_compiled_code_runs_no_check():
    g = torch.compile(step, backend="eager", fullgraph=True)
    with opcontracts.mode("strict"):
        g(X, W)  # compile
        seen: list[str] = []

        def prof(frame, event, arg):
            if event == "call" and "opcontracts" in frame.f_code.co_filename:
                seen.append(frame.f_code.co_name)

        sys.setprofile(prof)
        try:
            for _ in range(3):
                g(X, W)
        finally:
            sys.setprofile(None)
    assert seen == []


def test_strict_raises_the_same_violation_as_eager():
    with opcontracts.mode("strict"):
        with pytest.raises(ContractViolation) as eager:
            step(X, W.float())
        with pytest.raises(ContractViolation) as compiled:
            torch.compile(step, backend="eager")(X, W.float())
    assert (compiled.value.op, compiled.value.arg, compiled.value.rule) == ("cscale", "w", "dtype")
    assert compiled.value.fix == eager.value.fix == "w = w.to(torch.bfloat16)"


def test_strict_fullgraph_wraps_with_the_violation_as_cause():
    with opcontracts.mode("strict"), pytest.raises(Exception) as ei:
        torch.compile(step, backend="eager", fullgraph=True)(X, W.float())
    assert isinstance(ei.value.__cause__, ContractViolation)
    assert ei.value.__cause__.arg == "w"


@pytest.mark.parametrize("fn", [step, nested])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_warn_is_not_dropped(fn, fullgraph):
    g = torch.compile(fn, backend="eager", fullgraph=fullgraph)
    with opcontracts.mode("warn"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = g(X, W.float())
        g(X, W.float())
    assert torch.isfinite(out)
    msgs = [x for x in w if issubclass(x.category, ContractWarning)]
    assert msgs and "'w'" in str(msgs[0].message)
    assert any(r.op == "cscale" for r in opcontracts.report().records)


def test_fix_cast_is_traced_and_gradients_flow():
    wf = torch.randn(8, requires_grad=True)
    g = torch.compile(step, backend="aot_eager", fullgraph=True)
    with opcontracts.mode("fix"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = torch._dynamo.explain(step)(X, wf)
        out = g(X, wf)
    assert e.graph_break_count == 0
    out.backward()
    ref_w = wf.detach().clone().requires_grad_()
    (X * ref_w.to(torch.bfloat16)).float().sum().backward()
    assert wf.grad is not None and wf.grad.dtype is torch.float32
    torch.testing.assert_close(wf.grad, ref_w.grad)


def test_mode_change_recompiles():
    g = torch.compile(step, backend="eager")
    with opcontracts.mode("off"):
        g(X, W.float())  # off: no check, compiled without one
    with opcontracts.mode("strict"), pytest.raises(ContractViolation):
        g(X, W.float())


@pytest.fixture
def patched_emulation():
    import opcontracts.patch as patch
    from opcontracts import emulation

    was = emulation.installed()
    if not was:
        emulation.install("wide")
    patch.apply()
    yield
    patch.unpatch()
    if not was:
        emulation.uninstall()
    patch.apply()  # back to the state `import opcontracts.patch` left


def test_patched_op_first_called_under_compile(patched_emulation):
    import torch_npu

    tokens = torch.randn(8, 16).bfloat16()
    idx = torch.randperm(8).to(torch.int32)
    probs = torch.rand(4, 2).bfloat16()

    def f(p):
        return torch_npu.npu_moe_token_unpermute(tokens, idx, p).float().sum()

    assert getattr(torch_npu.npu_moe_token_unpermute, "__opcontracts__", None) is None  # lazy
    # the bf16-only kernel (issue 23: CANN decides)
    with opcontracts.versions(cann="8.0.RC3"), opcontracts.mode("strict"):
        e = torch._dynamo.explain(f)(probs)
        assert e.graph_break_count == 0
        torch._dynamo.reset()
        with pytest.raises(ContractViolation) as ei:
            torch.compile(f, backend="eager")(probs.float())
    assert ei.value.arg == "probs" and ei.value.fix == "probs = probs.to(torch.bfloat16)"


NARROW = Contract("cnarrow", {"idx": Arg("int32", "M", fix="cast")}, source="test")


@opcontracts.enforce(NARROW)
def shift(idx):
    return idx + 1


def gather_step(idx):
    return shift(idx) * 2


@pytest.mark.parametrize("fullgraph", [False, True])
def test_strict_on_a_narrowable_integer_argument_raises_the_violation(fullgraph):
    # the hint ("idx.to(torch.int32)") once read the values of the meta tensor seen while tracing
    g = torch.compile(gather_step, backend="eager", fullgraph=fullgraph)
    with opcontracts.mode("strict"), pytest.raises(Exception) as ei:
        g(torch.arange(4))
    exc = ei.value if isinstance(ei.value, ContractViolation) else ei.value.__cause__
    assert isinstance(exc, ContractViolation) and exc.fix == "idx = idx.to(torch.int32)"


def test_fix_narrowing_integers_under_compile_reads_the_values_eagerly():
    g = torch.compile(gather_step, backend="eager")
    with opcontracts.mode("fix"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = g(torch.arange(4))
        with pytest.raises(ContractViolation, match="idx"):
            g(torch.tensor([0, 2**40, 1, 2]))  # does not fit in int32: nothing can repair it
    assert out.dtype is torch.int32 and out.tolist() == [2, 4, 6, 8]
    assert any(issubclass(x.category, opcontracts.ContractFixWarning) for x in w)
    recs = [r for r in opcontracts.report().records if r.op == "cnarrow"]
    assert sum(r.fixed for r in recs) >= 1
