"""Version detection, CANN version normalisation and ``when`` evaluation.

Every test runs with the version environment variables removed, CANN's default install roots
pointed at an empty folder and no ``set_versions`` pins, so the machine running the tests
cannot leak into them; the fixture restores all of it.
"""

from __future__ import annotations

import ast
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.version import Version

import opcontracts
from opcontracts import Arg, Contract, When, load_contracts
from opcontracts._engine import registry
from opcontracts._lang import versions
from opcontracts._lang.versions import (
    Env,
    applies,
    explain,
    normalize_version,
    parse_version,
    satisfies,
)

_VARS = (*versions.ENV_VARS.values(), *versions.CANN_ROOT_VARS)


@pytest.fixture(autouse=True)
def isolated_versions(tmp_path: Path) -> Iterator[Path]:
    """No env vars, no CANN install, no pins; everything put back afterwards."""
    saved_env = {k: os.environ.pop(k) for k in _VARS if k in os.environ}
    saved_roots = list(versions.CANN_DEFAULT_ROOTS)
    versions.CANN_DEFAULT_ROOTS[:] = [str(tmp_path / "no-cann-here")]
    prev = versions.set_versions(torch_npu=None, cann=None, mindspeed=None, soc=None)
    try:
        yield tmp_path
    finally:
        for k in _VARS:
            os.environ.pop(k, None)
        os.environ.update(saved_env)
        versions.CANN_DEFAULT_ROOTS[:] = saved_roots
        versions.set_versions(**prev)  # restores the pins and re-detects


# --------------------------------------------------------------------------- normalisation
@pytest.mark.parametrize(
    ("raw", "pep440"),
    [
        ("8.0.RC3", "8.0rc3"),
        ("8.1.RC1", "8.1rc1"),
        ("8.0.RC2.alpha003", "8.0rc2.dev3"),
        ("8.0.RC1.B010", "8.0rc1.dev10"),
        ("8.0.0.alpha001", "8.0.0a1"),
        ("8.0.0", "8.0.0"),
        ("CANN-1.83", "1.83"),
        ("2.5.1.post1.dev20250519", "2.5.1.post1.dev20250519"),
        ("2.13.0+cpu", "2.13.0+cpu"),
        (" 2.7.1 ", "2.7.1"),
    ],
)
def test_normalize_version(raw: str, pep440: str) -> None:
    assert normalize_version(raw) == pep440


@pytest.mark.parametrize("raw", ["", "garbage", "1.83.T8.0.B128", "latest"])
def test_unreadable_versions_are_none(raw: str) -> None:
    assert normalize_version(raw) is None
    assert parse_version(raw) is None


def test_cann_ordering_matches_reality() -> None:
    """Release candidates come before the release, alpha builds before their RC."""
    chain = ["7.0.0", "8.0.RC2.alpha003", "8.0.RC2", "8.0.RC3", "8.0.0", "8.1.RC1", "8.1.0"]
    parsed = [parse_version(v) for v in chain]
    assert all(p is not None for p in parsed)
    assert parsed == sorted(parsed)  # type: ignore[type-var]
    assert parse_version("2.7.1") < parse_version("2.13.0") < parse_version("2.14.0")  # type: ignore[operator]
    assert parse_version("2.13.0+cpu") == Version("2.13.0")  # local part dropped


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        ("8.0.RC3", "<8.0.0", True),   # PEP 440's SpecifierSet says False here
        ("8.0.RC3", ">=8.0.0", False),
        ("8.0.0", ">=8.0.0", True),
        ("8.1.RC1", ">=8.0.0", True),
        ("8.0.RC2.alpha003", "<8.0.RC2", True),
        ("8.0.RC3", ">=8.0.RC3", True),
        ("2.13.0+cpu", ">=2.13", True),
        ("2.7.1", ">=2.13", False),
        ("2.7.1", "<2.13", True),
        ("2.13.1", "==2.13.*", True),
        ("2.14.0", "==2.13.*", False),
        ("2.14.0", "!=2.13.*", True),
        ("2.13.4", "~=2.13.0", True),
        ("2.14.0", "~=2.13.0", False),
        ("2.13.0", ">=2.7.1,<2.14", True),
    ],
)
def test_satisfies(version: str, spec: str, expected: bool) -> None:
    assert satisfies(version, spec) is expected


