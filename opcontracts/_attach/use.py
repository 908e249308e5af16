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

from .._engine import registry
from .._lang.envwarn import warn_setting
from ..errors import OpContractsError

if TYPE_CHECKING:
    from ..spec import Contract

__all__ = ["use", "env_contracts", "register_each"]


def use(*paths: str | os.PathLike[str], replace: bool = False) -> list[Contract]:
    """Load the contracts of each file or folder (every ``*.toml`` under it) and register them.

    Raises ``ContractFileError`` listing every problem of every file before registering any
    (nothing is half-loaded).  ``replace=True`` replaces registered contracts for the same op
    and ``when`` (as ``register(..., replace=True)``); otherwise a different contract for the
    same op and ``when`` is an error.  Returns the contracts loaded.
    """
    from ..errors import ContractFileError, FileProblem
    from ..spec import load_contracts

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
    registry.register(contracts, replace=replace)
    patch = sys.modules.get("opcontracts.patch")
    if patch is not None and patch.is_applied() and any(c.targets for c in contracts):
        patch.apply()
    return contracts


def register_each(contracts: list[Contract], where: str) -> None:
    """Register the contracts of a user's setting one by one: one that cannot be registered
    (its dtypes share nothing with a shipped contract's) is skipped with a warning naming
    ``where`` and its file, and the others still load (a user's file never kills the job)."""
    for c in contracts:
        try:
            registry.register(c, replace=True)
        except OpContractsError as exc:
            warn_setting(where, f"{exc}; skipped")


def env_contracts() -> list[Contract]:
    """The contracts of the files and folders named in ``OPCONTRACTS_CONTRACTS`` (loaded, not
    registered; ``import opcontracts.patch``, ``opcontracts run`` and ``opcontracts list`` read
    them through here, and this module applies no patch, so ``list`` has no side effect).

    A user's file never kills the job: a path that does not exist, or a file with any
    problem, is skipped with one ``RuntimeWarning`` that names the file, the contract and the
    field of every problem, shown once, at the user's start-up line.  A folder's good files
    still load when one of them is bad.
    """
    raw = os.environ.get("OPCONTRACTS_CONTRACTS", "")
    out: list[Contract] = []
    parts = [p.strip() for p in raw.split(os.pathsep) if p.strip()]
    if not parts:
        return out
    from ..spec import contract_files, load_contracts

    for part in parts:
        try:
            files = contract_files(part)
        except OpContractsError as exc:
            warn_setting("OPCONTRACTS_CONTRACTS", f"{exc}; skipped")
            continue
        for f in files:
            try:
                out.extend(load_contracts(f))
            except OpContractsError as exc:  # the message names the file and field
                warn_setting("OPCONTRACTS_CONTRACTS", f"{exc}; skipped")
            except Exception as exc:  # noqa: BLE001 - not ours to crash on: skip, and say so
                warn_setting("OPCONTRACTS_CONTRACTS", f"{f}: could not be loaded "
                             f"({type(exc).__name__}: {exc}); skipped")
    return out
