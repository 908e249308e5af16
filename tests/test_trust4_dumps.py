"""``check-dump`` and ``record --from-dump`` under hostile and unusual dumps: every argument a
call breaks, what could not be judged, ranks without a dump of a step, records that cannot be
read, files written whole or not at all, and dumps read one entry at a time.

The dumps are the committed real ones (tests/data/msprobe/, see test_check_dump.py) with one
entry edited.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from _check_dump_cli import as_json, run
from hypothesis import given, settings
from hypothesis import strategies as st

from opcontracts import cli
from opcontracts._jsonout import OutputError, json_text, replace_text, write_text
from opcontracts._observers.contract_out import dumps_contracts
from opcontracts._tools import json_stream
from opcontracts._tools.json_stream import ObjectStream, StreamError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DATA = Path(__file__).parent / "data" / "msprobe"
WRONG = DATA / "stats_wrong"
CLEAN = DATA / "stats_clean"
NPU = DATA / "stats_npu"
TENSOR = DATA / "tensor_wrong"
UNPERMUTE = "NPU.npu_moe_token_unpermute.0.forward"
RMS_NORM = "NPU.npu_rms_norm.0.forward"
OLD = ["--torch-npu", "2.13.0", "--cann", "8.0.RC3"]


def edited(src: Path, dest: Path, api: str, change: Any) -> Path:
    """A copy of the rank folder ``src`` at ``dest`` with ``change`` applied to entry ``api``."""
    shutil.copytree(src, dest)
    p = dest / "dump.json"
    data = json.loads(p.read_text())
    change(data["data"][api])
    p.write_text(json.dumps(data))
    return dest


def int64_indices(entry: dict[str, Any]) -> None:
    entry["input_args"][1]["dtype"] = "torch.int64"


# ----------------------------------------------------------------- every argument of a call
def test_every_argument_a_call_breaks_is_reported(capsys: Any, tmp_path: Path) -> None:
    """The incident's call with int64 ``sorted_indices`` and fp32 ``probs`` on CANN 8.0.RC3:
    both are violations, both are reported (a user fixes one and meets the other at once)."""
    rank = edited(NPU / "step0" / "rank0", tmp_path / "step0" / "rank0", UNPERMUTE,
                  int64_indices)
    code, data = as_json(capsys, rank, *OLD)
    assert code == 1
    found = {(f["argument"], f["rule"], f["expected"], f["verdict"]) for f in data["findings"]}
    assert found == {("sorted_indices", "dtype", "int32", "violation"),
                     ("probs", "dtype", "bfloat16", "violation")}
    code, out, _ = run(capsys, rank, *OLD)
    assert "2 contract violation(s)" in out
    assert "sorted_indices = sorted_indices.to(torch.int32)" in out
    assert "probs = probs.to(torch.bfloat16)" in out


def test_each_argument_keeps_its_own_verdict(capsys: Any, tmp_path: Path) -> None:
    """Versions unknown: int64 indices are rejected on every reading (a violation), fp32 probs
    only on some (conditional); the one does not make the other a violation."""
    rank = edited(NPU / "step0" / "rank0", tmp_path / "step0" / "rank0", UNPERMUTE,
                  int64_indices)
    code, data = as_json(capsys, rank, "--torch-npu", "unknown", "--cann", "unknown")
    assert code == 1
    verdicts = {f["argument"]: f["verdict"] for f in data["findings"]}
    assert verdicts == {"sorted_indices": "violation", "probs": "conditional"}
    probs = next(f for f in data["findings"] if f["argument"] == "probs")
    assert any("cann" in d for d in probs["depends_on"])


def test_a_rank_and_shape_violation_beside_a_dtype_one(capsys: Any, tmp_path: Path) -> None:
    """npu_rms_norm with an fp32 gamma of the wrong size: its dtype (same as self) and its
    shape are two rules of one argument; self's dtype is fine.  Both rules are reported."""
    def bad_gamma(entry: dict[str, Any]) -> None:
        entry["input_args"][1].update(dtype="torch.float32", shape=[7])

    rank = edited(CLEAN / "step0" / "rank0", tmp_path / "rank0", RMS_NORM, bad_gamma)
    code, data = as_json(capsys, rank)
    assert code == 1
    assert {(f["argument"], f["rule"]) for f in data["findings"]} == {
        ("gamma", "same_dtype"), ("gamma", "shape")}


