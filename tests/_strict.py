"""The violation strict mode raises for a call, shared by the contract tests."""

from __future__ import annotations

from typing import Any

import pytest

import opcontracts
from opcontracts import ContractViolation


def violation(target: Any, /, *args: Any, **kwargs: Any) -> ContractViolation:
    """What strict mode raises for ``target`` on these arguments: an op name (or a
    ``Contract``) is checked with ``opcontracts.check``, a callable (a guarded function) is
    called.  Fails the test when nothing is raised.  (``target`` is positional-only: ops
    have arguments of any name, ``target`` among them.)"""
    with opcontracts.mode("strict"), pytest.raises(ContractViolation) as info:
        if callable(target):
            target(*args, **kwargs)
        else:
            opcontracts.check(target, *args, **kwargs)
    return info.value
