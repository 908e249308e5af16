"""Reports from a real two-process job, and merging per-rank report files.

``two_rank_job`` runs a small data-parallel MoE layer (DDP, gloo, CPU) on the emulated NPU ops,
once for the module: ``torchrun -m opcontracts run --report out/report.json train_moe.py``, the
way a user guards a job without editing it.  Rank 1 hands the unpermute kernel fp32 ``probs``
(the incident), rank 0 casts them to bf16.  Each rank checks its own calls in ``warn`` mode and
``opcontracts run`` writes its own report file (``report.rank{R}.json``); rank 0 also writes
``opcontracts.report(gather=True)`` from inside the script.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import opcontracts
from opcontracts import cli
from opcontracts._engine import records as _report
from opcontracts._ranks.gather import format_merged, gather_report, merge_files

SCRIPT = '''
"""Two-rank data-parallel MoE steps on the CPU emulation; only rank 1 passes fp32 probs."""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from opcontracts import emulation

emulation.install()

import opcontracts  # noqa: E402  (opcontracts run has applied the patch)
import torch_npu  # noqa: E402


class MoE(nn.Module):
    def __init__(self, hidden=16, experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x, probs_dtype):
        probs, idx = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        tokens, sorted_indices = torch_npu.npu_moe_token_permute(x.to(torch.bfloat16), idx)
        counts = torch.bincount(idx.flatten(), minlength=len(self.experts)).tolist()
        chunks = tokens.float().split(counts)
        out = torch.cat([e(c) for e, c in zip(self.experts, chunks)]).to(torch.bfloat16)
        y = torch_npu.npu_moe_token_unpermute(out, sorted_indices, probs.to(probs_dtype))  # UNPERMUTE
        return y.float()


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(MoE())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)  # each rank its own data shard
    probs_dtype = torch.float32 if rank == 1 else torch.bfloat16
    for _ in range(2):
        loss = model(torch.randn(8, 16), probs_dtype).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    gathered = opcontracts.report(gather=True)  # a collective: every rank calls it
    if rank == 0:
        with open(os.path.join(out_dir, "gathered.json"), "w", encoding="utf-8") as f:
            f.write(gathered.to_json())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
UNPERMUTE_LINE = next(i for i, ln in enumerate(SCRIPT.splitlines(), 1) if "# UNPERMUTE" in ln)

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the job once; the folder with its report files."""
    work = tmp_path_factory.mktemp("dist")
    script = work / "train_moe.py"
    script.write_text(SCRIPT, encoding="utf-8")
    out = work / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env.update(OMP_NUM_THREADS="1", OPCONTRACTS_MODE="warn",
               OPCONTRACTS_CANN_VERSION="8.0.RC3")  # the kernel takes bf16 probs only
    failures = []
    for _attempt in range(2):  # a second try with a new port: the free port can be taken
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()),
               "-m", "opcontracts", "run", "--nan-check", "--compare", "--report",
               str(out / "report.json"),
               str(script),
               str(out)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=180)
        print(f"torchrun, 2 ranks: {time.perf_counter() - t0:.1f}s, exit {proc.returncode}")
        if proc.returncode == 0:
            break
        failures.append(proc.stdout[-3000:] + proc.stderr[-3000:])
    assert proc.returncode == 0, "\n---\n".join(failures)
    (work / "stderr.txt").write_text(proc.stderr, encoding="utf-8")
    return out


def _site(rec: _report.Record) -> str:
    return rec.call_site.rsplit(os.sep, 1)[-1]


@needs_gloo
def test_each_rank_writes_its_own_report(two_rank_job: Path) -> None:
    r0 = two_rank_job / "report.rank0.json"
    r1 = two_rank_job / "report.rank1.json"
    assert r0.exists() and r1.exists()
    assert json.loads(r0.read_text())["rank"] == 0
    assert json.loads(r1.read_text())["rank"] == 1
    assert not _report.load_report(str(r0)).records  # rank 0 cast its probs
    rep1 = _report.load_report(str(r1))
    unpermute = [r for r in rep1.records if r.op == "npu_moe_token_unpermute"]
    assert len(unpermute) == 1
    rec = unpermute[0]
    assert (rec.arg, rec.rule, rec.ranks, rec.count) == ("probs", "dtype", [1], 2)
    assert _site(rec) == f"train_moe.py:{UNPERMUTE_LINE} in forward"
    # each rank checks its own calls, and says so
    assert rec.message.startswith("[rank 1] npu_moe_token_unpermute: argument 'probs' has "
                                  "dtype float32")
    stderr = (two_rank_job.parent / "stderr.txt").read_text()
    assert "[rank 1] npu_moe_token_unpermute" in stderr
    assert "[rank 0]" not in stderr
    for k in (0, 1):  # opcontracts run wrote them
        assert f"opcontracts: report written to {two_rank_job}{os.sep}report.rank{k}.json" in stderr
    # the backward's grad op got the same fp32 probs, from loss.backward(), on rank 1 only:
    # the same mistake, attached to the forward call's record (one bug, one record)
    assert {r.op for r in rep1.records} == {"npu_moe_token_unpermute"}
    assert [(n["op"], n["arg"]) for n in rec.nested] == [("npu_moe_token_unpermute_grad_v2", "probs")]


