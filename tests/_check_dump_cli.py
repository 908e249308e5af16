"""``opcontracts check-dump`` run in-process, shared by the dump tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from opcontracts import cli


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = cli.main(["check-dump", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def as_json(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, dict[str, Any]]:
    code, out, err = run(capsys, *argv, "--json", "-")
    assert err == "", err
    return code, json.loads(out)
