"""Opt-in: a transformers Qwen2-MoE from a small config trains on the emulated npu device as on
the CPU, through a plain loop, ``Trainer`` and accelerate (``tests/data/hf/moe_train.py``, run
unmodified under ``opcontracts run --emulate``; on npu with ``flash_attention_2``, which
transformers routes to ``torch_npu.npu_fusion_attention``).

Needs transformers and accelerate (not dependencies of opcontracts) and a few minutes::

    OPCONTRACTS_HF_TESTS=1 python -m pytest -q tests/test_hf_training.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "hf" / "moe_train.py"
BF16_RTOL = 2 ** -7  # bf16's precision at 1: a loss near 5 agrees to about 0.04

pytestmark = pytest.mark.hf  # opt-in: OPCONTRACTS_HF_TESTS=1 (tests/conftest.py)


def _losses(*argv: str, emulate: bool) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OPCONTRACTS_EMULATE_DEVICES", None)
    cmd = [sys.executable, *(["-m", "opcontracts", "run", "-q", "--emulate"] if emulate else []),
           str(SCRIPT), *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOSSES "))
    return [float(v) for v in json.loads(line.removeprefix("LOSSES "))]


@pytest.mark.parametrize("way", ["loop", "trainer", "accelerate"])
@pytest.mark.parametrize("setup", ["default none none", "default bf16 reentrant",
                                   "default bf16 nonreentrant", "eager none none"])
def test_moe_trains_on_npu_as_on_cpu(way: str, setup: str) -> None:
    npu = _losses("npu", way, *setup.split(), emulate=True)
    cpu = _losses("cpu", way, *setup.split(), emulate=False)
    assert len(npu) == len(cpu) == 3
    assert npu == pytest.approx(cpu, rel=BF16_RTOL), (npu, cpu)
    assert npu[0] != npu[-1]  # the optimizer moved the live parameters