def test_record_warns_about_the_first_and_counts_the_call_once(capsys: Any,
                                                               tmp_path: Path) -> None:
    rank = edited(NPU / "step0" / "rank0", tmp_path / "step0" / "rank0", UNPERMUTE,
                  int64_indices)
    out = tmp_path / "golden.toml"
    assert cli.main(["record", "--from-dump", str(rank), "-o", str(out), *OLD]) == 0
    err = capsys.readouterr().err
    assert "1 call(s) that broke a contract left out" in err


# ----------------------------------------------------------------- what could not be judged
def no_dtype(entry: dict[str, Any]) -> None:
    for a in entry["input_args"]:
        a.pop("dtype", None)


def strip_dtypes(dump: Path) -> None:
    """Every tensor argument of every entry of ``dump`` recorded without its dtype."""
    data = json.loads(dump.read_text())
    for entry in data["data"].values():
        for a in entry.get("input_args", []):
            if isinstance(a, dict):
                a.pop("dtype", None)
    dump.write_text(json.dumps(data))


def test_a_dump_without_dtypes_is_no_clean_bill(capsys: Any, tmp_path: Path) -> None:
    """Every tensor recorded without its dtype: nothing could be judged; exit status 3, the
    counts per op and argument with why, never "no contract violations"."""
    rank = tmp_path / "rank0"
    shutil.copytree(WRONG / "step0" / "rank0", rank)
    strip_dtypes(rank / "dump.json")
    code, out, _ = run(capsys, rank)
    assert code == 3
    assert "no contract violations" not in out
    assert "nothing could be judged: 3 forward call(s)" in out and "no clean bill" in out
    assert ("mindspeed.npu_moe_token_unpermute: argument 'probs': no dtype recorded: 1 call(s)"
            in out)
    code, data = as_json(capsys, rank)
    assert code == 3 and data["checked"] == 0 and data["judged_nothing"] is True
    rows = {(n["op"], n["argument"]): (n["why"], n["calls"]) for n in data["not_judged"]}
    assert rows[("npu_rms_norm", "self")] == ("no dtype recorded", 1)
    assert rows[("mindspeed.npu_moe_token_unpermute", "permuted_tokens")] == (
        "no dtype recorded", 1)


def test_some_calls_not_judged_says_so_beside_the_verdict(capsys: Any, tmp_path: Path) -> None:
    rank = edited(CLEAN / "step0" / "rank0", tmp_path / "rank0", RMS_NORM, no_dtype)
    code, out, _ = run(capsys, rank)
    assert code == 0
    assert "no contract violations in the 2 call(s) judged whole; 1 call(s) could not be " \
        "judged" in out
    assert "npu_rms_norm: argument 'self': no dtype recorded: 1 call(s), first " \
        "NPU.npu_rms_norm.0.forward" in out


def test_a_dtype_this_torch_lacks_is_not_judged(capsys: Any, tmp_path: Path) -> None:
    def fp4(entry: dict[str, Any]) -> None:
        entry["input_args"][0]["dtype"] = "torch.float4_e9m9"

    rank = edited(CLEAN / "step0" / "rank0", tmp_path / "rank0", RMS_NORM, fp4)
    code, data = as_json(capsys, rank)
    assert code == 0
    (row,) = data["not_judged"]
    assert (row["op"], row["argument"]) == ("npu_rms_norm", "self")
    assert "float4_e9m9 is not a torch dtype here" in row["why"]


