"""The readings of an op's contracts that are still possible on the stacks judged.

Several contracts may share an op, each for some versions (``when``).  With every version
known there is one reading: the contracts that apply.  With one unknown (CANN, the chip on a
CPU test machine), each value it may take gives a reading; ``readings`` finds the distinct ones
by trying a representative of every interval the contracts' conditions cut (``8.0.0`` and
``8.0.0.post1`` for ``cann <8.0.0`` / ``cann >=8.0.0``, and one below the lowest bound; each
chip named, and one named by none).  A reading where no contract applies is no reading: what
is not known there is not "accepted".  Nor is a reading where only a user's contracts apply
while shipped ones apply on other readings (``Reading.partial``): its rejections count, its
acceptance does not, so a user's file never turns a shipped rejection into a conditional.

The guard enforces the strictest merge (``strict``): a call it accepts is accepted on every
reading, so the hot path of a conforming call is what it was.  A call it rejects is judged on
each reading (``judge``, slow path): rejected on every reading of a stack, it is a violation;
rejected only on some, it is *conditional*: whether it is wrong depends on a version nobody
declared, and strict mode warns (naming the readings that reject) instead of raising.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .._lang import versions as _versions

if TYPE_CHECKING:
    from .._lang.targets import Target
    from .._lang.versions import Env
    from ..spec import Contract
    from .compile import CompiledContract, Param, RawViolation

__all__ = ["Reading", "Resolution", "Verdict", "resolve_readings", "MAX_COMBINATIONS"]

MAX_COMBINATIONS = 4096
"""representative stacks tried per stack judged; beyond, the unknown fields are tried one at a
time (the others left unknown), which can only merge readings, never invent one"""


@dataclass(frozen=True)
class Reading:
    """The contracts that apply together on some of the stacks a stack judged may be."""

    stack: int
    contracts: tuple[Contract, ...]
    label: str
    """what this reading assumes, in the contracts' words: ``cann >=8.0.0``"""
    contract: Contract
    """the contracts merged (the strictest within the reading); the one itself when alone"""
    partial: bool = False
    """only a user's contracts apply here, where shipped ones apply on the stack's other
    readings: the shipped rules are silent here, not satisfied.  Its rejections count, its
    acceptance does not (a user's contract adds to the rules, it never opens a door)"""


@dataclass(frozen=True)
class Verdict:
    """A call the strict checker rejected, judged on each reading."""

    rejected: tuple[tuple[Reading, RawViolation], ...]
    accepted: tuple[Reading, ...]
    decided: tuple[Reading, RawViolation] | None
    """the stack rejected on every reading: the first of its readings and why (a violation)"""
    resolution: Resolution

    @property
    def conditional(self) -> bool:
        return self.decided is None and bool(self.rejected)


@dataclass
class Resolution:
    """What ``resolve`` decided for an op: the contract to enforce and the readings behind it."""

    op: str
    strict: Contract | None
    readings: tuple[Reading, ...]
    stacks: tuple[Env, ...]
    targets: tuple[Target, ...]
    unknown: tuple[str, ...]
    """the fields whose being unknown splits the readings (``("cann",)``)"""
    _compiled: dict[Any, list[CompiledContract]] = field(default_factory=dict, repr=False)

    split: bool = field(init=False)
    """whether a call's verdict can differ between readings (decided once: the slow path of
    every violating call asks)"""

    def __post_init__(self) -> None:
        first = self.readings[0].contract if self.readings else None
        self.split = any(r.contract != first for r in self.readings[1:])

    def stack_label(self, index: int) -> str:
        if self.targets and index < len(self.targets):
            return self.targets[index].label
        return "this environment"

    def judge(self, params: Sequence[Param], args: tuple[Any, ...], kwargs: dict[str, Any],
              compile_for: Callable[[Contract, Sequence[Param]], CompiledContract]
              ) -> Verdict | None:
        """Check the call on every reading (each compiled once per parameter list); None when
        a reading cannot be compiled for these parameters (the strict verdict then stands)."""
        key = tuple(params)
        ccs = self._compiled.get(key)
        if ccs is None:
            try:
                ccs = [compile_for(r.contract, params) for r in self.readings]
            except Exception:  # noqa: BLE001 - judged as the strict checker judges it
                ccs = []
            self._compiled[key] = ccs
        if not ccs:
            return None
        rejected: list[tuple[Reading, RawViolation]] = []
        accepted: list[Reading] = []
        by_stack: dict[int, list[bool]] = {}
        for r, cc in zip(self.readings, ccs):
            try:
                raw = cc.check(*args, **kwargs)
            except TypeError:  # the arguments do not bind: the strict verdict stands
                return None
            if raw is None and r.partial:
                continue  # the shipped rules say nothing here: no evidence the call is right
            by_stack.setdefault(r.stack, []).append(raw is None)
            if raw is None:
                accepted.append(r)
            else:
                rejected.append((r, raw))
        decided = None
        for stack, oks in by_stack.items():
            if not any(oks):
                decided = next((x for x in rejected if x[0].stack == stack), None)
                break
        return Verdict(tuple(rejected), tuple(accepted), decided, self)


# --------------------------------------------------------------------------- readings
def _bounds(cond: str) -> list[str]:
    """The versions a specifier text compares against (and, for ``==X.*``/``~=``, where the
    matched range ends)."""
    out = []
    for alt in cond.split("||"):
        for op, target in _versions._specifiers(alt.strip()):
            if target.endswith(".*"):
                base = target[:-2]
                out.append(base)
                v = _versions.parse_version(base)
                if v is not None:
                    out.append(".".join(map(str, (*v.release[:-1], v.release[-1] + 1))))
            else:
                out.append(target)
                if op == "~=":
                    v = _versions.parse_version(target)
                    if v is not None and len(v.release) > 1:
                        out.append(".".join(map(str, (*v.release[:-2], v.release[-2] + 1))))
    return out


