"""opcontracts: declarative dtype/shape contracts for custom accelerator operators.

Public API; everything not listed in ``__all__`` is private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._modes import get_mode, mode, set_mode
from ._report import Report, ReportFileError, report, reset_report
from .errors import (
    ContractFileError,
    ContractFixWarning,
    ContractViolation,
    ContractWarning,
    OpContractsError,
    SettingError,
)

if TYPE_CHECKING:
    from ._registry import UnknownOpError, get_contract, register
    from ._use import use
    from ._values import set_value_checks, value_checks_enabled
    from ._versions import set_versions
    from .decorator import check, enforce
    from .spec import Arg, Contract, ValueRule, When, load_contracts

# Names whose modules import torch or pydantic are loaded on first access (PEP 562): the pytest
# plugin imports this package in every pytest session, and `import opcontracts.patch` sits at
# the top of training scripts; neither should pay for what it does not use.
_LAZY = {
    "UnknownOpError": "_registry", "get_contract": "_registry", "register": "_registry",
    "set_value_checks": "_values", "value_checks_enabled": "_values",
    "set_versions": "_versions",
    "check": "decorator", "enforce": "decorator",
    "Arg": "spec", "Contract": "spec", "ValueRule": "spec", "When": "spec",
    "load_contracts": "spec", "use": "_use",
}


# Submodules reachable as attributes after a bare ``import opcontracts``
# (``opcontracts.reference.register(...)``), imported on first access.  ``patch`` is not one:
# importing it applies the patch, which must stay an explicit ``import opcontracts.patch``.
_SUBMODULES = frozenset({"reference", "compare", "probe", "record", "nan", "emulation",
                         "dispatch", "wheel"})


def __getattr__(name: str) -> Any:
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # sets the attribute itself
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'opcontracts' has no attribute {name!r}")

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


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
    "ReportFileError",
    "SettingError",
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
    "use",
    "value_checks_enabled",
]
