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

Which contracts apply is decided for the versions given (``--torch-npu``, ``--cann``,
``--soc``), else what ``opcontracts env`` detects here.  A violation of a rule that only
contracts whose ``when`` needs a still unknown version make is *conditional*: reported with
the versions it depends on, never counted as a violation.  Findings are merged over ranks
(which ranks saw each), steps kept apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .._engine import registry as _registry
from .._engine.records import aligned
from .._lang import versions as _versions
from .._ranks.gather import _ranks_text
from ..errors import ContractViolation, OpContractsError, format_violation
from . import msprobe_dump as md

__all__ = ["Finding", "DumpVerdict", "Judge", "judged_calls", "check_path", "render",
           "to_json", "environment"]


# --------------------------------------------------------------------------- versions
def environment(*, torch_npu: str | None = None, cann: str | None = None,
                soc: str | None = None) -> _versions.Env:
    """The versions a dump is judged for: each flag given (``"unknown"`` forces unknown), else
    the detection of ``opcontracts env`` (``OPCONTRACTS_*_VERSION``, ``set_versions``, the
    packages and toolkit found here)."""
    # TODO(issue 23): the project's targets ([tool.opcontracts]) go between the two
    base = _versions.current()
    values: dict[str, Any] = {n: getattr(base, n) for n in _versions.FIELDS}
    origins = dict(base.origins)
    for name, flag in (("torch_npu", torch_npu), ("cann", cann), ("soc", soc)):
        if flag is None:
            continue
        text, option = flag.strip(), f"--{name.replace('_', '-')}"
        unknown = text.lower() == _versions.UNKNOWN
        if not text:
            raise OpContractsError(f"{option}: empty (give a value, or 'unknown')")
        if name != "soc" and not unknown and _versions.normalize_version(text) is None:
            example = "2.13.0" if name == "torch_npu" else "8.0.RC3"
            raise OpContractsError(f"{option} {flag!r}: not a version (try {example!r} or "
                                   "'unknown')")
        values[name] = None if unknown else text
        origins[name] = option
    return _versions.Env(**values, origins=tuple(origins.items()), emulated=base.emulated)


# --------------------------------------------------------------------------- judging
class Verdict(NamedTuple):
    kind: str
    """``violation``, or ``conditional``: a violation only if an unknown version is one the
    rule's contract names (``depends_on``)"""
    violation: ContractViolation
    depends_on: tuple[str, ...] = ()


class _Checkers(NamedTuple):
    sure: Any
    """compiled checker of the contracts that apply (merged strictest); None when none surely does"""
    full: Any
    """of every contract that may apply (the registry's own reading with versions unknown)"""
    maybe: tuple[Any, ...]
    """the contracts whose ``when`` needs an unknown version"""
    each: dict[int, Any]
    """id(contract in maybe) -> compiled checker of ``sure`` plus that one"""


class Unjudged(Exception):
    """A recorded call the checker cannot read (a dtype torch does not have here)."""


