"""``opcontracts check-dump``: judge an msprobe dump's recorded calls against the contracts.

msprobe records, for every API call, its arguments' dtypes and shapes (and statistics, or whole
tensors in tensor mode): all a dtype/shape contract needs.  Each forward entry of an op that
has a contract is judged by the op's own compiled checker (the one the patch's guard runs) on
meta tensors built from the recorded dtypes and shapes (``torch.empty(shape, dtype=...,
device="meta")``: tensors without storage), its positional inputs bound to parameters by the
op's schema (the shipped wheel digest's, for torch_npu's ops) or the contract's signature, its
keyword inputs by name.  Value rules are off while judging (statistics are not values), and a
``contiguous`` rule always holds (msprobe records no strides).  Backward entries hold gradients
and are counted, not judged; PyTorch's own APIs (``Torch.*``, ``Tensor.*``, ``Functional.*``
...) are counted and skipped.

Which contracts apply is decided on the stacks judged: the flags' (``--torch-npu``,
``--cann``, ``--soc``), else the declared targets (``_lang.targets``: ``[tool.opcontracts]``,
``OPCONTRACTS_TARGETS``), else this environment.  As in the guard, a call the op's strictest
checker accepts is accepted; one it rejects is judged on each reading of the op's contracts
(``_engine.readings``): rejected on every reading of a stack, a violation; on some only,
*conditional* (a version still unknown decides), reported with the readings that reject it and
never counted as a violation.  Unlike the guard, which raises on the first rule broken, every
argument a call breaks is found (the rule broken taken off and the call judged again), each
with its own verdict.  Findings are merged over ranks (which ranks saw each; a rank without a
dump of a step said as such), steps kept apart.

What cannot be judged is said, never taken for clean: an argument whose record a rule cannot
read (``msprobe_dump.Unreadable``: no dtype, a size that is none; a value recorded in a form no
rule reads) is counted per op, argument and why, the call's other arguments judged; a dump
where not one call could be judged whole has ``status`` 3.  Dumps are read one entry at a
time (``msprobe_dump``), and findings aggregated as they come: memory does not grow with the
dump.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .._engine import registry as _registry
from .._engine.compile import Param
from .._engine.readings import resolve_readings
from .._engine.records import aligned
from .._lang import targets as _targets
from .._lang import versions as _versions
from .._ranks.gather import _ranks_text
from ..errors import ContractViolation, OpContractsError, format_violation
from . import msprobe_dump as md

if TYPE_CHECKING:
    from .._engine.readings import Resolution

__all__ = ["Stacks", "Verdict", "Judgement", "Judge", "Judged", "Finding", "NotJudged",
           "DumpVerdict", "environment",
           "judged_calls", "check_path", "render", "to_json"]


# --------------------------------------------------------------------------- versions
@dataclass(frozen=True)
class Stacks:
    """The stacks a dump is judged against (``targets.stacks``): one per target, or this
    environment alone; ``targets`` is empty in that case."""

    targets: tuple[_targets.Target, ...]
    envs: tuple[_versions.Env, ...]

    def labels(self) -> list[str]:
        if not self.targets:
            return ["this environment"]
        return [t.label for t in self.targets]


def environment(*, torch_npu: str | None = None, cann: str | None = None,
                soc: str | None = None) -> Stacks:
    """The stacks a dump is judged against, the first that says anything: the flags (one
    target; ``"unknown"`` forces a version unknown), the declared targets
    (``OPCONTRACTS_TARGETS``, ``[tool.opcontracts]`` in pyproject.toml, ``set_targets``), this
    environment (``opcontracts env``: ``OPCONTRACTS_*_VERSION``, what is installed here).  What a
    target leaves out comes from the environment.  ``OpContractsError`` on a bad flag."""
    given: list[tuple[str, str]] = []
    unknown: list[str] = []
    for name, flag in (("torch_npu", torch_npu), ("cann", cann), ("soc", soc)):
        if flag is None:
            continue
        text, option = flag.strip(), f"--{name.replace('_', '-')}"
        if not text:
            raise OpContractsError(f"{option}: empty (give a value, or 'unknown')")
        if text.lower() == _versions.UNKNOWN:
            unknown.append(name)
        elif name != "soc" and _versions.normalize_version(text) is None:
            example = "2.13.0" if name == "torch_npu" else "8.0.RC3"
            raise OpContractsError(f"{option} {flag!r}: not a version (try {example!r} or "
                                   "'unknown')")
        else:
            given.append((name, text))
    chosen = ((_targets.Target(tuple(given), origin="the --torch-npu/--cann/--soc flags"),)
              if given or unknown else _targets.declared()[0])
    envs = _targets.stacks(_versions.current(), chosen)
    if unknown:
        forget: dict[str, Any] = dict.fromkeys(unknown)
        envs = tuple(dataclasses.replace(e, **forget) for e in envs)
    return Stacks(chosen, envs)


# --------------------------------------------------------------------------- judging
class Verdict(NamedTuple):
    kind: str
    """``violation``, or ``conditional``: rejected only on some readings of the contracts
    (a version unknown decides), ``depends_on`` naming them"""
    violation: ContractViolation
    depends_on: tuple[str, ...] = ()
    on: str | None = None
    """with several targets: the one whose every reading rejects the call"""


class Judgement(NamedTuple):
    """The verdicts on one recorded call: one per argument (and rule) it breaks, and the
    arguments with rules that could not be judged, with why."""

    verdicts: list[Verdict]
    unread: tuple[tuple[str, str], ...] = ()


MEMO_SIZE = 1 << 16
"""distinct recorded signatures whose verdicts are remembered"""
MAX_FINDINGS_PER_CALL = 64
"""rules relaxed, at most, to find the next argument a call breaks"""

# what relaxing a rule of one argument takes off its ``Arg`` (``_relax``); "*": every rule
_RELAX: dict[str, dict[str, Any]] = {
    "dtype": {"dtype": None, "dtype_if_present": None, "dtype_value": False, "dtype_of": None},
    "same_dtype": {"same_dtype_as": None, "same_dtype_except": None},
    "shape": {"shape": None, "rank": None, "dims": None, "numel_lt": None},
    "rank": {"shape": None, "rank": None, "dims": None, "numel_lt": None},
    "same_shape": {"same_shape_as": None},
    "contiguous": {"contiguous": False},
    "value": {"values": None},
    "allowed": {"allowed": None, "dtype": None, "dtype_value": False, "dtype_of": None},
    "bound": {"ge": None, "le": None, "lt": None},
    "missing": {"optional": True},
    "list_len": {"max_len": None},
}


class Judge:
    """The verdicts on recorded calls for some stacks, as the guard reaches them: the op's
    strictest checker first (a call it accepts is accepted on every reading); a call it
    rejects judged on each reading of the op's contracts (``_engine.readings``), a violation
    when every reading of a stack rejects it, conditional when only some do.  Per distinct
    recorded signature the verdicts are memoized (a dump repeats the same calls layer after
    layer)."""

    def __init__(self, stacks: Stacks) -> None:
        import torch

        self._torch = torch
        self.stacks = stacks
        self._resolutions: dict[str, Resolution] = {}
        self._params: dict[tuple[str, str], list[Param]] = {}
        self._verdicts: dict[tuple[Any, ...], Judgement] = {}
        self._relaxations: dict[tuple[str, frozenset[tuple[str, str]]], Resolution] = {}
        self._dtypes: dict[str, Any] = {}
        self._release: Any = None

    def resolution(self, op: str) -> Resolution:
        res = self._resolutions.get(op)
        if res is None:
            res = self._resolutions[op] = resolve_readings(
                op, _registry.candidates(op), self.stacks.envs, self.stacks.targets,
                _registry.merge_contracts)
        return res

    def _schema(self, call: md.ApiCall) -> list[Param] | None:
        """torch_npu's schema of the op in the shipped digest (of the release judged for, else
        the newest it has): the one the emulation registers too."""
        from .._engine.enforce import _schema_params
        from ..wheel import digest

        if self._release is None:
            d = digest.load()
            v = self.stacks.envs[0].torch_npu
            self._release = d.release(v if v in d.versions else d.versions[-1])
        schema = self._release.schema(call.api)
        if schema is None:
            return None
        try:
            return _schema_params(self._torch._C.parse_schema(schema.func))
        except RuntimeError:  # a schema torch cannot parse: the contract's own order
            return None

    def params(self, op: str, call: md.ApiCall) -> list[Param]:
        """How positional inputs bind: torch_npu's schema for ``NPU.*`` calls, else (and when
        the contract names an argument the schema lacks) the contract's ``signature`` or
        argument order, as a guard on a generic wrapper binds."""
        key = (op, call.prefix)
        got = self._params.get(key)
        if got is None:
            strict = self.resolution(op).strict
            own = [Param(n) for n in (strict.signature or tuple(strict.args))] if strict else []
            schema = self._schema(call) if call.prefix == "NPU" else None
            names = {p.name for p in schema or ()}
            got = schema if schema and strict and all(a in names for a in strict.args) else own
            self._params[key] = got
        return got

    def names(self, op: str, call: md.ApiCall) -> list[str]:
        """The parameter names positional inputs bind to."""
        return [p.name for p in self.params(op, call)]

    def _dtype(self, name: str) -> Any:
        if name not in self._dtypes:
            dt = getattr(self._torch, name.removeprefix("torch."), None)
            self._dtypes[name] = dt if isinstance(dt, self._torch.dtype) else None
        return self._dtypes[name]

    def _live(self, v: Any) -> Any:
        if isinstance(v, md.TensorMeta):
            dt = self._dtype(v.dtype)
            if dt is None:
                return md.Unreadable(v.type, f"dtype {v.dtype} is not a torch dtype here")
            try:
                return self._torch.empty(v.shape, dtype=dt, device="meta")
            except (RuntimeError, ValueError, OverflowError) as exc:
                return md.Unreadable(v.type, f"shape {list(v.shape)}: {exc}")
        if isinstance(v, list):
            return [self._live(x) for x in v]
        return v

    def arguments(self, call: md.ApiCall) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The recorded inputs as the checker takes them: meta tensors for tensors."""
        return (tuple(self._live(a) for a in call.args),
                {k: self._live(v) for k, v in call.kwargs.items()})

    def judge(self, op: str, call: md.ApiCall) -> Judgement:
        """The call's verdicts: one per argument it breaks (an offline report lists them all,
        not only the first a guard would raise on), and the arguments with rules whose record
        cannot be read.  ``TypeError`` when the inputs do not bind to the parameters."""
        key = (op, call.prefix, _sig(call.args), _sig(call.kwargs))
        hit = self._verdicts.get(key)
        if hit is not None:
            return hit
        if len(self._verdicts) >= MEMO_SIZE:  # a dump of ever-new shapes: memory stays bounded
            self._verdicts.clear()
        res = self.resolution(op)
        out = Judgement([])
        if res.strict is not None:
            params = self.params(op, call)
            args, kwargs = self.arguments(call)
            out = self._all(op, res, params, args, kwargs)
        self._verdicts[key] = out
        return out

    def _all(self, op: str, res: Resolution, params: list[Param], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Judgement:
        """Every argument the call breaks: the first rule broken is relaxed (taken off the
        contracts of every reading) and the call judged again, until it passes; then each
        one's verdict is reached with the others relaxed, so that whether it is a violation
        or conditional is its own (an fp32 ``probs`` that only some CANN versions reject
        stays conditional beside an int64 ``sorted_indices`` that every version rejects)."""
        relaxed: list[tuple[str, str]] = []
        found: list[tuple[tuple[str, str], Verdict]] = []
        unread: list[tuple[str, str]] = []
        for _ in range(MAX_FINDINGS_PER_CALL):
            try:
                v = self._first(self._relaxed(op, res, relaxed), params, args, kwargs)
            except TypeError:
                if not relaxed:
                    raise  # the inputs do not bind: the call cannot be judged
                unread.append(("-", "the rest of the call could not be judged"))
                break
            if v is None:
                break
            e = v.violation
            name = (e.arg or "").split("[", 1)[0]
            recorded = _recorded(e.arg, params, args, kwargs)
            item = (name, "*" if isinstance(recorded, md.Opaque) or e.rule == "type"
                    else e.rule)
            if not name or item in relaxed:  # a rule no argument's relaxing takes off
                if not isinstance(recorded, md.Opaque):
                    found.append((item, v))
                break
            relaxed.append(item)
            if isinstance(recorded, md.Unreadable):
                unread.append((name, recorded.why))
            elif isinstance(recorded, md.Opaque):
                unread.append((name, f"recorded as {recorded.type}, which no rule reads"))
            else:
                found.append((item, v))
        verdicts = []
        for item, v in found:
            if len(relaxed) > 1 and item in relaxed:
                others = [r for r in relaxed if r != item]
                try:
                    v = self._first(self._relaxed(op, res, others), params, args, kwargs) or v
                except TypeError:
                    pass
            verdicts.append(v)
        return Judgement(verdicts, tuple(dict.fromkeys(unread)))

    def _relaxed(self, op: str, res: Resolution, items: list[tuple[str, str]]) -> Resolution:
        """``res`` with the rules ``items`` (argument, rule kind) taken off every contract."""
        if not items:
            return res
        key = (op, frozenset(items))
        got = self._relaxations.get(key)
        if got is None:
            def relax(c: Any) -> Any:
                return None if c is None else _relax(c, items)

            got = self._relaxations[key] = dataclasses.replace(
                res, strict=relax(res.strict), _compiled={},
                readings=tuple(dataclasses.replace(r, contract=relax(r.contract))
                               for r in res.readings))
        return got

    def _first(self, res: Resolution, params: list[Param], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Verdict | None:
        """The verdict on the first rule the call breaks (as the guard reaches it: the
        strictest checker first, then the readings), or None when it breaks none."""
        from .._engine.enforce import compiled_for, explain_call

        assert res.strict is not None
        if explain_call(compiled_for(res.strict, params), args, kwargs) is None:
            return None
        v = res.judge(params, args, kwargs, compiled_for)
        on: str | None = None
        depends: tuple[str, ...] = ()
        if v is None:  # the readings cannot judge the call: the strict verdict stands
            contract = res.strict
        elif v.decided is not None:
            contract = v.decided[0].contract
            if len(res.targets) > 1:
                on = res.stack_label(v.decided[0].stack)
        elif v.conditional:
            contract = v.rejected[0][0].contract
            depends = tuple(dict.fromkeys(
                (f"{res.stack_label(r.stack)}: " if res.targets else "") + (r.label or "every stack")
                for r, _ in v.rejected))
        else:
            return None
        exc = explain_call(compiled_for(contract, params), args, kwargs)
        if exc is None:
            return None
        return Verdict("conditional" if v is not None and v.decided is None else "violation",
                       exc, depends, on)


def _relax(c: Any, items: list[tuple[str, str]]) -> Any:
    """Contract ``c`` without the rules ``items``: (argument, rule kind), ``"*"`` for every
    rule of the argument (and the other arguments' rules that name it as their partner)."""
    gone = {who for who, kind in items if kind == "*"}

    def arg(name: str, a: Any) -> Any:
        for who, kind in items:
            if who == name and kind != "*":
                a = a.model_copy(update=_RELAX.get(kind, {}))
        update: dict[str, Any] = {}
        if a.same_dtype_as in gone:
            update.update(same_dtype_as=None, same_dtype_except=None)
        if a.same_shape_as in gone:
            update["same_shape_as"] = None
        if a.dtype_if_present and gone & set(a.dtype_if_present):
            update["dtype_if_present"] = {
                k: v for k, v in a.dtype_if_present.items() if k not in gone} or None
        return a.model_copy(update=update) if update else a

    def args(given: dict[str, Any]) -> dict[str, Any]:
        return {n: arg(n, a) for n, a in given.items() if n not in gone}

    update: dict[str, Any] = {"args": args(c.args)}
    if c.cases:
        update["cases"] = tuple(k.model_copy(update={"args": args(k.args)}) for k in c.cases)
    if any(kind == "device" for _, kind in items):
        update["same_device"] = False
    return c.model_copy(update=update)


def _sig(values: Any) -> Any:
    """A hashable key of recorded arguments."""
    if isinstance(values, (list, tuple)):
        return tuple(_sig(v) for v in values)
    if isinstance(values, dict):
        return tuple(sorted((k, _sig(v)) for k, v in values.items()))
    return values


def _recorded(arg: str | None, params: list[Param], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
    """The recorded value a violation names (``probs``, ``x[2]`` of a tensor list), or None."""
    name, _, index = (arg or "").partition("[")
    names = [p.name for p in params]
    if name in kwargs:
        value = kwargs[name]
    elif name in names and names.index(name) < len(args):
        value = args[names.index(name)]
    else:
        return None
    if index and isinstance(value, (list, tuple)):
        try:
            return value[int(index.rstrip("]"))]
        except (ValueError, IndexError):
            return None
    return value


class Judged(NamedTuple):
    dump: md.RankDump
    call: md.ApiCall
    op: str | None
    """the contract op, None for an API without one"""
    verdicts: list[Verdict] | None
    """None for a call not judged: a backward entry, or one the checker cannot read"""
    why: str | None = None
    """why a forward call of an op with a contract was not judged"""
    unread: tuple[tuple[str, str], ...] = ()
    """the arguments with rules that could not be judged (argument, why); the others were"""


def judged_calls(files: Sequence[Path], judge: Judge) -> Iterator[Judged]:
    """Every recorded call of the ``dump.json`` files with its op and verdicts, read one entry
    at a time (only the inputs of ops with a contract are read).  Value checks are off
    meanwhile (the engine's one switch, ``set_value_checks``: process-wide, so a job's own
    guards in other threads would skip theirs too meanwhile; this is a command-line tool's
    loop)."""
    from .._lang import values as _values

    _registry.load_shipped()
    index = md.ApiIndex(_registry.all_contracts())

    def keep(prefix: str, api: str) -> bool:
        return index.op_of(prefix, api) is not None

    prev = _values.set_value_checks(False)  # statistics are not values: value rules skipped
    try:
        for f in files:
            d = md.read_rank_dump(f, keep)
            for call in d.calls():
                op = index.op_for(call)
                if op is None or call.direction != "forward":
                    yield Judged(d, call, op, None)
                elif not call.inputs:
                    yield Judged(d, call, op, None, "inputs not recorded (msprobe's data_mode)")
                else:
                    try:
                        j = judge.judge(op, call)
                    except TypeError as exc:  # inputs that do not bind to the parameters
                        yield Judged(d, call, op, None, str(exc))
                    else:
                        yield Judged(d, call, op, j.verdicts, unread=j.unread)
    finally:
        _values.set_value_checks(prev)


# --------------------------------------------------------------------------- findings
@dataclass
class Finding:
    """One distinct violation of one step, merged over the ranks that recorded it."""

    op: str
    argument: str | None
    rule: str
    expected: str
    got: str
    api: str
    """the first msprobe API name it was seen in"""
    step: int | None
    call_site: str | None
    message: str
    verdict: str = "violation"
    depends_on: tuple[str, ...] = ()
    on: str | None = None
    """with several targets, the one that rejects it"""
    ranks: list[int] = field(default_factory=list)
    calls: int = 0
    source: str | None = None
    fix: str | None = None

    def key(self) -> tuple[Any, ...]:
        return (self.step, self.verdict, self.op, self.argument, self.rule, self.expected,
                self.got, self.call_site, self.on)


@dataclass
class NotJudged:
    """Calls of one op whose argument (``"-"``: the whole call) could not be judged, and why."""

    op: str
    argument: str
    why: str
    api: str
    """the first msprobe API name it was seen in"""
    calls: int = 0


@dataclass
class DumpVerdict:
    """What ``check-dump`` found in PATH."""

    path: str
    files: list[str]
    steps: list[int | None]
    ranks: list[int]
    stacks: Stacks
    checked: int = 0
    """forward calls of ops with a contract judged whole"""
    ops: dict[str, int] = field(default_factory=dict)
    """contract op -> calls judged whole"""
    skipped: dict[str, int] = field(default_factory=dict)
    """msprobe API (``Tensor.__mul__``) -> calls skipped: PyTorch's own, or without contract"""
    backward: int = 0
    unjudged: dict[tuple[str, str, str], NotJudged] = field(default_factory=dict)
    """(op, argument, why) -> the calls that could not be judged, in whole or in part"""
    not_judged_calls: int = 0
    """forward calls of ops with a contract not judged whole (some argument, or all, not)"""
    step_ranks: dict[int | None, list[int]] = field(default_factory=dict)
    """step -> the ranks with a dump of it"""
    findings: list[Finding] = field(default_factory=list)

    @property
    def violations(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict == "violation"]

    @property
    def judged_nothing(self) -> bool:
        """Calls of ops with a contract were recorded and none could be judged whole: no
        clean bill."""
        return not self.checked and bool(self.unjudged)

    @property
    def status(self) -> int:
        """The exit status: 1 violations, 3 nothing could be judged, else 0."""
        return 1 if self.violations else 3 if self.judged_nothing else 0


def check_path(path: str | Path, stacks: Stacks) -> DumpVerdict:
    """Read and judge every ``dump.json`` PATH stands for (``msprobe_dump.find_rank_dumps``),
    one entry at a time; ``msprobe_dump.DumpError`` when PATH is not an msprobe dump."""
    files = md.find_rank_dumps(path)
    where = [md.where(f) for f in files]
    steps = sorted({s for s, _ in where}, key=lambda s: -1 if s is None else s)
    out = DumpVerdict(str(path), [str(f) for f in files], steps,
                      sorted({r for _, r in where if r is not None}), stacks)
    for s, r in where:
        ranks = out.step_ranks.setdefault(s, [])
        if r is not None and r not in ranks:
            ranks.append(r)
            ranks.sort()
    merged: dict[tuple[Any, ...], Finding] = {}
    for j in judged_calls(files, Judge(stacks)):
        if j.verdicts is None:
            if j.op is None:
                # an API as msprobe names it without its count; module entries by their kind
                label = f"{j.call.prefix}.{j.call.api}" if j.call.direction else j.call.prefix
                out.skipped[label] = out.skipped.get(label, 0) + 1
            elif j.why is None:
                out.backward += 1
            else:
                _not_judged(out, j.op, "-", j.why, j.call.name)
                out.not_judged_calls += 1
            continue
        assert j.op is not None
        if j.unread:
            out.not_judged_calls += 1
            for arg, why in j.unread:
                _not_judged(out, j.op, arg, why, j.call.name)
        else:
            out.checked += 1
            out.ops[j.op] = out.ops.get(j.op, 0) + 1
        for v in j.verdicts:
            _add(merged, j.dump, j.call, v)
    out.findings = sorted(merged.values(), key=lambda f: (
        -1 if f.step is None else f.step, f.verdict != "violation", f.op, f.argument or "",
        f.rule))
    return out


def _not_judged(out: DumpVerdict, op: str, arg: str, why: str, api: str) -> None:
    entry = out.unjudged.get((op, arg, why))
    if entry is None:
        entry = out.unjudged[(op, arg, why)] = NotJudged(op, arg, why, api)
    entry.calls += 1


def _add(merged: dict[tuple[Any, ...], Finding], d: md.RankDump, call: md.ApiCall,
         v: Verdict) -> None:
    e, site = v.violation, d.frames.get(call.name)
    key = (d.step, v.kind, e.op, e.arg, e.rule, e.expected, e.got, site, v.on)
    old = merged.get(key)
    if old is None:
        old = merged[key] = Finding(
            e.op, e.arg, e.rule, e.expected, e.got, call.name, d.step, site,
            format_violation(op=e.op, arg=e.arg, rule=e.rule, expected=e.expected,
                             actual=e.actual, bindings=e.bindings, call_site=site,
                             source=e.source, fix=e.fix),
            v.kind, v.depends_on, v.on, source=e.source, fix=e.fix)
    old.calls += 1
    if d.rank is not None and d.rank not in old.ranks:
        old.ranks = sorted([*old.ranks, d.rank])


# --------------------------------------------------------------------------- output
def _step(s: int | None) -> str:
    return "-" if s is None else str(s)


def _is_torch(label: str) -> bool:
    return label.split(".", 1)[0] in md.TORCH_FAMILIES


def render(r: DumpVerdict) -> str:
    """The verdict as ``report merge`` shows merged reports: what was read and checked, one
    table row per distinct violation with the ranks that saw it, which ranks per violation,
    then the first message of each."""
    head = f"opcontracts check-dump: {r.path}: {len(r.files)} dump.json file(s)"
    if r.steps != [None]:
        head += f", step(s) {', '.join(_step(s) for s in r.steps)}"
    if r.ranks:
        head += f", rank(s) {_ranks_text(r.ranks)}"
    torch_calls = sum(c for k, c in r.skipped.items() if _is_torch(k))
    other = sorted(k for k in r.skipped if not _is_torch(k))
    skipped = (f"{torch_calls} call(s) of PyTorch's own APIs (Torch, Tensor, Functional, ...)"
               + (f", {sum(r.skipped[k] for k in other)} call(s) of API(s) without a contract "
                  f"({', '.join(other)})" if other else ""))
    lines = [head]
    if r.judged_nothing:
        lines.append(f"nothing could be judged: {r.not_judged_calls} forward call(s) of op(s) "
                     "with a contract, none with every input a rule reads (below); this is no "
                     f"clean bill; skipped {skipped}")
    elif not r.checked:
        lines.append("nothing was checked: no recorded forward call is of an op with a "
                     f"contract; skipped {skipped}")
    else:
        ops = ", ".join(f"{op} x{c}" for op, c in sorted(r.ops.items()))
        lines.append(f"checked {r.checked} call(s) of {len(r.ops)} op(s) with a contract: {ops}")
        lines.append(f"  skipped {skipped}; {r.backward} backward entr"
                     f"{'y' if r.backward == 1 else 'ies'} of those ops (gradients: not judged)")
    if r.unjudged:
        lines += _not_judged_lines(r)
    for label, env in zip(r.stacks.labels(), r.stacks.envs):
        lines.append(f"  judged for {label}: " + ", ".join(
            f"{n} {getattr(env, n) or 'unknown'}" for n in ("torch_npu", "cann", "soc")))
    viol = r.violations
    cond = [f for f in r.findings if f.verdict == "conditional"]
    if viol:
        lines += ["", f"{len(viol)} contract violation(s)"]
    elif r.checked and r.unjudged:
        lines += ["", f"no contract violations in the {r.checked} call(s) judged whole; "
                  f"{r.not_judged_calls} call(s) could not be judged, in whole or in part "
                  "(above)."]
    elif r.checked:
        lines += ["", "no contract violations."]
    if viol:
        lines += ["", *_table(viol), "", "per violation, the ranks that saw it:"]
        lines += [f"  step {_step(f.step)}: {f.op}: {f.argument or '-'} {f.rule} at "
                  f"{f.call_site or f.api}: {_seen(f.ranks, f.step, r)}" for f in viol]
    if cond:
        lines += ["", f"{len(cond)} conditional finding(s): violations if a version not known "
                  "here is one the rule is for (give it: --torch-npu, --cann, --soc)",
                  "", *_table(cond)]
    if r.findings:
        lines += ["", "first message of each:"]
        shown: set[tuple[Any, ...]] = set()
        for f in r.findings:
            if (f.message, f.depends_on, f.on) in shown:
                continue
            shown.add((f.message, f.depends_on, f.on))
            lines += ["  " + ln for ln in f.message.splitlines()]
            lines += [f"    depends on: {d}" for d in f.depends_on]
            if f.on:
                lines.append(f"    rejected on: {f.on}")
    return "\n".join(lines)


def _table(items: list[Finding]) -> list[str]:
    rows = [("step", "op", "arg", "rule", "expected", "got", "ranks", "calls", "api",
             "call site")]
    for f in items:
        rows.append((_step(f.step), f.op, f.argument or "-", f.rule, f.expected, f.got,
                     _ranks_text(f.ranks) if f.ranks else "-", str(f.calls), f.api,
                     f.call_site or "-"))
    return aligned(rows)


MAX_NOT_JUDGED_LINES = 20


def _not_judged_lines(r: DumpVerdict) -> list[str]:
    """What could not be judged, per op and argument, with why and how many calls."""
    rows = sorted(r.unjudged.values(), key=lambda n: (n.op, n.argument, n.why))
    ops = {n.op for n in rows}
    out = [f"  not judged: {r.not_judged_calls} call(s) of {len(ops)} op(s), in whole or in "
           "part (no verdict on these; the other arguments of a call were judged):"]
    for n in rows[:MAX_NOT_JUDGED_LINES]:
        what = "the whole call" if n.argument == "-" else f"argument {n.argument!r}"
        out.append(f"    {n.op}: {what}: {n.why}: {n.calls} call(s), first {n.api}")
    if len(rows) > MAX_NOT_JUDGED_LINES:
        out.append(f"    ... and {len(rows) - MAX_NOT_JUDGED_LINES} more (--json lists "
                   "every one)")
    return out


def _seen(seen: list[int], step: int | None, r: DumpVerdict) -> str:
    """Which ranks saw a finding of ``step``: among the ranks with a dump of that step, and
    saying plainly which ranks have none (not that they did not see it)."""
    if not seen:
        return "rank unknown"
    dumped = r.step_ranks.get(step, r.ranks)
    without = [k for k in r.ranks if k not in dumped]
    missing = [k for k in dumped if k not in seen]
    text = f"rank{'s' if len(seen) > 1 else ''} {_ranks_text(seen)}"
    if missing:
        text += f" only (not rank {_ranks_text(missing)})"
    elif len(dumped) > 1:
        text += " (every rank)" if not without else \
            f" (every rank with a dump of step {_step(step)})"
    if without:
        text += (f"; rank {_ranks_text(without)} {'has' if len(without) == 1 else 'have'} no "
                 f"dump of step {_step(step)}")
    return text


def to_json(r: DumpVerdict) -> dict[str, Any]:
    """``{"findings": [...], "checked": N, "skipped_ops": [...]}``, and what was read."""
    return {
        "findings": [{
            "op": f.op, "argument": f.argument, "rule": f.rule, "expected": f.expected,
            "got": f.got, "api": f.api, "step": f.step, "rank": f.ranks, "verdict": f.verdict,
            "depends_on": list(f.depends_on), "rejected_on": f.on, "calls": f.calls, "call_site": f.call_site,
            "source": f.source, "fix": f.fix,
        } for f in r.findings],
        "checked": r.checked,
        "skipped_ops": sorted(r.skipped),
        "ops": dict(sorted(r.ops.items())),
        "backward_entries": r.backward,
        "not_judged": [{"op": n.op, "argument": None if n.argument == "-" else n.argument,
                        "why": n.why, "calls": n.calls, "api": n.api}
                       for n in sorted(r.unjudged.values(),
                                       key=lambda n: (n.op, n.argument, n.why))],
        "not_judged_calls": r.not_judged_calls,
        "judged_nothing": r.judged_nothing,
        "files": r.files,
        "steps": r.steps,
        "ranks": r.ranks,
        "ranks_by_step": [{"step": st, "ranks": rk} for st, rk in sorted(
            r.step_ranks.items(), key=lambda kv: -1 if kv[0] is None else kv[0])],
        "stacks": [{"label": label, **{n: getattr(env, n) for n in ("torch_npu", "cann", "soc")}}
                   for label, env in zip(r.stacks.labels(), r.stacks.envs)],
    }
