from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import opcontracts
from opcontracts import emulation
from opcontracts._engine import violations
from opcontracts._lang import modes, targets

# The emulated npu device needs its PrivateUse1 name and guard before the process's first
# backward (torch's autograd engine sizes its device queues once); tests install it later.
emulation.reserve_device()


@pytest.fixture(autouse=True)
def _clean_opcontracts_state() -> Iterator[None]:
    """Every test starts in the default mode with an empty report and fresh warn-once memory.

    opcontracts' own warnings (``ContractWarning``, ``ContractFixWarning``) are what warn and fix
    mode produce: a test that means to see one asserts it (``pytest.warns``, or
    ``catch_warnings`` with its own filter, which overrides this one); one that does not is about
    something else, and its warning is not a finding for the suite's summary.  The sources were
    tests of mode routing (test_modes: ``test_off_never_calls_the_checker``,
    ``test_per_op_override``) and of fix mode refusing a shape violation after planning a cast
    for another argument (test_fix: ``test_shape_violations_are_not_fixed``,
    ``test_learnt_repair_is_not_taken_for_other_metadata``).  Every other warning still shows.
    """
    prev = opcontracts.set_mode("warn")
    modes.clear_overrides()
    opcontracts.reset_report()
    violations.reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", category=opcontracts.ContractWarning)
        yield
    opcontracts.set_mode(prev)
    modes.clear_overrides()
    opcontracts.reset_report()
    violations.reset_warnings()
    if targets._in_code is not None:  # targets a test declared do not outlive it
        opcontracts.set_targets()


@pytest.fixture(autouse=True)
def _registry_restored() -> Iterator[None]:
    """Contracts a test registers do not outlive it (``opcontracts list`` counts them all)."""
    from opcontracts._engine import registry

    with registry._lock:
        before = {op: list(cs) for op, cs in registry._by_op.items()}
        loaded = registry._shipped_loaded
    yield
    with registry._lock:
        now = {op: list(cs) for op, cs in registry._by_op.items()}
        if {op: [id(c) for c in cs] for op, cs in now.items()} != \
                {op: [id(c) for c in cs] for op, cs in before.items()} \
                or registry._shipped_loaded != loaded:
            registry._by_op.clear()
            registry._by_op.update(before)
            registry._shipped_loaded = loaded
            registry.invalidate()  # guards made during the test decide anew


@pytest.fixture
def npu() -> Iterator[Any]:
    """The NPU ops on the CPU: the emulation (narrow profile, torch_npu 2.13.0) and
    ``opcontracts.patch``, both put back afterwards, with value checks off and version pins
    dropped again; the stand-in ``torch_npu`` module."""
    import opcontracts.patch as patch
    from opcontracts import emulation

    was = patch.is_applied()
    patch.unpatch()
    emulation.install()
    patch.apply()
    opcontracts.reset_report()
    import torch_npu

    try:
        yield torch_npu
    finally:
        patch.unpatch()
        emulation.uninstall()
        opcontracts.set_value_checks(False)
        opcontracts.set_versions(torch_npu=None, cann=None, mindspeed=None, soc=None)
        if was:
            patch.apply()


@pytest.fixture
def npu_device() -> Iterator[Any]:
    """The emulation with its npu device (narrow profile, no patch), put back afterwards with
    a CANN pin dropped again; the stand-in ``torch_npu`` module."""
    from opcontracts import emulation

    emulation.install("narrow", device=True)
    import torch_npu

    try:
        yield torch_npu
    finally:
        emulation.uninstall()
        opcontracts.set_versions(cann=None)


@pytest.fixture
def emulated() -> Iterator[Callable[..., None]]:
    """``emulated(*args, **kwargs)``: ``emulation.install(*args, **kwargs)`` with the patch
    applied; after the test the emulation is uninstalled and the patch left as it was (for a
    fixture parametrized by release, MindSpeed line or SoC)."""
    import opcontracts.patch as patch

    was = patch.is_applied()
    installed = False

    def install(*args: Any, **kwargs: Any) -> None:
        nonlocal installed
        emulation.install(*args, **kwargs)
        installed = True
        patch.apply()

    try:
        yield install
    finally:
        if installed:
            emulation.uninstall()
        if not was:
            patch.unpatch()


@contextlib.contextmanager
def _atb_plugin_loaded(monkeypatch: pytest.MonkeyPatch, schema: str, kernel: Callable[..., Any]
                       ) -> Iterator[list[Any]]:
    """``torch.ops.load_library`` stood in for by what loading torch_npu's ATB plugin
    (libop_plugin_atb.so) does: define the op of ``schema`` in the ``atb`` namespace with
    ``kernel``; the patch is off inside (the test applies it) and restored after."""
    import torch

    from opcontracts import patch

    libs: list[Any] = []

    def load_library(path: str) -> None:
        lib = torch.library.Library("atb", "FRAGMENT")
        lib.define(schema)
        lib.impl(schema.split("(", 1)[0], kernel, "CompositeExplicitAutograd")
        libs.append(lib)

    monkeypatch.setattr(torch.ops, "load_library", load_library, raising=False)
    was = patch.is_applied()
    patch.unpatch()
    try:
        yield libs
    finally:
        patch.unpatch()
        for lib in libs:
            lib._destroy()
        if was:
            patch.apply()


@pytest.fixture
def atb_plugin_loaded(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``atb_plugin_loaded(schema, kernel)``: a context manager in which
    ``torch.ops.load_library`` defines that ATB op (see ``_atb_plugin_loaded``)."""
    return lambda schema, kernel: _atb_plugin_loaded(monkeypatch, schema, kernel)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "hf: runs transformers / accelerate (opt-in: OPCONTRACTS_HF_TESTS=1)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``hf`` are skipped unless OPCONTRACTS_HF_TESTS=1 in an environment with
    transformers and accelerate (neither is a dependency); the reason says how to run them."""
    if (os.environ.get("OPCONTRACTS_HF_TESTS") == "1"
            and importlib.util.find_spec("transformers") is not None
            and importlib.util.find_spec("accelerate") is not None):
        return
    for item in items:
        if item.get_closest_marker("hf") is not None:
            where = os.path.relpath(item.path, config.rootpath)
            item.add_marker(pytest.mark.skip(
                reason="opt-in: set OPCONTRACTS_HF_TESTS=1 in an environment with transformers "
                       f"and accelerate (OPCONTRACTS_HF_TESTS=1 python -m pytest -q {where})"))
