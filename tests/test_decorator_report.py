"""The decorator's entry points and the report."""

from __future__ import annotations

import inspect
import json
import pickle
import warnings
from typing import Annotated

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractViolation, _report


@opcontracts.enforce
def rms_norm(x: Annotated[torch.Tensor, Arg(["bf16", "fp16"], "... H")],
             gamma: Annotated[torch.Tensor, Arg(same_dtype_as="x", shape="H")],
             eps: float = 1e-6) -> torch.Tensor:
    """Root-mean-square norm."""
    return x * gamma


def test_annotated_contract_and_metadata():
    assert rms_norm.__name__ == "rms_norm" and rms_norm.__doc__ == "Root-mean-square norm."
    assert list(inspect.signature(rms_norm).parameters) == ["x", "gamma", "eps"]
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    with opcontracts.mode("strict"):
        rms_norm(x, torch.ones(8, dtype=torch.bfloat16))
        with pytest.raises(ContractViolation, match="gamma"):
            rms_norm(x, torch.ones(8))
        with pytest.raises(ContractViolation) as ei:
            rms_norm(x, torch.ones(7, dtype=torch.bfloat16))
    assert ei.value.bindings == {"H": 8}
    assert ei.value.op.endswith("rms_norm")


def test_registered_op_by_name_and_annotations_refine():
    opcontracts.register(Contract("my.op", {"a": Arg("fp32")}), replace=True)

    @opcontracts.enforce("my.op")
    def f(a, b: Annotated[torch.Tensor, Arg("int64")]):
        return 1

    with opcontracts.mode("strict"):
        f(torch.ones(1), torch.ones(1, dtype=torch.int64))
        with pytest.raises(ContractViolation, match="'b'"):
            f(torch.ones(1), torch.ones(1))
    with pytest.raises(opcontracts.UnknownOpError):
        opcontracts.enforce("nobody.registered.this")


def test_decorator_without_anything_is_an_error():
    with pytest.raises(opcontracts.ContractFileError, match="Annotated"):
        opcontracts.enforce(lambda x: x)


def test_keyword_only_and_defaults_bind_like_python():
    c = Contract("k", {"x": Arg("bf16"), "probs": Arg("bf16", optional=True)})

    @opcontracts.enforce(c)
    def f(x, *, probs=None, scale=1.0):
        return scale

    with opcontracts.mode("strict"):
        assert f(torch.ones(1, dtype=torch.bfloat16), scale=2.0) == 2.0
        with pytest.raises(ContractViolation, match="probs"):
            f(torch.ones(1, dtype=torch.bfloat16), probs=torch.ones(1))
        with pytest.raises(TypeError, match="positional"):
            f(torch.ones(1, dtype=torch.bfloat16), torch.ones(1))


def test_violation_pickles():
    with opcontracts.mode("strict"), pytest.raises(ContractViolation) as ei:
        rms_norm(torch.ones(2, 8), torch.ones(8))
    e2 = pickle.loads(pickle.dumps(ei.value))
    assert (e2.op, e2.arg, e2.rule, str(e2)) == (ei.value.op, ei.value.arg, ei.value.rule, str(ei.value))


def test_report_table_json_and_reset():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            rms_norm(torch.ones(2, 8), torch.ones(8))
    rep = opcontracts.report()
    assert len(rep) == 1 and rep.records[0].count == 5
    assert "rms_norm" in rep.table() and "test_decorator_report.py" in rep.table()
    data = json.loads(rep.to_json())
    assert data["total"] == 5 and data["records"][0]["arg"] == "x"
    assert opcontracts.Report.from_dict(data).records[0].count == 5
    opcontracts.reset_report()
    assert len(opcontracts.report()) == 0
    assert "no contract violations" in opcontracts.report().table()


def test_report_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(_report, "MAX_RECORDS", 10)
    for i in range(50):
        _report.record("op", "a", "dtype", f"site{i}", "warn", "m")
    rep = opcontracts.report()
    assert len(rep.records) == 10 and rep.dropped == 40 and rep.total == 50
    assert "not kept" in rep.table()


def test_merge_reports_lists_ranks():
    a = _report.Report([_report.Record("op", "p", "dtype", "s", "warn", 2, "m", 0, [0])], 0, 2)
    b = _report.Report([_report.Record("op", "p", "dtype", "s", "warn", 3, "m", 0, [1])], 0, 3)
    m = _report.merge_reports([a, b])
    assert m.records[0].count == 5 and m.records[0].ranks == [0, 1] and m.total == 5
