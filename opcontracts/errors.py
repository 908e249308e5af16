"""Exceptions and warnings raised by opcontracts.

Kept free of torch imports so every other module (and users' ``-W`` filters) can import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = [
    "OpContractsError",
    "ContractFileError",
    "FileProblem",
    "SettingError",
    "ContractViolation",
    "ContractWarning",
    "ContractFixWarning",
    "ContractConditionalWarning",
    "format_violation",
]


class OpContractsError(Exception):
    """Base class of every error opcontracts raises on purpose."""


class FileProblem(NamedTuple):
    """One thing wrong with a contract: where (file, contract, dotted field) and what."""

    message: str
    file: str | None = None
    contract: str | None = None
    field: str | None = None
    obj: str | None = None
    """the Python object being built when there is no file (``Arg``, ``Contract``)"""

    def where(self, *, with_file: bool = True) -> str:
        parts = []
        if with_file and self.file:
            parts.append(str(self.file))
        elif self.obj and not self.file and not self.contract:
            parts.append(self.obj)
        if self.contract:
            parts.append(f"contract {self.contract}")
        if self.field:
            parts.append(f"field {self.field}")
        return ", ".join(parts)


class ContractFileError(OpContractsError, ValueError):
    """A contract file or inline contract is malformed.

    ``file``, ``contract`` (the op name or ``#index``) and ``field`` (dotted path) say where the
    first problem is; ``problems`` holds every problem found (the message lists them, up to
    ``MAX_SHOWN``).
    """

    MAX_SHOWN = 50

    def __init__(self, message: str, *, file: str | None = None, contract: str | None = None,
                 field: str | None = None, obj: str | None = None,
                 problems: Sequence[FileProblem] = ()) -> None:
        probs = tuple(problems) or (FileProblem(message, file, contract, field, obj),)
        first = probs[0]
        self.problems: tuple[FileProblem, ...] = probs
        self.file = first.file
        self.contract = first.contract
        self.field = first.field
        self.reason = first.message
        super().__init__(_describe(probs))

    @classmethod
    def of(cls, problems: Sequence[FileProblem]) -> ContractFileError:
        """One error for several problems (of one file, or of the files of a folder)."""
        if not problems:
            raise ValueError("no problems")
        return cls(problems[0].message, problems=problems)

    def __reduce__(self) -> Any:  # picklable (pytest-xdist, multiprocessing)
        return (_rebuild_file_error, (self.problems,))


def _rebuild_file_error(problems: tuple[FileProblem, ...]) -> ContractFileError:
    return ContractFileError.of([FileProblem(*p) for p in problems])


def _describe(problems: Sequence[FileProblem]) -> str:
    if len(problems) == 1:
        p = problems[0]
        return f"{p.where() or 'contract'}: {p.message}"
    files = list(dict.fromkeys(p.file for p in problems))
    one_file = len(files) == 1 and files[0] is not None
    head = f"{files[0]}: {len(problems)} problems" if one_file else \
        f"{len(problems)} problems" + (f" in {len(files)} files" if len(files) > 1 else "")
    lines = [head + ":"]
    for p in problems[:ContractFileError.MAX_SHOWN]:
        where = p.where(with_file=not one_file)
        lines.append(f"  {where}: {p.message}" if where else f"  {p.message}")
    hidden = len(problems) - ContractFileError.MAX_SHOWN
    if hidden > 0:
        lines.append(f"  ... {hidden} more not shown (fix these first)")
    return "\n".join(lines)


class SettingError(OpContractsError, ValueError):
    """A setting opcontracts cannot use: an unknown mode name, or an environment variable
    holding a value it does not understand (``OPCONTRACTS_MODE=bogus`` stops the start-up,
    naming the variable and the valid values)."""


def got_text(actual: str) -> str:
    """The argument's side of a violation without the verb: "argument 'p' has dtype float32"
    reads "got: dtype float32"."""
    for verb in ("has ", "is "):
        if actual.startswith(verb):
            return actual[len(verb):]
    return actual


_LAYER_SAYS = {
    "torch_npu": "torch_npu's own check decides: the rule follows the torch_npu release",
    "cann": "op-plugin passes the call to aclnn: the CANN kernel decides",
    "mindspeed": "MindSpeed's own check decides",
    "meta": "the op's meta kernel decides",
}


def source_text(source: str | None, layer: str | None) -> str:
    """A rule's source as a message's ``source:`` line shows it: with the layer that decides
    (``... (layer cann: op-plugin passes the call to aclnn: the CANN kernel decides)``)."""
    text = source or "-"
    if layer:
        text += f" (layer {layer}: {_LAYER_SAYS.get(layer, layer)})"
    return text


def format_violation(
    *, op: str, arg: str | None, rule: str, expected: str, actual: str,
    bindings: Mapping[str, int], call_site: str | None, source: str | None, fix: str | None,
    mode: str | None = None, rank: int | None = None, layer: str | None = None,
    reading: str | None = None,
) -> str:
    head = f"{op}: argument '{arg}' {actual}, expected {expected}" if arg else \
        f"{op}: {actual}, expected {expected}"
    if rank is not None:
        head = f"[rank {rank}] {head}"
    got = got_text(actual)
    lines = [head, f"  rule:      {rule}", f"  expected:  {expected}", f"  got:       {got}"]
    if bindings:
        lines.append("  bindings:  " + ", ".join(f"{k}={v}" for k, v in bindings.items()))
    if call_site:
        lines.append(f"  call site: {call_site}")
    if source or layer:
        lines.append(f"  source:    {source_text(source, layer)}")
    if reading:
        lines.append(f"  readings:  {reading}")
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
        rank: int | None = None, layer: str | None = None, reading: str | None = None,
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
        self.layer = layer
        """the layer whose check decides the broken rule (``spec.LAYERS``), or None"""
        self.reading = reading
        """which of the possible readings of the op's contracts decided, when versions are
        unknown or several targets are declared (None: one reading)"""
        super().__init__(self._message())

    @property
    def got(self) -> str:
        """What the argument was, as the message's ``got:`` line says it."""
        return got_text(self.actual)

    def _message(self) -> str:
        return format_violation(
            op=self.op, arg=self.arg, rule=self.rule, expected=self.expected,
            actual=self.actual, bindings=self.bindings, call_site=self.call_site,
            source=self.source, fix=self.fix, rank=self.rank, layer=self.layer,
            reading=self.reading,
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


class ContractConditionalWarning(ContractWarning):
    """A call that some of the stacks still possible reject and others accept (a version or
    the chip is unknown, no target declared): not a violation, so strict mode warns instead of
    raising and fix mode does not cast.  Declaring the target (``opcontracts.set_targets``,
    ``OPCONTRACTS_TARGETS``, ``[tool.opcontracts] targets``) decides it."""