@needs_gloo
def test_gather_on_rank0_lists_rank1(two_rank_job: Path) -> None:
    gathered = _report.Report.from_dict(json.loads((two_rank_job / "gathered.json").read_text()))
    by_op = {r.op: r for r in gathered.records}
    assert set(by_op) == {"npu_moe_token_unpermute"}
    assert all(r.ranks == [1] for r in gathered.records)
    assert by_op["npu_moe_token_unpermute"].count == 2
    assert by_op["npu_moe_token_unpermute"].nested[0]["op"] == "npu_moe_token_unpermute_grad_v2"
    assert gathered.total == 2


@needs_gloo
def test_report_merge_names_rank1_alone(two_rank_job: Path, capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    files = [str(two_rank_job / "report.rank0.json"), str(two_rank_job / "report.rank1.json")]
    merged_json = tmp_path / "merged.json"
    assert cli.main(["report", "merge", *files, "--json", str(merged_json)]) == 1  # violations
    out = capsys.readouterr().out
    assert "merged 2 report file(s) from rank(s) 0,1" in out
    assert (f"npu_moe_token_unpermute: probs dtype at {two_rank_job.parent}{os.sep}"
            f"train_moe.py:{UNPERMUTE_LINE} in forward: rank 1 only (not rank 0)") in out
    data = json.loads(merged_json.read_text())
    assert data["ranks"] == [0, 1]
    assert {(r["op"], tuple(r["ranks"])) for r in data["records"]} == {
        ("npu_moe_token_unpermute", (1,))}
    assert data["records"][0]["nested"][0]["op"] == "npu_moe_token_unpermute_grad_v2"
    # the NaN sentinel's findings (run --nan-check) survive the merge: rank 1's fp32 probs
    # make the bf16-only backward kernel overflow; rank 0 only receives the all-reduced inf
    assert "first culprit (rank 1):" in out
    assert ("first non-finite value: backward, in npu_moe_token_unpermute_grad_v2 "
            "(in the backward of npu_moe_token_unpermute)") in out
    assert "seen by rank 1 only (not rank 0)" in out
    assert "no NaN/inf from a guarded op on rank 0" in out
    nan = data["nan_sentinel"]
    assert (nan["first"]["op"], nan["first"]["rank"]) == ("npu_moe_token_unpermute_grad_v2", 1)
    assert (nan["seen_by"], nan["clean"]) == ([1], [0])
    assert [(s["rank"], s["first"] is None) for s in nan["per_rank"]] == [(0, True), (1, False)]
    assert nan["calls"] > 0
    # run's own sections survive too: what was checked, and the golden compare, per rank
    assert "shadow compare on rank(s) 0,1:" in out
    assert data["shadow_compare"]["ranks"] == [0, 1] and data["shadow_compare"]["checked"] > 0
    assert data["checked"]["ranks"] == [0, 1] and data["checked"]["calls"]
    # each file's metadata is kept, and says where it came from
    for k, src in enumerate(data["sources"]):
        meta = src["metadata"]
        assert (src["rank"], meta["rank"], meta["cann"], meta["mode"]) == (k, k, "8.0.RC3", "warn")
        assert meta["torch_npu"] and "torch_npu" in meta["emulated"]
        assert "run" in meta["argv"] and meta["host"] and meta["time"]
    assert data["metadata"]["opcontracts"] == opcontracts.__version__  # the merge's own
    # the console script, on the folder: the gathered.json next to the rank files is not counted
    proc = subprocess.run([sys.executable, "-m", "opcontracts", "report", "merge",
                           str(two_rank_job)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # violations found, as check-dump says
    assert "merged 2 report file(s) from rank(s) 0,1" in proc.stdout
    assert "rank 1 only (not rank 0)" in proc.stdout


# --------------------------------------------------------------------------- in one process
def _write(path: Path, rank: int | None, records: list[dict[str, object]]) -> str:
    data = {"total": sum(int(r["count"]) for r in records),  # type: ignore[call-overload]
            "dropped": 0, "rank": rank, "records": records}
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def _rec(op: str, site: str, count: int = 1) -> dict[str, object]:
    return {"op": op, "arg": "x", "rule": "dtype", "call_site": site, "mode": "warn",
            "count": count, "message": f"{op}: argument 'x' ...", "fixed": 0, "ranks": []}


def test_merge_files_says_which_ranks(tmp_path: Path) -> None:
    files = [_write(tmp_path / f"report.rank{k}.json", k,
                    [_rec("op_a", "a.py:1 in f")] + ([_rec("op_b", "b.py:2 in g", 3)] if k == 2
                                                     else []))
             for k in range(3)]
    merged, ranks = merge_files(files)
    assert ranks == [0, 1, 2]
    by_op = {r.op: r for r in merged.records}
    assert by_op["op_a"].ranks == [0, 1, 2] and by_op["op_a"].count == 3
    assert by_op["op_b"].ranks == [2] and by_op["op_b"].count == 3
    text = format_merged(merged, ranks, len(files))
    assert "op_a: x dtype at a.py:1 in f: ranks 0,1,2 (every rank)" in text
    assert "op_b: x dtype at b.py:2 in g: rank 2 only (not rank 0,1)" in text


def test_merge_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", "merge", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    assert cli.main(["report", "merge", str(bad)]) == 2
    assert cli.main(["report", "merge", str(tmp_path / "empty_dir_pattern*.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and "no report files" in err


def test_merge_names_each_bad_file_and_what_is_wrong(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path / "report.rank0.json", 0, [_rec("op_a", "a.py:1 in f")])
    not_json = tmp_path / "report.rank1.json"
    not_json.write_text("", encoding="utf-8")
    not_a_report = tmp_path / "report.rank2.json"
    not_a_report.write_text('{"a": 1}', encoding="utf-8")
    wrong_fields = tmp_path / "report.rank3.json"
    wrong_fields.write_text(json.dumps({"rank": 3, "total": 1, "records": [
        {"op": "op_a", "arg": "x", "rule": "dtype", "call_site": "a.py:1", "mode": "warn",
         "count": "3", "message": "m"},
        {"op": "op_b", "rule": "dtype"},
        "junk",
        {"op": "op_c", "arg": None, "rule": "dtype", "call_site": "c.py:3", "mode": "warn",
         "count": 1, "message": "m", "ranks": [-1], "nested": "no"}]}), encoding="utf-8")
    a_list = tmp_path / "list.json"
    a_list.write_text("[1, 2]", encoding="utf-8")
    files = [good, str(not_json), str(not_a_report), str(wrong_fields), str(a_list)]
    assert cli.main(["report", "merge", *files]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing merged from a partial set
    lines = captured.err.splitlines()
    pre = "opcontracts report merge: "
    assert f"{pre}{not_json}: not JSON (line 1 column 1: Expecting value)" in lines
    assert f"{pre}{not_a_report}: not an opcontracts report: no 'records' list (its keys: a)" \
        in lines
    assert f"{pre}{wrong_fields}: records[0].count: expected an integer >= 1, got '3'" in lines
    assert f"{pre}{wrong_fields}: records[1]: no 'arg' field" in lines
    assert f"{pre}{wrong_fields}: records[1]: no 'call_site' field" in lines
    assert f"{pre}{wrong_fields}: records[2]: expected an object, got 'junk'" in lines
    assert f"{pre}{wrong_fields}: records[3].ranks: expected a list of ranks (integers >= 0), " \
        "got [-1]" in lines
    assert f"{pre}{wrong_fields}: records[3].nested: expected a list of objects, got 'no'" in lines
    assert f"{pre}{a_list}: not an opcontracts report: expected a JSON object, got [1, 2]" in lines
    assert not any(str(good) in ln for ln in lines)
    # the library call raises the project's error (a ValueError) naming the file
    with pytest.raises(_report.ReportFileError, match=r"report\.rank2\.json: not an opcontracts"):
        _report.load_report(str(not_a_report))
    with pytest.raises(ValueError, match=r"records\[0\]\.count"):
        _report.Report.from_dict(json.loads(wrong_fields.read_text()))


def _nan_event(op: str, seq: int = 1, **kw: object) -> dict[str, object]:
    return {"op": op, "direction": "backward", "kind": "output", "arg": "output[0]",
            "dtype": "bfloat16", "shape": [4, 8], "nan": 0, "inf": 32,
            "call_site": "train.py:11 in forward", "module": "layers.1.mlp",
            "module_type": "MoELayer", "backward_of": None, "seq": seq, **kw}


def _write_nan(path: Path, rank: int, first: dict[str, object] | None,
               events: list[dict[str, object]], calls: int = 50) -> str:
    data = {"rank": rank, "total": 0, "dropped": 0, "records": [],
            "nan_sentinel": {"first": first, "events": events, "received": None,
                             "calls": calls, "dropped": 0}}
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_merge_keeps_the_nan_sentinels_findings(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _nan_event("op_a"), _nan_event("op_b")
    files = [_write_nan(tmp_path / "report.rank0.json", 0, None, []),
             _write_nan(tmp_path / "report.rank1.json", 1, a, [a]),
             _write_nan(tmp_path / "report.rank2.json", 2, b, [b, _nan_event("op_a", 2)]),
             _write_nan(tmp_path / "report.rank3.json", 3, a, [a])]
    out_json = tmp_path / "merged.json"
    assert cli.main(["report", "merge", *files, "--json", str(out_json)]) == 1  # culprits
    out = capsys.readouterr().out
    assert "NaN sentinel (--nan-check) in 4 file(s): 200 guarded call(s) checked" in out
    assert "first culprit (rank 1):" in out
    assert "first non-finite value: backward, in op_a" in out
    assert "module:    layers.1.mlp (MoELayer)" in out
    assert "seen by ranks 1,2,3 only (not rank 0)" in out  # rank 2 saw it after op_b
    assert "  the first culprit of each rank (the ranks share no clock):" in out
    assert "    1,3: backward op_a: output[0] at train.py:11 in forward" in out
    assert "    2: backward op_b: output[0] at train.py:11 in forward" in out
    assert "no NaN/inf from a guarded op on rank 0" in out
    nan = json.loads(out_json.read_text())["nan_sentinel"]
    assert (nan["first"]["op"], nan["first"]["rank"]) == ("op_a", 1)
    assert [(g["event"]["op"], g["ranks"]) for g in nan["firsts"]] == [("op_a", [1, 3]),
                                                                        ("op_b", [2])]
    assert (nan["seen_by"], nan["clean"], nan["calls"]) == ([1, 2, 3], [0], 200)
    # with a time on the events (ranks whose clocks agree), the earliest wins
    files[2] = _write_nan(tmp_path / "report.rank2.json", 2, {**b, "time": 5.0}, [b])
    files[1] = _write_nan(tmp_path / "report.rank1.json", 1, {**a, "time": 9.0}, [a])
    assert cli.main(["report", "merge", *files]) == 1
    assert "first culprit (rank 2):" in capsys.readouterr().out


def test_merge_says_when_no_guarded_op_made_nan(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    files = [_write_nan(tmp_path / f"report.rank{k}.json", k, None, []) for k in range(2)]
    assert cli.main(["report", "merge", *files]) == 0
    out = capsys.readouterr().out
    assert "no contract violations." in out
    assert "no guarded op produced NaN or inf on any rank" in out


def test_merge_flags_ranks_on_different_versions(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    files = []
    for k, cann in enumerate(["8.0.RC3", "8.0.RC3", "8.0.0"]):
        path = tmp_path / f"report.rank{k}.json"
        meta = {**_report.metadata(rank=k), "cann": cann}
        path.write_text(json.dumps({"metadata": meta, "rank": k, "total": 0, "dropped": 0,
                                    "records": []}), encoding="utf-8")
        files.append(str(path))
    assert cli.main(["report", "merge", *files]) == 0
    out = capsys.readouterr().out
    assert "the files disagree on versions (so on which contracts apply):" in out
    assert "  cann: 8.0.RC3 (rank 0,1), 8.0.0 (rank 2)" in out


def test_merge_of_single_process_reports(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    f = _write(tmp_path / "report.json", None, [_rec("op_a", "a.py:1 in f")])
    assert cli.main(["report", "merge", f]) == 1  # a violation
    out = capsys.readouterr().out
    assert "merged 1 report file(s)\n" in out and "rank unknown" in out


def test_gather_outside_a_distributed_job_is_the_plain_report() -> None:
    assert not dist.is_initialized()
    _report.record("op_a", "x", "dtype", "a.py:1 in f", "warn", "msg")
    plain, gathered = opcontracts.report(), opcontracts.report(gather=True)
    assert plain == gathered and len(gathered) == 1
    assert gather_report(plain) is plain