def test_satisfies_rejects_unreadable_version() -> None:
    with pytest.raises(ValueError, match="cannot read version"):
        satisfies("garbage", ">=1")


# --------------------------------------------------------------------------- applies / explain
WIDE = When(torch_npu=">=2.13", cann=">=8.0.0")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (Env(torch_npu="2.13.0", cann="8.0.0"), True),
        (Env(torch_npu="2.14.0", cann="8.1.RC1"), True),
        (Env(torch_npu="2.13.0", cann="8.0.RC3"), False),
        (Env(torch_npu="2.7.1", cann="8.0.0"), False),
        (Env(torch_npu="2.13.0"), None),
        (Env(), None),
        (Env(torch_npu="2.7.1"), False),  # a failed condition beats an unknown one
        (Env(torch_npu="not-a-version", cann="8.0.0"), None),
    ],
)
def test_applies(env: Env, expected: bool | None) -> None:
    assert applies(WIDE, env) is expected


def test_applies_without_when() -> None:
    assert applies(None, Env()) is True
    assert explain(None, Env()) == "no version conditions"


@pytest.mark.parametrize(
    ("soc", "expected"),
    [
        ("Ascend910B3", True),    # prefix
        ("ascend910b1", True),    # case-insensitive
        ("Ascend910_9391", True),
        ("Ascend910B", True),     # exact
        ("Ascend950", False),
        ("Ascend310P3", False),
        (None, None),
    ],
)
def test_soc_matches_by_prefix_case_insensitively(soc: str | None, expected: bool | None) -> None:
    when = When(soc=["Ascend910B", "Ascend910_93"])
    assert applies(when, Env(soc=soc)) is expected


def test_explain_names_the_deciding_conditions() -> None:
    assert explain(WIDE, Env(torch_npu="2.13.0", cann="8.0.RC3")) == \
        "needs cann >=8.0.0, found 8.0.RC3 (= 8.0rc3)"
    text = explain(WIDE, Env(torch_npu="2.13.0"))
    assert "cann unknown" in text and "OPCONTRACTS_CANN_VERSION" in text
    assert "torch_npu" not in text  # only the undecided condition is named
    met = explain(WIDE, Env(torch_npu="2.13.0", cann="8.0.0"))
    assert "torch_npu 2.13.0 meets >=2.13" in met and "cann 8.0.0 meets >=8.0.0" in met
    assert "needs soc Ascend950" in explain(When(soc="Ascend950"), Env(soc="Ascend910B3"))
    assert "OPCONTRACTS_SOC" in explain(When(soc="Ascend950"), Env())


# --------------------------------------------------------------------------- detection
def test_nothing_known_without_sources() -> None:
    env = versions.current()
    assert (env.torch_npu, env.cann, env.mindspeed, env.soc) == (None, None, None, None)
    assert env.torch is not None  # torch itself is always importable here
    assert env.origin("cann") == "unknown"


def test_detection_never_imports_torch_npu() -> None:
    if "torch_npu" in sys.modules:  # pragma: no cover - an emulation left installed
        pytest.skip("torch_npu already imported")
    versions.refresh()
    assert "torch_npu" not in sys.modules


def test_current_is_cached() -> None:
    assert versions.current() is versions.current()


def test_env_var_overrides() -> None:
    os.environ["OPCONTRACTS_TORCH_NPU_VERSION"] = "2.7.1"
    os.environ["OPCONTRACTS_CANN_VERSION"] = "8.0.RC3"
    os.environ["OPCONTRACTS_MINDSPEED_VERSION"] = "2.1.0"
    os.environ["OPCONTRACTS_SOC"] = "Ascend910B3"
    env = versions.refresh()
    assert (env.torch_npu, env.cann, env.mindspeed, env.soc) == \
        ("2.7.1", "8.0.RC3", "2.1.0", "Ascend910B3")
    assert env.origin("cann") == "$OPCONTRACTS_CANN_VERSION"
    d = versions.describe(env)
    assert d["cann"].startswith("8.0.RC3 (= 8.0rc3)") and "$OPCONTRACTS_CANN_VERSION" in d["cann"]


def test_env_var_unknown_forces_unknown(isolated_versions: Path) -> None:
    _write_toolkit(isolated_versions / "tk", "8.0.0")
    os.environ["ASCEND_TOOLKIT_HOME"] = str(isolated_versions / "tk")
    assert versions.refresh().cann == "8.0.0"
    os.environ["OPCONTRACTS_CANN_VERSION"] = "unknown"
    assert versions.refresh().cann is None