# ----------------------------------------------------------------- ranks without a dump of a step
def test_a_rank_without_a_dump_of_the_step_is_said_plainly(capsys: Any, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    for step in ("step0", "step1"):
        shutil.copytree(WRONG / step / "rank0", dump / step / "rank0")
    shutil.copytree(WRONG / "step0" / "rank1", dump / "step0" / "rank1")
    code, out, _ = run(capsys, dump)
    assert code == 1
    assert "rank 0 only (not rank 1)" not in out
    assert "step 1: mindspeed.npu_moe_token_unpermute: probs dtype at " in out
    line = next(ln for ln in out.splitlines() if ln.startswith("  step 1:"))
    assert line.endswith(": rank 0; rank 1 has no dump of step 1"), line
    line = next(ln for ln in out.splitlines() if ln.startswith("  step 0:"))
    assert line.endswith(": ranks 0,1 (every rank)"), line
    _, data = as_json(capsys, dump)
    assert data["ranks_by_step"] == [{"step": 0, "ranks": [0, 1]}, {"step": 1, "ranks": [0]}]


def test_a_rank_that_did_not_see_it_beside_one_without_a_dump(capsys: Any,
                                                             tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    shutil.copytree(WRONG / "step1" / "rank0", dump / "step1" / "rank0")
    shutil.copytree(CLEAN / "step0" / "rank1", dump / "step1" / "rank1")
    shutil.copytree(CLEAN / "step0" / "rank0", dump / "step0" / "rank2")
    code, out, _ = run(capsys, dump)
    assert code == 1
    line = next(ln for ln in out.splitlines() if ln.startswith("  step 1:"))
    assert line.endswith(": rank 0 only (not rank 1); rank 2 has no dump of step 1"), line


# ----------------------------------------------------------------- records that cannot be read
@pytest.mark.parametrize("shape, says", [
    ([-4, 8], "negative size -4"),
    ([float("inf"), 8], "Infinity is not a size"),
    ([float("nan"), 8], "NaN is not a size"),
    ([2**62, 2**62], "more elements than a tensor can have"),
    ([4.5, 8], "4.5 is not a size"),
    ([True, 8], "true is not a size"),
    ("4x8", "is not a list of sizes"),
    (None, "no shape recorded"),
])
def test_a_record_that_is_no_tensor_is_not_judged_the_rest_is(capsys: Any, tmp_path: Path,
                                                              shape: Any, says: str) -> None:
    """A negative, infinite or overflowing size: that argument is reported as not judged,
    with why; the rest of the dump is judged (the fp32 probs is still found)."""
    def bad_shape(entry: dict[str, Any]) -> None:
        entry["input_args"][0]["shape"] = shape

    rank = edited(WRONG / "step0" / "rank0", tmp_path / "rank0", RMS_NORM, bad_shape)
    code, out, err = run(capsys, rank)
    assert code == 1, err
    assert "Traceback" not in out + err
    assert "1 contract violation(s)" in out and "probs" in out
    assert "npu_rms_norm: argument 'self': shape" in out or "npu_rms_norm: argument 'self': no " in out
    assert says in out


def test_a_deeply_nested_dump_is_one_line_naming_the_file_and_entry(capsys: Any,
                                                                   tmp_path: Path) -> None:
    rank = tmp_path / "rank0"
    rank.mkdir()
    deep = "[" * 100_000 + "]" * 100_000
    (rank / "dump.json").write_text('{"task": "statistics", "data": {"NPU.npu_rms_norm.0.forward":'
                                    ' {"input_args": ' + deep + "}}}")
    code, out, err = run(capsys, rank)
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert str(rank / "dump.json") in err
    assert "data['NPU.npu_rms_norm.0.forward']" in err and "nested too deeply" in err


def test_lists_nested_just_below_what_json_reads_are_judged_without_a_traceback(
        capsys: Any, tmp_path: Path) -> None:
    """Lists nested hundreds deep, which the JSON scanner reads: the argument is no tensor,
    judged as such (the reader does not recurse into them)."""
    rank = tmp_path / "rank0"
    rank.mkdir()
    deep = "[" * 500 + "]" * 500
    (rank / "dump.json").write_text('{"task": "statistics", "data": {"NPU.npu_rms_norm.0.forward":'
                                    ' {"input_args": [' + deep + "]}}}")
    code, out, err = run(capsys, rank)
    assert "Traceback" not in out + err and err == ""
    assert code == 1 and "argument 'self' is a list, expected a tensor" in out


def test_a_deeply_nested_stack_json_names_it(capsys: Any, tmp_path: Path) -> None:
    rank = tmp_path / "rank0"
    shutil.copytree(CLEAN / "step0" / "rank0", rank)
    (rank / "stack.json").write_text('{"0": ' + "[" * 100_000 + "]" * 100_000 + "}")
    code, _, err = run(capsys, rank)
    assert code == 2 and "stack.json" in err and "nested too deeply" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("cut", [10, 5000, -3])
def test_a_truncated_dump_is_one_line_with_where(capsys: Any, tmp_path: Path, cut: int) -> None:
    rank = tmp_path / "rank0"
    shutil.copytree(WRONG / "step0" / "rank0", rank)
    text = (rank / "dump.json").read_text()
    (rank / "dump.json").write_text(text[:cut])
    code, out, err = run(capsys, rank)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "not JSON (line " in err and str(rank / "dump.json") in err


def test_record_leaves_out_calls_it_cannot_read(capsys: Any, tmp_path: Path) -> None:
    rank = edited(CLEAN / "step0" / "rank0", tmp_path / "rank0", RMS_NORM, no_dtype)
    out = tmp_path / "golden.toml"
    assert cli.main(["record", "--from-dump", str(rank), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "1 call(s) left out: an argument's record cannot be read" in err
    from opcontracts.spec import load_contracts

    ops = {c.op for c in load_contracts(out)}
    assert "npu_rms_norm" not in ops and "mindspeed.npu_moe_token_unpermute" in ops


def test_record_with_nothing_to_record_writes_no_file(capsys: Any, tmp_path: Path) -> None:
    """Every call unreadable: no golden file (an empty one would make each later compare
    against it vacuous), exit status 3 and one line saying why; an older file is kept."""
    rank = tmp_path / "rank0"
    shutil.copytree(CLEAN / "step0" / "rank0", rank)
    strip_dtypes(rank / "dump.json")
    out = tmp_path / "golden.toml"
    assert cli.main(["record", "--from-dump", str(rank), "-o", str(out)]) == 3
    err = capsys.readouterr().err
    assert "nothing recorded from" in err and "record cannot be read" in err
    assert "not written" in err and not out.exists()
    out.write_text("# an older golden file\n")
    assert cli.main(["record", "--from-dump", str(rank), "-o", str(out)]) == 3
    assert out.read_text() == "# an older golden file\n"


# ----------------------------------------------------------------- tensor files are never read
def test_tensor_files_are_never_unpickled(capsys: Any, tmp_path: Path) -> None:
    """A tensor-mode dump's .pt files, here pickles that would write a file when loaded: neither
    check-dump nor record --from-dump opens them."""
    dump = tmp_path / "dump"
    shutil.copytree(TENSOR, dump)
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    names = [n for n in (dump / "step0" / "rank0" / "dump.json").read_text().split('"')
             if n.endswith(".pt")]
    assert names
    for rank in ("rank0", "rank1"):
        folder = dump / "step0" / rank / "dump_tensor_data"
        folder.mkdir(exist_ok=True)
        for name in names:
            (folder / name).write_bytes(pickle.dumps(Evil()))
    assert as_json(capsys, dump)[0] == 1
    assert cli.main(["record", "--from-dump", str(dump), "-o", str(tmp_path / "g.toml")]) == 0
    capsys.readouterr()
    assert not marker.exists()


# ----------------------------------------------------------------- golden files: whole, escaped
def custom_dump(tmp_path: Path, mode: str) -> tuple[Path, Path]:
    """A dump of ``mypkg.ops.fused_scale(x, mode)`` with the string ``mode``, and the user's
    contract naming it."""
    contract = tmp_path / "mine.toml"
    contract.write_text('[[contract]]\nop = "fused_scale"\ntargets = ["mypkg.ops.fused_scale"]\n'
                        'signature = ["x", "mode"]\nsource = "test"\n'
                        '[contract.args.x]\ndtype = "bf16"\nshape = "N H"\n')
    rank = tmp_path / "rank0"
    rank.mkdir()
    tensor = {"type": "torch.Tensor", "dtype": "torch.bfloat16", "shape": [4, 8]}
    entry = {"input_args": [tensor, {"type": "str", "value": mode}], "input_kwargs": {},
             "output": [tensor]}
    (rank / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "data": {
        "mypkg.ops.fused_scale.0.forward": entry}}))
    return rank, contract


def test_a_lone_surrogate_leaves_the_golden_file_whole(capsys: Any, tmp_path: Path) -> None:
    """A recorded string with a lone surrogate (TOML cannot hold one): the golden file is
    written, loads, keeps the dtype rule and says why ``mode`` has no ``allowed``; before, the
    existing file was left at 0 bytes."""
    rank, contract = custom_dump(tmp_path, "\udc80mode")
    golden = tmp_path / "golden.toml"
    golden.write_text("# the golden file of yesterday\n")
    assert cli.main(["record", "--from-dump", str(rank), "-o", str(golden),
                     "--contracts", str(contract)]) == 0
    capsys.readouterr()
    text = golden.read_text(encoding="utf-8")
    assert "allowed: not written" in text and "lone surrogate" in text
    from opcontracts.spec import load_contracts

    (c,) = load_contracts(golden)
    assert c.args["x"].dtype == ("bfloat16",) and c.args["mode"].allowed is None


@pytest.mark.parametrize("mode", ["a\x7fb", "a\x00b", "line\nbreak", 'quote"', "back\\slash",
                                  "\x1b[31mred", "tab\t", "\u2028", "\U0001f600"])
def test_a_control_character_is_escaped_and_the_contract_kept(capsys: Any, tmp_path: Path,
                                                              mode: str) -> None:
    rank, contract = custom_dump(tmp_path, mode)
    golden = tmp_path / "golden.toml"
    assert cli.main(["record", "--from-dump", str(rank), "-o", str(golden),
                     "--contracts", str(contract)]) == 0
    capsys.readouterr()
    from opcontracts.spec import load_contracts

    (c,) = load_contracts(golden)
    assert c.args["mode"].allowed == (mode,)


def test_a_dump_path_with_a_newline_stays_in_its_comment(capsys: Any, tmp_path: Path) -> None:
    """The dump's path goes into the header comment: a newline in it must not end the
    comment and write TOML of its own."""
    src, contract = custom_dump(tmp_path, "fast")
    rank = tmp_path / 'odd\n[[contract]]\nop = "injected"\n'
    src.rename(rank)
    golden = tmp_path / "golden.toml"
    assert cli.main(["record", "--from-dump", str(rank), "-o", str(golden),
                     "--contracts", str(contract)]) == 0
    capsys.readouterr()
    from opcontracts.spec import load_contracts

    assert [c.op for c in load_contracts(golden)] == ["fused_scale"]


HOSTILE = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF),
                  max_size=12)


