"""``opcontracts run --emulate``: the Python processes the script starts (spawned or forkserver
workers, as MindSpeed's DistributedTest and torchrun's ranks are) run on the same emulation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opcontracts._tools import run as _run

SPAWNER = textwrap.dedent("""
    import multiprocessing as mp
    import sys

    def work(q):
        import torch
        import torch_npu  # noqa: F401 - a fresh interpreter: only the emulation provides it
        q.put(str(torch.ones(2).npu().device))

    if __name__ == "__main__":
        ctx = mp.get_context(sys.argv[1])
        q = ctx.Queue()
        p = ctx.Process(target=work, args=(q,))
        p.start()
        print("child device:", q.get(timeout=120))
        p.join()
""")


def _run_cli(cwd: Path, *args: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opcontracts", "run", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_spawned_worker_runs_on_the_emulated_device(tmp_path: Path, method: str) -> None:
    (tmp_path / "spawner.py").write_text(SPAWNER)
    out = _run_cli(tmp_path, "--emulate", "-q", "spawner.py", method)
    assert out.returncode == 0, out.stderr
    assert "child device: npu:0" in out.stdout


def test_the_sitecustomize_it_hides_still_runs(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITE_RAN'] = '1'\n")
    (tmp_path / "child.py").write_text(
        "import subprocess, sys\n"
        "code = 'import os, torch_npu; print(os.environ.get(\"OWN_SITE_RAN\"), "
        "hasattr(torch_npu, \"npu_moe_token_unpermute\"))'\n"
        "print(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).stdout)\n")
    out = _run_cli(tmp_path, "--emulate", "-q", "child.py", env={"PYTHONPATH": str(own)})
    assert out.returncode == 0, out.stderr
    assert "1 True" in out.stdout  # the user's sitecustomize ran, and the emulation is there


def test_the_environment_is_put_back_after_the_run(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv(_run.CHILD_ENV, raising=False)
    (tmp_path / "s.py").write_text(
        "import os\nprint(os.environ['OPCONTRACTS_EMULATE_CHILD'], "
        "os.environ['PYTHONPATH'].split(os.pathsep)[1])\n")
    monkeypatch.chdir(tmp_path)
    assert _run.main(["--emulate", "-q", "s.py"]) == 0
    assert os.environ["PYTHONPATH"] == "/somewhere" and _run.CHILD_ENV not in os.environ
