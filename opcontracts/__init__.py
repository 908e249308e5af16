"""opcontracts: declarative dtype/shape contracts for custom accelerator operators.

Public API; everything not listed in ``__all__`` is private.
"""

from __future__ import annotations

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
from .spec import Arg, Contract, ValueRule, When, load_contracts

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