@settings(max_examples=200, deadline=None)
@given(value=HOSTILE, doc=HOSTILE, header=HOSTILE)
def test_any_string_round_trips_through_tomllib(value: str, doc: str, header: str) -> None:
    """Whatever a recorded string holds, the file written loads with tomllib; a rule's value
    reads back exactly, or (a lone surrogate, which TOML cannot hold) is left out."""
    text = dumps_contracts([{"op": "myop", "targets": ["m.f"], "doc": doc, "source": value,
                             "args": {"mode": {"allowed": [value]},
                                      "x": {"dtype": ["bfloat16"]}}}], [header])
    text.encode("utf-8")  # writable as it is
    data = tomllib.loads(text)
    (c,) = data["contract"]
    surrogate = any("\ud800" <= ch <= "\udfff" for ch in value)
    assert c["args"].get("mode", {}).get("allowed") == (None if surrogate else [value])
    assert c["args"]["x"]["dtype"] == ["bfloat16"]


def test_replace_text_leaves_the_old_file_when_the_text_cannot_be_encoded(
        tmp_path: Path) -> None:
    target = tmp_path / "golden.toml"
    target.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        replace_text(target, "new \udc80\n")
    assert target.read_text() == "old\n"
    with pytest.raises(OutputError, match="golden.toml: cannot write: the text holds a "
                                          "character UTF-8 cannot encode"):
        write_text(str(target), "new \udc80\n", "--record")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["golden.toml"]


