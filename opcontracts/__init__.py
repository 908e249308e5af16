"""opcontracts: declarative dtype/shape contracts for custom accelerator operators.

Public API; everything not listed in ``__all__`` is private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._engine import records as _records
from ._engine.records import Report, ReportFileError, reset_report
from ._lang.modes import get_mode, mode, set_mode
from ._version import __version__
from .errors import (
    ContractConditionalWarning,
    ContractFileError,
    ContractFixWarning,
    ContractViolation,
    ContractWarning,
    OpContractsError,
    SettingError,
)

if TYPE_CHECKING:
    from ._attach.use import use
    from ._engine.registry import UnknownOpError, get_contract, register
    from ._lang.targets import set_targets
    from ._lang.values import set_value_checks, value_checks_enabled
    from ._lang.versions import set_versions, versions
    from ._tools.preflight import preflight
    from ._tools.trainer import NanStepCallback
    from .decorator import check, enforce
    from .nan import nan_step
    from .spec import Arg, Contract, ValueRule, When, load_contracts

# Names whose modules import torch or pydantic are loaded on first access (PEP 562): the pytest
# plugin imports this package in every pytest session, and `import opcontracts.patch` sits at
# the top of training scripts; neither should pay for what it does not use.
_LAZY = {
    "UnknownOpError": "_engine.registry", "get_contract": "_engine.registry", "register": "_engine.registry",
    "set_value_checks": "_lang.values", "value_checks_enabled": "_lang.values",
    "set_versions": "_lang.versions", "versions": "_lang.versions",
    "set_targets": "_lang.targets",
    "check": "decorator", "enforce": "decorator",
    "Arg": "spec", "Contract": "spec", "ValueRule": "spec", "When": "spec",
    "load_contracts": "spec", "use": "_attach.use", "preflight": "_tools.preflight",
    "nan_step": "nan", "NanStepCallback": "_tools.trainer",
}


# Submodules reachable as attributes after a bare ``import opcontracts``
# (``opcontracts.reference.register(...)``), imported on first access.  ``patch`` is not one:
# importing it applies the patch, which must stay an explicit ``import opcontracts.patch``.
_SUBMODULES = frozenset({"reference", "compare", "probe", "record", "nan", "emulation",
                         "dispatch", "wheel"})


def report(*, gather: bool = False) -> Report:
    """A snapshot of every violation recorded in this process.

    ``gather=True`` in a ``torch.distributed`` job is a collective (every rank must call it): rank
    0 gets every rank's violations merged, each record naming the ``ranks`` that saw it; the other
    ranks get their own.  Outside a distributed job it is the same as ``report()``.
    """
    rep = _records.report()
    if gather:  # the gather lives above the records (``_ranks``): torch.distributed only when asked
        from ._ranks.gather import gather_report

        return gather_report(rep)
    return rep


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



__all__ = [
    "Arg",
    "Contract",
    "ContractConditionalWarning",
    "ContractFileError",
    "ContractFixWarning",
    "ContractViolation",
    "ContractWarning",
    "NanStepCallback",
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
    "nan_step",
    "preflight",
    "register",
    "report",
    "reset_report",
    "set_mode",
    "set_targets",
    "set_value_checks",
    "set_versions",
    "use",
    "value_checks_enabled",
    "versions",
]