class Judge:
    """The verdicts on recorded calls for one environment: per op, the compiled checkers of
    the contracts that surely apply and of every one that may; per distinct recorded signature
    the verdicts, memoized (a dump repeats the same calls layer after layer)."""

    def __init__(self, env: _versions.Env) -> None:
        import torch

        self._torch = torch
        self.env = env
        self._checkers: dict[str, _Checkers] = {}
        self._verdicts: dict[tuple[Any, ...], list[Verdict]] = {}
        self._dtypes: dict[str, Any] = {}
        self._release: Any = None

    def _params(self, contract: Any, call: md.ApiCall) -> Any:
        """How positional inputs bind: for torch_npu's ops the schema in the shipped digest
        (of the release judged for, else the newest it has), the schema the emulation
        registers too; otherwise None (the contract's ``signature`` or argument order)."""
        if call.prefix != "NPU":
            return None
        from .._engine.enforce import _schema_params
        from ..wheel import digest

        if self._release is None:
            d = digest.load()
            v = self.env.torch_npu
            self._release = d.release(v if v in d.versions else d.versions[-1])
        schema = self._release.schema(call.api)
        if schema is None:
            return None
        try:
            return _schema_params(self._torch._C.parse_schema(schema.func))
        except RuntimeError:  # a schema torch cannot parse: the contract's own order
            return None

    def checkers(self, op: str, call: md.ApiCall) -> _Checkers:
        got = self._checkers.get(op)
        if got is not None:
            return got
        from .._engine.enforce import compiled_for

        sure, maybe = [], []
        for c in _registry.candidates(op):
            ok = _versions.applies(c.when, self.env)
            if ok:
                sure.append(c)
            elif ok is None:
                maybe.append(c)

        def compiled(items: list[Any]) -> Any:
            if not items:
                return None
            c = items[0] if len(items) == 1 else _registry.merge_contracts(items)
            params = self._params(c, call)
            try:
                return compiled_for(c, params)
            except OpContractsError:
                if params is None:
                    raise
                # the contract names an argument the digest's schema lacks (another release):
                # its own signature binds as well as a guard on a generic wrapper does
                return compiled_for(c, None)

        got = _Checkers(compiled(sure), compiled(sure + maybe), tuple(maybe),
                        {id(m): compiled(sure + [m]) for m in maybe} if sure or len(maybe) > 1
                        else {})
        self._checkers[op] = got
        return got

    def names(self, op: str, call: md.ApiCall) -> list[str]:
        """The parameter names positional inputs bind to."""
        cc = self.checkers(op, call).full
        return [p.name for p in cc.params] if cc is not None else []

    def _dtype(self, name: str) -> Any:
        if name not in self._dtypes:
            dt = getattr(self._torch, name.removeprefix("torch."), None)
            self._dtypes[name] = dt if isinstance(dt, self._torch.dtype) else None
        return self._dtypes[name]

    def _live(self, v: Any) -> Any:
        if isinstance(v, md.TensorMeta):
            dt = self._dtype(v.dtype)
            if dt is None:
                raise Unjudged(f"dtype {v.dtype} is not a torch dtype here")
            return self._torch.empty(v.shape, dtype=dt, device="meta")
        if isinstance(v, list):
            return [self._live(x) for x in v]
        return v

    def arguments(self, call: md.ApiCall) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The recorded inputs as the checker takes them: meta tensors for tensors."""
        return (tuple(self._live(a) for a in call.args),
                {k: self._live(v) for k, v in call.kwargs.items()})

    def judge(self, op: str, call: md.ApiCall) -> list[Verdict]:
        """The call's verdicts: the violation of the contracts that surely apply, and a
        conditional one when the contracts that may apply make a rule those do not.
        ``Unjudged`` / ``TypeError`` (inputs that do not bind) when it cannot be judged."""
        key = (op, call.prefix, _sig(call.args), _sig(call.kwargs))
        hit = self._verdicts.get(key)
        if hit is not None:
            return hit
        ch = self.checkers(op, call)
        args, kwargs = self.arguments(call)
        out: list[Verdict] = []
        definite = _explain(ch.sure, args, kwargs)
        if definite is not None:
            out.append(Verdict("violation", definite))
        possible = _explain(ch.full, args, kwargs)
        if possible is not None and (definite is None or not _same(possible, definite)):
            # the may-apply contracts that make the rule: the versions the verdict depends on
            deps = [m for m in ch.maybe if m is not None and (
                ch.each.get(id(m)) is None
                or _same_or_none(_explain(ch.each[id(m)], args, kwargs), possible))]
            out.append(Verdict("conditional", possible, tuple(dict.fromkeys(
                _versions.explain(m.when, self.env) for m in deps or ch.maybe))))
        self._verdicts[key] = out
        return out


def _sig(values: Any) -> Any:
    """A hashable key of recorded arguments."""
    if isinstance(values, (list, tuple)):
        return tuple(_sig(v) for v in values)
    if isinstance(values, dict):
        return tuple(sorted((k, _sig(v)) for k, v in values.items()))
    return values


def _same(a: ContractViolation, b: ContractViolation) -> bool:
    return (a.arg, a.rule, a.expected) == (b.arg, b.rule, b.expected)


def _same_or_none(a: ContractViolation | None, b: ContractViolation) -> bool:
    return a is not None and _same(a, b)


def _explain(cc: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ContractViolation | None:
    """The checker's verdict, unless the rule fell on a value msprobe recorded in a form no
    rule can read (a process group, a device): that is no finding."""
    if cc is None:
        return None
    from .._engine.enforce import explain_call

    v = explain_call(cc, args, kwargs)
    if v is None:
        return None
    names = [p.name for p in cc.params]
    name = (v.arg or "").split("[", 1)[0]
    value = kwargs.get(name) if name in kwargs else (
        args[names.index(name)] if name in names and names.index(name) < len(args) else None)
    return None if isinstance(value, md.Opaque) else v


class Judged(NamedTuple):
    dump: md.RankDump
    call: md.ApiCall
    op: str | None
    """the contract op, None for an API without one"""
    verdicts: list[Verdict] | None
    """None for a call not judged: a backward entry, or one the checker cannot read"""
    why: str | None = None
    """why a forward call of an op with a contract was not judged"""


def judged_calls(dumps: list[md.RankDump], judge: Judge) -> Iterator[Judged]:
    """Every recorded call with its op and verdicts.  Value checks are off meanwhile (the
    engine's one switch, ``set_value_checks``: process-wide, so a job's own guards in other
    threads would skip theirs too; this is a command-line tool's loop)."""
    from .._lang import values as _values

    _registry.load_shipped()
    index = md.ApiIndex(_registry.all_contracts())
    prev = _values.set_value_checks(False)  # statistics are not values: value rules skipped
    try:
        for d in dumps:
            for call in d.calls:
                op = index.op_for(call)
                if op is None or call.direction != "forward":
                    yield Judged(d, call, op, None)
                    continue
                if not call.inputs:
                    yield Judged(d, call, op, None, "inputs not recorded (msprobe's data_mode)")
                    continue
                try:
                    yield Judged(d, call, op, judge.judge(op, call))
                except (Unjudged, TypeError) as exc:
                    yield Judged(d, call, op, None, str(exc))
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
    ranks: list[int] = field(default_factory=list)
    calls: int = 0
    source: str | None = None
    fix: str | None = None

    def key(self) -> tuple[Any, ...]:
        return (self.step, self.verdict, self.op, self.argument, self.rule, self.expected,
                self.got, self.call_site)


@dataclass
class DumpVerdict:
    """What ``check-dump`` found in PATH."""

    path: str
    files: list[str]
    steps: list[int | None]
    ranks: list[int]
    env: _versions.Env
    checked: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    """contract op -> calls judged"""
    skipped: dict[str, int] = field(default_factory=dict)
    """msprobe API (``Tensor.__mul__``) -> calls skipped: PyTorch's own, or without contract"""
    backward: int = 0
    unjudged: dict[str, str] = field(default_factory=dict)
    """msprobe API name -> why it could not be judged"""
    findings: list[Finding] = field(default_factory=list)

    @property
    def violations(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict == "violation"]


def check_path(path: str | Path, env: _versions.Env) -> DumpVerdict:
    """Read and judge every ``dump.json`` PATH stands for (``msprobe_dump.find_rank_dumps``);
    ``msprobe_dump.DumpError`` when PATH is not an msprobe dump."""
    files = md.find_rank_dumps(path)
    dumps = [md.read_rank_dump(f) for f in files]
    steps = sorted({d.step for d in dumps}, key=lambda s: -1 if s is None else s)
    out = DumpVerdict(str(path), [str(f) for f in files], steps,
                      sorted({d.rank for d in dumps if d.rank is not None}), env)
    merged: dict[tuple[Any, ...], Finding] = {}
    for j in judged_calls(dumps, Judge(env)):
        if j.verdicts is None:
            if j.op is None:
                # an API as msprobe names it without its count; module entries by their kind
                label = f"{j.call.prefix}.{j.call.api}" if j.call.direction else j.call.prefix
                out.skipped[label] = out.skipped.get(label, 0) + 1
            elif j.why is None:
                out.backward += 1
            else:
                out.unjudged.setdefault(j.call.name, j.why)
            continue
        assert j.op is not None
        out.checked += 1
        out.ops[j.op] = out.ops.get(j.op, 0) + 1
        for v in j.verdicts:
            _add(merged, j.dump, j.call, v)
    out.findings = sorted(merged.values(), key=lambda f: (
        -1 if f.step is None else f.step, f.verdict != "violation", f.op, f.argument or "",
        f.rule))
    return out


def _add(merged: dict[tuple[Any, ...], Finding], d: md.RankDump, call: md.ApiCall,
         v: Verdict) -> None:
    e, site = v.violation, d.frames.get(call.name)
    f = Finding(e.op, e.arg, e.rule, e.expected, e.got, call.name, d.step, site,
                format_violation(op=e.op, arg=e.arg, rule=e.rule, expected=e.expected,
                                 actual=e.actual, bindings=e.bindings, call_site=site,
                                 source=e.source, fix=e.fix),
                v.kind, v.depends_on, source=e.source, fix=e.fix)
    old = merged.setdefault(f.key(), f)
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
    if not r.checked:
        why = ("no forward call of an op with a contract could be judged" if r.unjudged else "no recorded forward call is of an op with a "
               "contract")
        lines.append(f"nothing was checked: {why}; skipped {skipped}")
    else:
        ops = ", ".join(f"{op} x{c}" for op, c in sorted(r.ops.items()))
        lines.append(f"checked {r.checked} call(s) of {len(r.ops)} op(s) with a contract: {ops}")
        lines.append(f"  skipped {skipped}; {r.backward} backward entr"
                     f"{'y' if r.backward == 1 else 'ies'} of those ops (gradients: not judged)")
    if r.unjudged:
        lines.append(f"  not judged: {len(r.unjudged)} API(s): " + "; ".join(
            f"{k} ({why})" for k, why in list(r.unjudged.items())[:5]))
    lines.append("  versions: " + ", ".join(
        f"{n} {getattr(r.env, n) or 'unknown'}" + (f" ({r.env.origin(n)})" if getattr(r.env, n)
                                                   else "")
        for n in ("torch_npu", "cann", "soc")))
    viol = r.violations
    cond = [f for f in r.findings if f.verdict == "conditional"]
    if r.checked:
        lines += ["", f"{len(viol)} contract violation(s)" if viol else "no contract violations."]
    if viol:
        lines += ["", *_table(viol), "", "per violation, the ranks that saw it:"]
        lines += [f"  step {_step(f.step)}: {f.op}: {f.argument or '-'} {f.rule} at "
                  f"{f.call_site or f.api}: {_seen(f.ranks, r.ranks)}" for f in viol]
    if cond:
        lines += ["", f"{len(cond)} conditional finding(s): violations if a version not known "
                  "here is one the rule is for (give it: --torch-npu, --cann, --soc)",
                  "", *_table(cond)]
    if r.findings:
        lines += ["", "first message of each:"]
        shown: set[str] = set()
        for f in r.findings:
            if f.message in shown:
                continue
            shown.add(f.message)
            lines += ["  " + ln for ln in f.message.splitlines()]
            lines += [f"    depends on: {d}" for d in f.depends_on]
    return "\n".join(lines)


def _table(items: list[Finding]) -> list[str]:
    rows = [("step", "op", "arg", "rule", "expected", "got", "ranks", "calls", "api",
             "call site")]
    for f in items:
        rows.append((_step(f.step), f.op, f.argument or "-", f.rule, f.expected, f.got,
                     _ranks_text(f.ranks) if f.ranks else "-", str(f.calls), f.api,
                     f.call_site or "-"))
    return aligned(rows)


def _seen(seen: list[int], ranks: list[int]) -> str:
    if not seen:
        return "rank unknown"
    missing = [k for k in ranks if k not in seen]
    text = f"rank{'s' if len(seen) > 1 else ''} {_ranks_text(seen)}"
    if missing:
        return f"{text} only (not rank {_ranks_text(missing)})"
    return text + (" (every rank)" if len(ranks) > 1 else "")


def to_json(r: DumpVerdict) -> dict[str, Any]:
    """``{"findings": [...], "checked": N, "skipped_ops": [...]}``, and what was read."""
    return {
        "findings": [{
            "op": f.op, "argument": f.argument, "rule": f.rule, "expected": f.expected,
            "got": f.got, "api": f.api, "step": f.step, "rank": f.ranks, "verdict": f.verdict,
            "depends_on": list(f.depends_on), "calls": f.calls, "call_site": f.call_site,
            "source": f.source, "fix": f.fix,
        } for f in r.findings],
        "checked": r.checked,
        "skipped_ops": sorted(r.skipped),
        "ops": dict(sorted(r.ops.items())),
        "backward_entries": r.backward,
        "not_judged": r.unjudged,
        "files": r.files,
        "steps": r.steps,
        "ranks": r.ranks,
        "versions": {n: getattr(r.env, n) for n in ("torch_npu", "cann", "soc")},
    }
