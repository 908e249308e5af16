"""The shipped contracts are inside the wheel, and `import opcontracts.patch` stays light."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_contracts_and_py_typed(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    [wheel] = tmp_path.glob("opcontracts-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(ROOT / "contracts").as_posix() for p in (ROOT / "contracts").rglob("*.toml")}
    assert shipped, "no contract files in the source tree"
    assert {f"opcontracts/contracts/{s}" for s in shipped} <= names
    assert "opcontracts/py.typed" in names
    # every module of the source tree (the explicit `packages` list must name each package)
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "opcontracts").rglob("*.py")}
    assert sources <= names, sorted(sources - names)


def test_import_patch_does_not_import_pydantic_or_torch_npu() -> None:
    code = ("import sys, opcontracts.patch as p; "
            "print('pydantic' in sys.modules, 'torch_npu' in sys.modules, len(p.patched()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[:2] == ["False", "False"]
