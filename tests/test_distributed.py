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
from opcontracts import _report, cli
from opcontracts._dist import format_merged, gather_report, merge_files

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
               "-m", "opcontracts", "run", "--report", str(out / "report.json"), str(script),
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
    # the backward's grad op got the same fp32 probs, from loss.backward(), on rank 1 only
    assert {r.op for r in rep1.records} == {"npu_moe_token_unpermute",
                                            "npu_moe_token_unpermute_grad"}


@needs_gloo
def test_gather_on_rank0_lists_rank1(two_rank_job: Path) -> None:
    gathered = _report.Report.from_dict(json.loads((two_rank_job / "gathered.json").read_text()))
    by_op = {r.op: r for r in gathered.records}
    assert set(by_op) == {"npu_moe_token_unpermute", "npu_moe_token_unpermute_grad"}
    assert all(r.ranks == [1] for r in gathered.records)
    assert by_op["npu_moe_token_unpermute"].count == 2
    assert gathered.total == 4


@needs_gloo
def test_report_merge_names_rank1_alone(two_rank_job: Path, capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    files = [str(two_rank_job / "report.rank0.json"), str(two_rank_job / "report.rank1.json")]
    merged_json = tmp_path / "merged.json"
    assert cli.main(["report", "merge", *files, "--json", str(merged_json)]) == 0
    out = capsys.readouterr().out
    assert "merged 2 report file(s) from rank(s) 0,1" in out
    assert (f"npu_moe_token_unpermute: probs dtype at {two_rank_job.parent}{os.sep}"
            f"train_moe.py:{UNPERMUTE_LINE} in forward: rank 1 only (not rank 0)") in out
    data = json.loads(merged_json.read_text())
    assert data["ranks"] == [0, 1]
    assert {(r["op"], tuple(r["ranks"])) for r in data["records"]} == {
        ("npu_moe_token_unpermute", (1,)), ("npu_moe_token_unpermute_grad", (1,))}
    # the console script, on the folder: the gathered.json next to the rank files is not counted
    proc = subprocess.run([sys.executable, "-m", "opcontracts", "report", "merge",
                           str(two_rank_job)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
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


def test_merge_of_single_process_reports(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    f = _write(tmp_path / "report.json", None, [_rec("op_a", "a.py:1 in f")])
    assert cli.main(["report", "merge", f]) == 0
    out = capsys.readouterr().out
    assert "merged 1 report file(s)\n" in out and "rank unknown" in out


def test_gather_outside_a_distributed_job_is_the_plain_report() -> None:
    assert not dist.is_initialized()
    _report.record("op_a", "x", "dtype", "a.py:1 in f", "warn", "msg")
    plain, gathered = opcontracts.report(), opcontracts.report(gather=True)
    assert plain == gathered and len(gathered) == 1
    assert gather_report(plain) is plain