def _representatives(name: str, conds: Sequence[Any]) -> list[str]:
    """One value of ``name`` in each region the conditions cut."""
    if name == "soc":
        names = list(dict.fromkeys(n for c in conds for n in c))
        return [*names, "<a chip no contract names>"]
    points: dict[Any, str] = {}
    for c in conds:
        for b in _bounds(c):
            v = _versions.parse_version(b)
            if v is None:
                continue
            points.setdefault(v, str(v))
            above = f"{v}.post{(v.post or 0) + 1}" if v.dev is None else f"{v.base_version}"
            pv = _versions.parse_version(above)
            if pv is not None:
                points.setdefault(pv, str(pv))
    out = sorted(points.items())
    return ["0", *(text for _, text in out)]


def _when_conditions(c: Contract) -> list[tuple[str, Any]]:
    return [] if c.when is None else _versions._conditions(c.when)


def _label(reading: Sequence[Contract], others: Sequence[Contract], unknown: set[str]) -> str:
    """A reading in the contracts' words: the conditions on unknown fields of the contracts it
    has (``cann >=8.0.0``), else the negation of those it lacks."""
    def conds(c: Contract) -> list[str]:
        return [_short(_versions._cond_text(n, v)) for n, v in _when_conditions(c) if n in unknown]

    have = list(dict.fromkeys(t for c in reading for t in conds(c)))
    if have:
        return " and ".join(have)
    lack = list(dict.fromkeys(" and ".join(conds(c)) for c in others if conds(c)))
    return " and ".join(f"not ({t})" if " and " in t else f"not {t}" for t in lack) or "every stack"


def _short(cond: str) -> str:
    """A condition with many alternatives, shortened for a message: its first two and a count
    (``torch_npu >=2.13 || >=2.7.1.post11,<2.7.2 || ... (6 alternatives)``)."""
    alts = cond.split(" || ")
    return cond if len(alts) <= 3 else " || ".join(alts[:2]) + f" || ... ({len(alts)} alternatives)"


def resolve_readings(op: str, candidates: Sequence[Contract], stacks: Sequence[Env],
                     targets: tuple[Target, ...],
                     merge: Callable[[list[Contract]], Contract],
                     is_shipped: Callable[[Contract], bool] = lambda c: True) -> Resolution:
    """The readings of ``candidates`` on each of ``stacks``, and the strictest merge of every
    contract some reading applies (what the guard enforces).  On a stack where a user's
    ``replace = true`` contract may apply, it stands for the shipped ones (``is_shipped``)."""
    readings: list[Reading] = []
    unknown_all: set[str] = set()
    for si, env in enumerate(stacks):
        cands = list(candidates)
        verdicts = [(c, _versions.applies(c.when, env)) for c in cands]
        if any(c.replace and not is_shipped(c) and ok is not False for c, ok in verdicts):
            verdicts = [(c, ok) for c, ok in verdicts if not is_shipped(c)]
            cands = [c for c, _ in verdicts]
        sure = [c for c, ok in verdicts if ok is True]
        maybe = [c for c, ok in verdicts if ok is None]
        if not maybe:
            if sure:
                readings.append(Reading(si, tuple(sure), "", sure[0] if len(sure) == 1 else merge(sure)))
            continue
        unknown = {n for c in maybe for n, _ in _when_conditions(c)
                   if getattr(env, n) is None or (n != "soc" and _versions.parse_version(getattr(env, n)) is None)}
        conds: dict[str, list[Any]] = {}
        for c in maybe:
            for n, v in _when_conditions(c):
                if n in unknown:
                    conds.setdefault(n, []).append(v)
        names = sorted(conds)
        reps = [_representatives(n, conds[n]) for n in names]
        total = 1
        for r in reps:
            total *= len(r)
        if total <= MAX_COMBINATIONS:
            combos: Any = (dict(zip(names, vals)) for vals in itertools.product(*reps))
        else:  # pragma: no cover - contracts would need dozens of bounds on several fields
            combos = ({n: v} for n, r in zip(names, reps) for v in r)
        seen: dict[tuple[int, ...], None] = {}
        for combo in combos:
            probe = replace(env, **combo)
            app = tuple(i for i, c in enumerate(cands)
                        if _versions.applies(c.when, probe) is not False)
            if app:
                seen.setdefault(app, None)
        found = list(seen)
        # a reading that another contains is kept: its rules differ (fewer hold there)
        unknown_all |= set(names)
        shipped_somewhere = any(is_shipped(cands[i]) for app in found for i in app)
        for app in found:
            items = [cands[i] for i in app]
            others = [c for c in maybe if all(c is not x for x in items)]
            label = _label([c for c in items if any(c is m for m in maybe)], others, set(names))
            partial = shipped_somewhere and not any(is_shipped(c) for c in items)
            readings.append(Reading(si, tuple(items), label,
                                    items[0] if len(items) == 1 else merge(items), partial))
    used = {id(c) for r in readings for c in r.contracts}
    union = [c for c in candidates if id(c) in used]  # in the registry's order, as before
    strict = None if not union else union[0] if len(union) == 1 else merge(union)
    order = {n: i for i, n in enumerate(_versions.FIELDS)}
    return Resolution(op, strict, tuple(readings), tuple(stacks), targets,
                      tuple(sorted(unknown_all, key=lambda n: order.get(n, 99))))