def test_replace_text_leaves_the_old_file_when_the_write_fails(tmp_path: Path,
                                                               monkeypatch: Any) -> None:
    target = tmp_path / "report.json"
    target.write_text("old\n")
    os.chmod(target, 0o640)

    def no_rename(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OutputError, match="No space left on device"):
        write_text(str(target), "new\n", "--report")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["report.json"]
    monkeypatch.undo()
    write_text(str(target), "new\n", "--report")
    assert target.read_text() == "new\n"
    assert os.stat(target).st_mode & 0o777 == 0o640  # the file's mode kept


def test_report_files_with_a_surrogate_are_written(tmp_path: Path) -> None:
    """A file name in no encoding (a lone surrogate in Python) in a report: strict JSON with
    the escape, not an error, not an empty file."""
    from opcontracts._engine.records import Record, Report, write_report

    rep = Report([Record("op", "x", "dtype", "/data/\udcff.py:3", "warn", 1, "message")])
    path = write_report(str(tmp_path / "r.json"), rep)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    assert data["records"][0]["call_site"] == "/data/\udcff.py:3"
    assert json_text({"k": "\udcff"}).isascii()


# ----------------------------------------------------------------- reading one entry at a time
def test_small_chunks_give_the_same_verdict(capsys: Any, monkeypatch: Any) -> None:
    """Entries, strings, escapes and numbers cut at every kind of place by a chunk of 7
    characters: the same findings as read whole."""
    _, whole = as_json(capsys, WRONG)
    monkeypatch.setattr(json_stream, "CHUNK", 7)
    _, small = as_json(capsys, WRONG)
    assert small == whole


