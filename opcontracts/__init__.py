"""opcontracts: declarative dtype/shape contracts for custom accelerator operators.

Public API; everything not listed in ``__all__`` is private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._modes import get_mode, mode, set_mode
from ._registry import UnknownOpError, get_contract, register
from ._report import Report, report, reset_report
from ._values import set_value_checks, value_checks_enabled
from ._versions import set_versions
from .decorator import check, enforce
from .errors import (
    ContractFileError,
    ContractFixWarning,
    ContractViolation,
    ContractWarning,
    OpContractsError,
)

if TYPE_CHECKING:
    from .spec import Arg, Contract, ValueRule, When, load_contracts

_LAZY = {"Arg", "Contract", "ValueRule", "When", "load_contracts"}


def __getattr__(name: str) -> Any:
    # The contract model is pydantic; importing it costs ~100 ms, which `import opcontracts.patch`
    # at the top of a training script should not pay before a contract is actually needed.
    if name in _LAZY:
        from . import spec

        value = getattr(spec, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'opcontracts' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "Arg",
    "Contract",
    "ContractFileError",
    "ContractFixWarning",
    "ContractViolation",
    "ContractWarning",
    "OpContractsError",
    "Report",
    "UnknownOpError",
    "ValueRule",
    "When",
    "__version__",
    "check",
    "enforce",
    "get_contract",
    "get_mode",
    "load_contracts",
    "mode",
    "register",
    "report",
    "reset_report",
    "set_mode",
    "set_value_checks",
    "set_versions",
    "value_checks_enabled",
]