def _write_toolkit(root: Path, version: str, *, info: bool = True, cfg: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if info:
        d = root / "aarch64-linux"
        d.mkdir(exist_ok=True)
        (d / "ascend_toolkit_install.info").write_text(
            f"package_name=Ascend-cann-toolkit\nversion={version}\ninnerversion=V100R001C19\n")
    if cfg is not None:
        (root / "version.cfg").write_text(cfg)
    return root


def test_cann_from_toolkit_install_info(isolated_versions: Path) -> None:
    root = _write_toolkit(isolated_versions / "ascend-toolkit" / "latest", "8.0.RC3")
    os.environ["ASCEND_TOOLKIT_HOME"] = str(root)
    env = versions.refresh()
    assert env.cann == "8.0.RC3"
    assert "ascend_toolkit_install.info" in env.origin("cann")
    assert "$ASCEND_TOOLKIT_HOME" in env.origin("cann")


def test_cann_from_version_cfg(isolated_versions: Path) -> None:
    cfg = ("# version: 1.0\nruntime_running_version=[7.6.0.1.220:8.0.0]\n"
           "toolkit_running_version=[7.6.0.1.220:8.0.0]\n")
    root = _write_toolkit(isolated_versions / "home", "", info=False, cfg=cfg)
    os.environ["ASCEND_HOME_PATH"] = str(root)
    env = versions.refresh()
    assert env.cann == "8.0.0"
    assert env.origin("cann").startswith(str(root / "version.cfg"))


def test_cann_toolkit_home_wins_and_default_root_is_searched(isolated_versions: Path) -> None:
    default = _write_toolkit(isolated_versions / "default", "8.1.RC1")
    versions.CANN_DEFAULT_ROOTS[:] = [str(default)]
    assert versions.refresh().cann == "8.1.RC1"
    os.environ["ASCEND_HOME_PATH"] = str(_write_toolkit(isolated_versions / "home", "8.0.RC2"))
    os.environ["ASCEND_TOOLKIT_HOME"] = str(_write_toolkit(isolated_versions / "tk", "8.0.RC3"))
    assert versions.refresh().cann == "8.0.RC3"
    os.environ["OPCONTRACTS_CANN_VERSION"] = "8.0.0"
    assert versions.refresh().cann == "8.0.0"  # the explicit override beats every file


def test_torch_npu_from_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    real = versions.metadata.version

    def fake(name: str) -> str:
        if name == "torch-npu":
            return "2.7.1"
        if name == "mindspeed":
            return "0.12.1"
        return real(name)

    monkeypatch.setattr(versions.metadata, "version", fake)
    env = versions.refresh()
    assert env.torch_npu == "2.7.1" and env.origin("torch_npu") == "package metadata (torch-npu)"
    assert env.mindspeed == "0.12.1"
    assert env.emulated == ()
    monkeypatch.undo()
    versions.refresh()


def test_stand_in_module_is_noticed_without_refresh() -> None:
    """A torch_npu module appearing in sys.modules (emulation.install) is picked up by the
    next ``current()``, and marked as an emulation."""
    if "torch_npu" in sys.modules:  # pragma: no cover
        pytest.skip("torch_npu already imported")
    assert versions.current().torch_npu is None
    mod = types.ModuleType("torch_npu")
    mod.__version__ = "2.13.0"  # type: ignore[attr-defined]
    mod.__opcontracts_emulation__ = True  # type: ignore[attr-defined]
    sys.modules["torch_npu"] = mod
    try:
        env = versions.current()
        assert env.torch_npu == "2.13.0"
        assert env.emulated == ("torch_npu",)
        assert "emulation" in env.origin("torch_npu")
    finally:
        del sys.modules["torch_npu"]
    assert versions.current().torch_npu is None


# --------------------------------------------------------------------------- set_versions
def test_set_versions_pins_and_returns_previous() -> None:
    os.environ["OPCONTRACTS_CANN_VERSION"] = "8.0.0"
    versions.refresh()
    prev = opcontracts.set_versions(cann="8.0.RC3", soc="Ascend910B1")
    assert prev == {"torch_npu": None, "cann": None, "mindspeed": None, "soc": None}
    env = versions.current()
    assert (env.cann, env.soc) == ("8.0.RC3", "Ascend910B1")
    assert env.origin("cann") == "set_versions()"
    again = opcontracts.set_versions(cann="8.1.RC1")
    assert again["cann"] == "8.0.RC3" and again["soc"] == "Ascend910B1"
    opcontracts.set_versions(**prev)
    assert versions.current().cann == "8.0.0"  # back to the env var
    assert versions.current().soc is None


def test_set_versions_unknown_and_validation() -> None:
    os.environ["OPCONTRACTS_TORCH_NPU_VERSION"] = "2.13.0"
    opcontracts.set_versions(torch_npu="unknown")
    assert versions.current().torch_npu is None
    with pytest.raises(ValueError, match="not a version"):
        opcontracts.set_versions(cann="eight")
    with pytest.raises(TypeError):
        opcontracts.set_versions(cann=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # nothing is changed when one value is bad
        opcontracts.set_versions(soc="Ascend910B1", cann="")
    assert versions.current().soc is None
    assert "set_versions" in opcontracts.__all__


def test_set_versions_without_arguments_rereads_the_environment() -> None:
    assert versions.current().cann is None
    os.environ["OPCONTRACTS_CANN_VERSION"] = "8.0.RC3"
    assert versions.current().cann is None  # cached
    opcontracts.set_versions()
    assert versions.current().cann == "8.0.RC3"


# --------------------------------------------------------------------------- versions(...)
def test_versions_block_pins_and_puts_back_every_pin() -> None:
    os.environ["OPCONTRACTS_CANN_VERSION"] = "8.0.0"
    versions.refresh()
    opcontracts.set_versions(soc="Ascend910B1")
    with opcontracts.versions(cann="8.0.RC3", soc=None, torch_npu="2.7.1") as v:
        env = versions.current()
        assert (env.cann, env.soc, env.torch_npu) == ("8.0.RC3", None, "2.7.1")
        assert env.origin("cann") == "set_versions()"
        assert repr(v) == "opcontracts.versions(torch_npu='2.7.1', cann='8.0.RC3', soc=None)"
    env = versions.current()
    assert (env.cann, env.soc, env.torch_npu) == ("8.0.0", "Ascend910B1", None)  # env var, pin
    with pytest.raises(KeyError), opcontracts.versions(cann="9.1.0"):
        raise KeyError("inside")
    assert versions.current().cann == "8.0.0"  # also after an exception
    assert "versions" in opcontracts.__all__


def test_versions_nest_and_a_decorated_function_reenters() -> None:
    seen: list[tuple[str | None, str | None]] = []

    @opcontracts.versions(cann="8.0.RC3")
    def step(depth: int) -> None:
        seen.append((versions.current().cann, versions.current().soc))
        if depth:
            with opcontracts.versions(soc="Ascend950PR"):
                step(depth - 1)  # the same decorator entered again, inside a block of its own
            seen.append((versions.current().cann, versions.current().soc))

    with opcontracts.versions(cann="9.1.0"):
        step(1)
        assert versions.current().cann == "9.1.0"
    assert seen == [("8.0.RC3", None), ("8.0.RC3", "Ascend950PR"), ("8.0.RC3", None)]
    assert (versions.current().cann, versions.current().soc) == (None, None)


def test_versions_validates_where_it_is_written() -> None:
    with pytest.raises(ValueError, match=r"opcontracts.versions\(cann='eight'\): not a version"):
        opcontracts.versions(cann="eight")
    with pytest.raises(TypeError, match="opcontracts.versions"):
        opcontracts.versions(torch_npu=2.7)  # type: ignore[arg-type]
    assert versions.current().cann is None


# --------------------------------------------------------------------------- the registry
@pytest.fixture
def two_versions() -> Iterator[str]:
    """An op with a bf16-only contract for old CANN and a wider one for new CANN."""
    op = "test_versions.fake_unpermute"
    wide = Contract(op, {"t": Arg(["bf16", "fp16", "fp32"], "N H"),
                         "p": Arg(["bf16", "fp32"], optional=True)},
                    when=When(cann=">=8.0.0"), source="new doc")
    narrow = Contract(op, {"t": Arg("bf16", "N H"), "p": Arg("bf16", optional=True)},
                      when=When(cann="<8.0.0"), source="old doc")
    registry.register([wide, narrow])
    try:
        yield op
    finally:
        registry.unregister(op)


def test_a_versions_block_decides_with_its_versions(two_versions: str) -> None:
    with opcontracts.versions(cann="8.0.0"):
        c = registry.resolve(two_versions)
        assert c is not None and c.source == "new doc"
    c = registry.resolve(two_versions)  # unknown again after the block: merged
    assert c is not None and c.source == "new doc; old doc"


def test_unknown_version_merges_into_the_strictest(two_versions: str) -> None:
    c = registry.resolve(two_versions)
    assert c is not None
    assert c.args["t"].dtype == ("bfloat16",) and c.args["p"].dtype == ("bfloat16",)
    assert c.source == "new doc; old doc"


def test_set_versions_invalidates_resolutions(two_versions: str) -> None:
    opcontracts.set_versions(cann="8.0.0")
    c = registry.resolve(two_versions)
    assert c is not None and c.args["t"].dtype == ("bfloat16", "float16", "float32")
    opcontracts.set_versions(cann="8.0.RC3")  # no manual invalidate needed
    c = registry.resolve(two_versions)
    assert c is not None and c.args["t"].dtype == ("bfloat16",) and c.source == "old doc"
    opcontracts.set_versions(cann="unknown")
    c = registry.resolve(two_versions)
    assert c is not None and c.source == "new doc; old doc"


@pytest.fixture
def shipped() -> Iterator[None]:
    """The shipped packs registered for the test; the registry put back afterwards."""
    before, loaded = registry.all_contracts(), registry._shipped_loaded
    registry.register(load_contracts(registry.shipped_contracts_dir()), replace=True)
    try:
        yield
    finally:
        registry.clear()
        registry.register(before, replace=True)
        registry._shipped_loaded = loaded


def test_shipped_unpermute_depends_on_versions(shipped: None) -> None:
    """The incident's op: op-plugin hands it straight to aclnnMoeTokenUnpermute, so CANN
    decides (issue 23): bf16 only unless CANN >= 8.0.0 is known, whatever docstring the
    torch_npu release bundles; torch_npu only says whether the op exists (2.5.1.post1 on)."""
    op = "npu_moe_token_unpermute"
    wide = ("bfloat16", "float16", "float32")
    cases = [
        ({}, ("bfloat16",)),
        ({"torch_npu": "2.13.0"}, ("bfloat16",)),
        ({"torch_npu": "2.13.0", "cann": "8.0.0"}, wide),
        ({"torch_npu": "2.13.0", "cann": "8.0.RC3"}, ("bfloat16",)),
        # releases whose bundled doc is the old bf16 text: the kernel of CANN >= 8.0.0 decides
        ({"torch_npu": "2.7.1", "cann": "8.0.0"}, wide),
        ({"torch_npu": "2.7.1.post10", "cann": "8.0.0"}, wide),
        ({"torch_npu": "2.9.1", "cann": "9.0.0"}, wide),
        ({"torch_npu": "2.10.0.post4", "cann": "9.1.0"}, wide),
        ({"torch_npu": "2.12.0", "cann": "8.0.0"}, wide),
        ({"torch_npu": "2.12.0.post3", "cann": "8.0.RC3"}, ("bfloat16",)),
    ]
    for pins, probs in cases:
        opcontracts.set_versions(**{"torch_npu": None, "cann": None, **pins})
        c = registry.get_contract(op)
        assert c.args["probs"].dtype == probs, pins
    # before torch_npu 2.5.1.post1 the op does not exist: no table applies
    opcontracts.set_versions(torch_npu="2.5.1", cann="8.0.0")
    assert registry.resolve(op) is None
    # the chip-specific K <= 512 table joins when the SoC is an A2/A3 or unknown, not otherwise
    opcontracts.set_versions(torch_npu="2.13.0", cann="8.0.0", soc="Ascend910B3")
    assert registry.get_contract(op).args["probs"].dims is not None
    opcontracts.set_versions(soc="Ascend950")
    assert registry.get_contract(op).args["probs"].dims is None


def test_versions_module_does_not_import_the_registry() -> None:
    """Dependencies point one way (registry -> versions): no module-level import back."""
    tree = ast.parse(Path(versions.__file__).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any("_registry" in n for n in names), ast.dump(node)
