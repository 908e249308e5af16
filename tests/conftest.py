from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

import opcontracts
from opcontracts import _enforce, _modes


@pytest.fixture(autouse=True)
def _clean_opcontracts_state() -> Iterator[None]:
    """Every test starts in the default mode with an empty report and fresh warn-once memory."""
    prev = opcontracts.set_mode("warn")
    _modes.clear_overrides()
    opcontracts.reset_report()
    _enforce.reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield
    opcontracts.set_mode(prev)
    _modes.clear_overrides()
    opcontracts.reset_report()
    _enforce.reset_warnings()
