"""``opcontracts.use(path)``: load contract files into the registry in one call.

``load_contracts(path)`` only parses and validates; ``register(contracts)`` only registers
``Contract`` objects.  ``use`` does both, and when ``opcontracts.patch`` is already applied it
also wraps the new contracts' targets at once (the patch wraps nothing twice), so a contract
loaded after ``import opcontracts.patch`` guards its targets like one loaded before.  It sits
above the registry and the patch (it never applies a patch that is not applied already).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from . import _registry

if TYPE_CHECKING:
    from .spec import Contract

__all__ = ["use"]


def use(*paths: str | os.PathLike[str], replace: bool = False) -> list[Contract]:
    """Load the contracts of each file or folder (every ``*.toml`` under it) and register them.

    Raises ``ContractFileError`` listing every problem of every file before registering any
    (nothing is half-loaded).  ``replace=True`` replaces registered contracts for the same op
    and ``when`` (as ``register(..., replace=True)``); otherwise a different contract for the
    same op and ``when`` is an error.  Returns the contracts loaded.
    """
    from .errors import ContractFileError, FileProblem
    from .spec import load_contracts

    if not paths:
        raise TypeError("use() needs at least one file or folder")
    contracts: list[Contract] = []
    problems: list[FileProblem] = []
    for p in paths:
        try:
            contracts.extend(load_contracts(p))
        except ContractFileError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ContractFileError.of(problems)
    _registry.register(contracts, replace=replace)
    patch = sys.modules.get("opcontracts.patch")
    if patch is not None and patch.is_applied() and any(c.targets for c in contracts):
        patch.apply()
    return contracts
