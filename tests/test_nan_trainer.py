"""Opt-in: ``opcontracts.NanStepCallback`` in a real transformers ``Trainer`` on the emulated npu
device (``tests/data/hf/nan_trainer.py``, run unmodified under ``opcontracts run --emulate``):
the one update step whose batch hands the fused unpermute fp32 probs (NaN gradients) is caught
at ``optimizer.step()``, skipped (the parameters do not move), and its replay under the watch
names the op.

Needs transformers and accelerate (not dependencies of opcontracts)::

    OPCONTRACTS_HF_TESTS=1 python -m pytest -q tests/test_nan_trainer.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "hf" / "nan_trainer.py"

pytestmark = pytest.mark.hf  # opt-in: OPCONTRACTS_HF_TESTS=1 (tests/conftest.py)


def test_a_trainer_on_the_npu_device_skips_and_replays_its_one_bad_step(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env.update(PYTHONPATH=str(ROOT), OPCONTRACTS_MODE="off",
               OPCONTRACTS_CANN_VERSION="8.0.RC3")  # the kernel takes bf16 probs only
    done = subprocess.run([sys.executable, "-m", "opcontracts", "run", "-q", "--emulate",
                           str(SCRIPT), str(tmp_path / "out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    assert r["device"] == "npu"
    on = r["always_on"]
    assert on["steps"] == 4 and len(on["bad_steps"]) == 1  # the one bad batch, wherever drawn
    bad = on["bad_steps"][0]
    # the bad step left the parameters as they were; every other step moved them
    assert r["moved"] == [step != bad for step in range(1, 5)]
    assert r["finite"] is True
    (f,) = on["findings"]
    assert (f["step"], f["how"], f["reproduced"], f["skipped"]) == (bad, "replay", True, True)
    culprit = f["culprit"]
    assert "npu_moe_token_unpermute" in culprit["op"] and culprit["direction"] == "backward"
    assert culprit["module"] == "mlp" and culprit["call_site"].startswith(str(SCRIPT))
    assert "the NaN reproduced" in done.stderr  # the callback's warning, with the culprit
