"""The chip from ``torch_npu.npu.get_device_name()`` and CANN's ops package beside its toolkit.

The SoC is read only from a torch_npu already imported (never by importing it) and never
through ``get_soc_version()``, which runs the device's lazy init; from CANN 8.5 the kernels are
a separate ops package (``<arch>-linux/ascend_ops_install.info``) whose version can differ from
the toolkit's, and the kernels are what contracts speak about.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_versions import _write_toolkit, isolated_versions  # noqa: F401 - the autouse fixture

from opcontracts import emulation
from opcontracts._lang import versions as _versions


@pytest.fixture
def fake_torch_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A torch_npu as a real one looks once imported: ``torch_npu.npu.get_device_name``, and a
    ``get_soc_version`` that must never be called."""
    mod = types.ModuleType("torch_npu")
    npu = types.ModuleType("torch_npu.npu")
    npu.get_device_name = lambda device_name=None: "Ascend910B4"  # type: ignore[attr-defined]

    def get_soc_version() -> int:
        raise AssertionError("get_soc_version() initialises the device: never call it")

    npu.get_soc_version = get_soc_version  # type: ignore[attr-defined]
    mod.npu = npu  # type: ignore[attr-defined]
    mod.__version__ = "2.13.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    yield mod
    monkeypatch.delitem(sys.modules, "torch_npu")
    _versions.refresh()


def test_soc_from_get_device_name_of_a_loaded_torch_npu(fake_torch_npu: types.ModuleType) -> None:
    env = _versions.refresh()
    assert env.soc == "Ascend910B4"
    assert env.origin("soc") == "torch_npu.npu.get_device_name()" and "soc" not in env.emulated


def test_soc_stays_unknown_when_the_driver_cannot_say(fake_torch_npu: types.ModuleType) -> None:
    def no_device(device_name: object = None) -> str:
        raise AssertionError("Invalid device id")  # torch_npu's error with no device visible

    fake_torch_npu.npu.get_device_name = no_device
    assert _versions.refresh().soc is None


def test_the_soc_variable_wins_over_the_device(fake_torch_npu: types.ModuleType) -> None:
    os.environ["OPCONTRACTS_SOC"] = "Ascend910_9382"
    assert _versions.refresh().soc == "Ascend910_9382"


def test_soc_is_not_asked_of_a_torch_npu_that_is_not_loaded() -> None:
    if "torch_npu" in sys.modules:  # pragma: no cover - an emulation left installed
        pytest.skip("torch_npu already imported")
    assert _versions.refresh().soc is None
    assert "torch_npu" not in sys.modules and "torch_npu.npu" not in sys.modules


def test_soc_from_the_emulated_device_is_marked_as_emulation() -> None:
    emulation.install(device="Ascend910B2")
    try:
        import torch_npu  # noqa: F401 - the stand-in, as a user's script imports it

        env = _versions.current()
        assert env.soc == "Ascend910B2" and "soc" in env.emulated
        assert "emulation" in env.origin("soc")
    finally:
        emulation.uninstall()
    assert _versions.current().soc is None


def _write_ops(root: Path, version: str) -> None:
    d = root / "x86_64-linux"
    d.mkdir(parents=True, exist_ok=True)
    (d / "ascend_ops_install.info").write_text(
        f"package_name=Ascend-cann-910b-ops\nversion={version}\n")


def test_the_ops_package_decides_cann_and_the_toolkit_is_shown(isolated_versions: Path) -> None:  # noqa: F811
    root = _write_toolkit(isolated_versions / "cann", "8.5.0")
    _write_ops(root, "8.5.1")
    os.environ["ASCEND_HOME_PATH"] = str(root)
    env = _versions.refresh()
    assert env.cann == "8.5.1"
    origin = env.origin("cann")
    assert origin.startswith("ops package: ") and "ascend_ops_install.info" in origin
    assert "toolkit 8.5.0: " in origin and "ascend_toolkit_install.info" in origin


def test_an_ops_package_of_the_toolkits_version(isolated_versions: Path) -> None:  # noqa: F811
    root = _write_toolkit(isolated_versions / "cann", "8.5.0")
    _write_ops(root, "8.5.0")
    os.environ["ASCEND_HOME_PATH"] = str(root)
    env = _versions.refresh()
    assert env.cann == "8.5.0" and "toolkit the same: " in env.origin("cann")


def test_without_an_ops_package_the_toolkit_decides(isolated_versions: Path) -> None:  # noqa: F811
    root = _write_toolkit(isolated_versions / "cann", "8.3.RC1")
    os.environ["ASCEND_HOME_PATH"] = str(root)
    env = _versions.refresh()
    assert env.cann == "8.3.RC1" and "ops package" not in env.origin("cann")