@settings(max_examples=150, deadline=None)
@given(data=st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids,
                                                               max_size=4), max_leaves=12),
    max_size=6), chunk=st.integers(1, 40), indent=st.sampled_from([None, 1]))
def test_object_stream_reads_what_json_loads_reads(data: dict[str, Any], chunk: int,
                                                   indent: int | None) -> None:
    text = json.dumps({"task": "x", "data": data}, indent=indent)
    old = json_stream.CHUNK
    json_stream.CHUNK = chunk
    try:
        s = ObjectStream(io.StringIO(text))
        got: dict[str, Any] = {}
        for key in s.members():
            if key == "data":
                got["data"] = {k: s.value(k) for k in s.members("data")}
            else:
                got[key] = s.value(key)
        s.end()
    finally:
        json_stream.CHUNK = old
    assert got == json.loads(text)


@pytest.mark.parametrize("text", ['{"a": 1,, "b": 2}', '{"a": [1, 2}', '{"a" 1}', '{"a": 1} x',
                                  '{"a": tru}', '{"a": "x\\q"}'])
def test_object_stream_errors_say_where(text: str) -> None:
    with pytest.raises(StreamError, match=r"not JSON \(line 1, column \d+: "):
        s = ObjectStream(io.StringIO(text))
        for key in s.members():
            s.value(key)
        s.end()


def test_the_reader_keeps_no_more_than_a_chunk_and_an_entry(tmp_path: Path,
                                                            monkeypatch: Any) -> None:
    """A dump.json of 3,000 entries read through a file that records every read: the text
    held at once never grows with the file (bounded memory, not a timing)."""
    from opcontracts._tools import msprobe_dump

    entry = json.loads((WRONG / "step0" / "rank0" / "dump.json").read_text())["data"]
    big = {f"Tensor.add.{i}.forward": entry["Tensor.__mul__.0.forward"] for i in range(3000)}
    big["NPU.npu_rms_norm.0.forward"] = entry[RMS_NORM]
    path = tmp_path / "rank0" / "dump.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"task": "statistics", "data": big}, indent=1))
    monkeypatch.setattr(json_stream, "CHUNK", 4096)
    held: list[int] = []
    real = ObjectStream._fill

    def fill(self: ObjectStream, at_least: int = 4096) -> bool:
        ok = real(self, at_least)
        held.append(len(self._buf))
        return ok

    monkeypatch.setattr(ObjectStream, "_fill", fill)
    calls = list(msprobe_dump.read_rank_dump(path).calls())
    assert len(calls) == 3001
    assert path.stat().st_size > 100 * 4096 and max(held) < 3 * 4096
