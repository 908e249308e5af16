"""The decorator's entry points and the report."""

from __future__ import annotations

import inspect
import json
import pickle
import warnings
from pathlib import Path
from typing import Annotated

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractViolation
from opcontracts._engine import records as _report


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


# --------------------------------------------------------------------------- JSON for tools
META_KEYS = {"opcontracts", "torch", "torch_npu", "cann", "mindspeed", "soc", "emulated", "mode",
             "mode_by_op", "argv", "host", "pid", "rank", "time"}


def test_json_reports_carry_metadata(tmp_path, monkeypatch):
    import sys
    from datetime import datetime

    monkeypatch.setenv("OPCONTRACTS_CANN_VERSION", "8.0.RC3")
    opcontracts.set_versions()
    try:
        opcontracts.set_mode("strict")
        opcontracts.set_mode("off", op="noisy_op")
        _report.record("op", "p", "dtype", "s", "strict", "m", expected="bfloat16",
                       got="dtype float32 (shape (4, 2))")
        path = _report.write_report(str(tmp_path / "r.json"))
    finally:
        monkeypatch.delenv("OPCONTRACTS_CANN_VERSION")
        opcontracts.set_versions()
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    meta = data["metadata"]
    assert set(meta) == META_KEYS
    assert (meta["opcontracts"], meta["cann"], meta["mode"], meta["mode_by_op"]) == (
        opcontracts.__version__, "8.0.RC3", "strict", {"noisy_op": "off"})
    assert meta["torch"] == torch.__version__ and meta["argv"] == sys.argv
    assert meta["rank"] is None and meta["host"]
    assert datetime.fromisoformat(meta["time"]).tzinfo is not None  # UTC, with its offset
    rec = data["records"][0]
    assert (rec["expected"], rec["got"]) == ("bfloat16", "dtype float32 (shape (4, 2))")
    # read back: the metadata stays the file's, not the reader's
    rep = _report.load_report(path)
    assert rep.metadata == meta and rep.to_dict()["metadata"] == meta
    assert (rep.records[0].expected, rep.records[0].got) == (rec["expected"], rec["got"])
    # a live snapshot says where it is, when it is written
    assert set(opcontracts.report().to_dict()["metadata"]) == META_KEYS


def test_from_dict_rejects_what_is_not_a_report():
    with pytest.raises(ValueError, match=r"not an opcontracts report: no 'records' list"):
        opcontracts.Report.from_dict({"a": 1})
    with pytest.raises(ValueError, match=r"records\[0\]: no 'message' field"):
        opcontracts.Report.from_dict({"records": [{"op": "o", "arg": None, "rule": "dtype",
                                                   "call_site": "s", "mode": "warn",
                                                   "count": 1}]})
    # fields a newer opcontracts adds are ignored, not an error
    rep = opcontracts.Report.from_dict({"records": [
        {"op": "o", "arg": None, "rule": "dtype", "call_site": "s", "mode": "warn", "count": 1,
         "message": "m", "from_the_future": 1}], "extra": {}})
    assert rep.records[0].op == "o" and rep.records[0].expected is None


def test_records_of_guarded_calls_have_expected_and_got():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rms_norm(torch.ones(2, 8), torch.ones(8))
    [rec] = opcontracts.report().records
    # the message's "expected:" and "got:" lines, as fields
    assert rec.expected == "bfloat16 or float16"
    assert rec.got == "dtype float32 (shape (2, 8))"
    assert json.loads(opcontracts.report().to_json())["records"][0]["got"] == rec.got
