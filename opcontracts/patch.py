"""``import opcontracts.patch``: guard every target of every applicable contract.

Importing this module (once, at the top of a training script) loads the shipped contracts and
the user's files named in ``OPCONTRACTS_CONTRACTS`` (a ``os.pathsep``-separated list of files or
folders), then wraps each target: ``torch_npu.npu_*``, ``torch.ops.npu.*``, MindSpeed's
``mindspeed.ops.*`` functions, class attributes and ``autograd.Function.apply``.  Modules
imported later are patched as they are imported; names bound earlier by ``from x import f``
are rebound.  Nothing raises at import time: a target that cannot be found is logged (debug
level) and listed by ``missing()``, so a training job never dies because an optional module
moved; a bad file in ``OPCONTRACTS_CONTRACTS`` is skipped with a warning.  The one exception
is ``OPCONTRACTS_MODE`` holding something that is not a mode: the import raises
``SettingError`` naming it, since running with a weaker mode than asked would be silent.

``apply()`` is idempotent; ``unpatch()`` restores every original (``is``-identical) and removes
the import hook; ``patched()`` lists what is wrapped and where.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._attach.patcher import Patcher, PatchRecord
from ._attach.use import env_contracts
from ._engine import registry
from ._lang import modes, targets
from ._lang.envwarn import warn_setting
from .errors import OpContractsError

if TYPE_CHECKING:
    from .spec import Contract

__all__ = ["apply", "unpatch", "patched", "missing", "is_applied", "PatchRecord"]

_patcher = Patcher()


def _user_contracts() -> list[Contract]:
    """The contracts of ``OPCONTRACTS_CONTRACTS`` (``_attach.use.env_contracts``: bad files are
    warned about and skipped)."""
    return env_contracts()


def apply(contracts: Iterable[Contract] | None = None) -> list[PatchRecord]:
    """Wrap every target of the applicable contracts (shipped + ``OPCONTRACTS_CONTRACTS`` +
    ``contracts``).  Safe to call again: it wraps nothing twice and picks up targets that have
    appeared since (ops registered later, modules imported later).

    Shipped contracts are read from their files' ``op``/``targets``/``when`` only; each is
    validated and compiled on the first call of one of its targets, so the import stays cheap.
    """
    extra = list(contracts or ()) + _user_contracts()
    if extra:
        registry.register(extra, replace=True)
    try:
        targets = registry.applicable_targets()
    except OpContractsError as exc:  # pragma: no cover - a broken install
        warnings.warn(f"opcontracts: shipped contracts: {exc}", RuntimeWarning, stacklevel=2)
        targets = {}
    # contracts registered in code or by earlier apply() calls (validated already)
    for op in sorted({c.op for c in registry.all_contracts()}):
        try:
            res = registry.resolve(op)
        except OpContractsError as exc:  # contracts that cannot be merged: the job goes on
            warn_setting("opcontracts.patch", f"the contracts of {op} cannot be used "
                         f"together, so its targets are not guarded: {exc}")
            continue
        if res is not None and res.targets:
            targets[op] = tuple(dict.fromkeys(targets.get(op, ()) + res.targets))
    _patcher.apply(sorted(targets.items()))
    return patched()


def unpatch() -> None:
    """Restore every original object and remove the import hook."""
    _patcher.unpatch()


def patched() -> list[PatchRecord]:
    """What is wrapped: one record per target (and per rebound alias)."""
    return _patcher.patched_list()


def missing() -> dict[str, str]:
    """Targets that could not be found, with the reason (modules not imported yet are not
    listed: they are patched when imported)."""
    with _patcher.lock:
        return dict(_patcher.missing)


def pending() -> list[str]:
    """Targets waiting for their module to be imported."""
    with _patcher.lock:
        return sorted(_patcher.pending)


def is_applied() -> bool:
    return _patcher.active


modes.check_setting()  # OPCONTRACTS_MODE=stirct stops the job here, naming the variable
targets.check()  # so does OPCONTRACTS_TARGETS=cann=8.x (or a bad [tool.opcontracts] table)
apply()
