"""Exceptions and warnings raised by opcontracts.

Kept free of torch imports so every other module (and users' ``-W`` filters) can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "OpContractsError",
    "ContractFileError",
    "ContractViolation",
    "ContractWarning",
    "ContractFixWarning",
    "format_violation",
]


class OpContractsError(Exception):
    """Base class of every error opcontracts raises on purpose."""


class ContractFileError(OpContractsError, ValueError):
    """A contract file or inline contract is malformed.

    ``file``, ``contract`` (the op name or ``#index``) and ``field`` (dotted path) say where.
    """

    def __init__(self, message: str, *, file: str | None = None, contract: str | None = None,
                 field: str | None = None) -> None:
        self.file = file
        self.contract = contract
        self.field = field
        self.reason = message
        where = []
        if file:
            where.append(str(file))
        if contract:
            where.append(f"contract {contract}")
        if field:
            where.append(f"field {field}")
        prefix = ": ".join([", ".join(where)]) if where else "contract"
        super().__init__(f"{prefix}: {message}")


def format_violation(
    *, op: str, arg: str | None, rule: str, expected: str, actual: str,
    bindings: Mapping[str, int], call_site: str | None, source: str | None, fix: str | None,
    mode: str | None = None, rank: int | None = None,
) -> str:
    head = f"{op}: argument '{arg}' {actual}, expected {expected}" if arg else \
        f"{op}: {actual}, expected {expected}"
    if rank is not None:
        head = f"[rank {rank}] {head}"
    got = actual
    for verb in ("has ", "is "):  # "argument 'p' has dtype float32" reads "got: dtype float32"
        if got.startswith(verb):
            got = got[len(verb):]
            break
    lines = [head, f"  rule:      {rule}", f"  expected:  {expected}", f"  got:       {got}"]
    if bindings:
        lines.append("  bindings:  " + ", ".join(f"{k}={v}" for k, v in bindings.items()))
    if call_site:
        lines.append(f"  call site: {call_site}")
    if source:
        lines.append(f"  source:    {source}")
    if fix:
        lines.append(f"  fix:       {fix}")
    if mode:
        lines.append(f"  mode:      {mode} (set OPCONTRACTS_MODE or opcontracts.set_mode to change)")
    return "\n".join(lines)


class ContractViolation(OpContractsError, TypeError):
    """A call does not satisfy its operator's contract (raised in ``strict`` mode).

    Subclasses ``TypeError`` because a wrong dtype or shape is a wrong argument type.
    """

    def __init__(
        self, *, op: str, arg: str | None, rule: str, expected: str, actual: str,
        bindings: Mapping[str, int] | None = None, call_site: str | None = None,
        source: str | None = None, fix: str | None = None, others: tuple[Any, ...] = (),
        rank: int | None = None,
    ) -> None:
        self.op = op
        self.arg = arg
        self.rule = rule
        self.expected = expected
        self.actual = actual
        self.bindings = dict(bindings or {})
        self.call_site = call_site
        self.source = source
        self.fix = fix
        self.others = others
        self.rank = rank
        super().__init__(self._message())

    def _message(self) -> str:
        return format_violation(
            op=self.op, arg=self.arg, rule=self.rule, expected=self.expected,
            actual=self.actual, bindings=self.bindings, call_site=self.call_site,
            source=self.source, fix=self.fix, rank=self.rank,
        )

    def __reduce__(self) -> Any:  # keep picklable across processes (torch.distributed, pytest-xdist)
        return (_rebuild_violation, (self.__dict__.copy(),))


def _rebuild_violation(state: dict[str, Any]) -> ContractViolation:
    state = dict(state)
    state.pop("args", None)
    return ContractViolation(**state)


class ContractWarning(UserWarning):
    """A contract violation in ``warn`` mode; shown once per call site and rule.

    ``-W error::opcontracts.ContractWarning`` turns these into errors.
    """


class ContractFixWarning(ContractWarning):
    """``fix`` mode repaired an argument (cast it); shown once per call site and rule."""
