"""Warnings about environment variables: at the user's start-up line, once each."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

from opcontracts._lang import envwarn


def test_warning_points_at_the_callers_line_and_is_shown_once():
    envwarn.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envwarn.warn_setting("OPCONTRACTS_X", "bad value 'q'")  # this line
        line = sys._getframe().f_lineno - 1
        envwarn.warn_setting("OPCONTRACTS_X", "bad value 'q'")
        envwarn.warn_setting("OPCONTRACTS_X", "bad value 'r'")
    assert [str(w.message) for w in caught] == ["OPCONTRACTS_X: bad value 'q'",
                                                "OPCONTRACTS_X: bad value 'r'"]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    assert caught[0].category is RuntimeWarning


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env["OPCONTRACTS_CONTRACTS"] = str(tmp_path / "nope.toml")
    return env


def test_import_in_a_script_warns_at_the_import_line(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text("import os\nimport opcontracts.patch\nprint('alive')\n")
    out = subprocess.run([sys.executable, str(script)], env=_env(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "alive"
    assert out.stderr.startswith(f"{script}:2: RuntimeWarning: OPCONTRACTS_CONTRACTS: "
                                 f"{tmp_path / 'nope.toml'}: no such file or folder; skipped")
    assert "opcontracts/patch.py" not in out.stderr


def test_opcontracts_run_warns_once(tmp_path: Path):
    # run() applies the patch its own import already applied: the warning used to print twice,
    # from two opcontracts lines (patch.py's apply() and run.py's patch.apply())
    script = tmp_path / "job.py"
    script.write_text("print('alive')\n")
    out = subprocess.run([sys.executable, "-m", "opcontracts", "run", str(script)],
                         env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "alive"
    assert out.stderr.count("OPCONTRACTS_CONTRACTS:") == 1
    assert "opcontracts/patch.py" not in out.stderr and "opcontracts/_tools/run.py" not in out.stderr
