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
never counted as a violation.  Findings are merged over ranks (which ranks saw each), steps
kept apart.
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["Stacks", "Verdict", "Judge", "Judged", "Finding", "DumpVerdict", "environment",
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


class Unjudged(Exception):
    """A recorded call the checker cannot read (a dtype torch does not have here)."""


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
        self._verdicts: dict[tuple[Any, ...], list[Verdict]] = {}
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
        """The call's verdicts (none, or one).  ``Unjudged`` / ``TypeError`` (inputs that do
        not bind to the parameters) when it cannot be judged."""
        key = (op, call.prefix, _sig(call.args), _sig(call.kwargs))
        hit = self._verdicts.get(key)
        if hit is not None:
            return hit
        from .._engine.enforce import compiled_for, explain_call

        res = self.resolution(op)
        out: list[Verdict] = []
        if res.strict is not None:
            params = self.params(op, call)
            args, kwargs = self.arguments(call)
            strict = compiled_for(res.strict, params)
            if explain_call(strict, args, kwargs) is not None:  # TypeError: does not bind
                out = self._readings(res, params, args, kwargs)
        self._verdicts[key] = out
        return out

    def _readings(self, res: Resolution, params: list[Param], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> list[Verdict]:
        from .._engine.enforce import compiled_for, explain_call

        v = res.judge(params, args, kwargs, compiled_for)
        on: str | None = None
        depends: tuple[str, ...] = ()
        if v is None:  # the readings cannot judge the call: the strict verdict stands
            assert res.strict is not None
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
            return []
        exc = explain_call(compiled_for(contract, params), args, kwargs)
        if exc is None or _opaque(exc, params, args, kwargs):
            return []
        return [Verdict("conditional" if v is not None and v.decided is None else "violation",
                        exc, depends, on)]


def _sig(values: Any) -> Any:
    """A hashable key of recorded arguments."""
    if isinstance(values, (list, tuple)):
        return tuple(_sig(v) for v in values)
    if isinstance(values, dict):
        return tuple(sorted((k, _sig(v)) for k, v in values.items()))
    return values


def _opaque(exc: ContractViolation, params: list[Param], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> bool:
    """Whether the rule fell on a value msprobe recorded in a form no rule reads (a process
    group, a device): that is no finding."""
    names = [p.name for p in params]
    name = (exc.arg or "").split("[", 1)[0]
    if name in kwargs:
        return isinstance(kwargs[name], md.Opaque)
    i = names.index(name) if name in names else len(args)
    return i < len(args) and isinstance(args[i], md.Opaque)


class Judged(NamedTuple):
    dump: md.RankDump
    call: md.ApiCall
    op: str | None
    """the contract op, None for an API without one"""
    verdicts: list[Verdict] | None
    """None for a call not judged: a backward entry, or one the checker cannot read"""
    why: str | None = None
    """why a forward call of an op with a contract was not judged"""


def judged_calls(dumps: list[md.RankDump], judge: Judge) -> list[Judged]:
    """Every recorded call with its op and verdicts.  Value checks are off meanwhile (the
    engine's one switch, ``set_value_checks``: process-wide, so a job's own guards in other
    threads would skip theirs too meanwhile; this is a command-line tool's loop)."""
    from .._lang import values as _values

    _registry.load_shipped()
    index = md.ApiIndex(_registry.all_contracts())
    out: list[Judged] = []
    prev = _values.set_value_checks(False)  # statistics are not values: value rules skipped
    try:
        for d in dumps:
            for call in d.calls:
                op = index.op_for(call)
                if op is None or call.direction != "forward":
                    out.append(Judged(d, call, op, None))
                elif not call.inputs:
                    out.append(Judged(d, call, op, None,
                                      "inputs not recorded (msprobe's data_mode)"))
                else:
                    try:
                        verdicts = judge.judge(op, call)
                    except (Unjudged, TypeError) as exc:  # TypeError: inputs that do not bind
                        out.append(Judged(d, call, op, None, str(exc)))
                    else:
                        out.append(Judged(d, call, op, verdicts))
    finally:
        _values.set_value_checks(prev)
    return out


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
class DumpVerdict:
    """What ``check-dump`` found in PATH."""

    path: str
    files: list[str]
    steps: list[int | None]
    ranks: list[int]
    stacks: Stacks
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


def check_path(path: str | Path, stacks: Stacks) -> DumpVerdict:
    """Read and judge every ``dump.json`` PATH stands for (``msprobe_dump.find_rank_dumps``);
    ``msprobe_dump.DumpError`` when PATH is not an msprobe dump."""
    files = md.find_rank_dumps(path)
    dumps = [md.read_rank_dump(f) for f in files]
    steps = sorted({d.step for d in dumps}, key=lambda s: -1 if s is None else s)
    out = DumpVerdict(str(path), [str(f) for f in files], steps,
                      sorted({d.rank for d in dumps if d.rank is not None}), stacks)
    merged: dict[tuple[Any, ...], Finding] = {}
    for j in judged_calls(dumps, Judge(stacks)):
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
                v.kind, v.depends_on, v.on, source=e.source, fix=e.fix)
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
    for label, env in zip(r.stacks.labels(), r.stacks.envs):
        lines.append(f"  judged for {label}: " + ", ".join(
            f"{n} {getattr(env, n) or 'unknown'}" for n in ("torch_npu", "cann", "soc")))
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
            "depends_on": list(f.depends_on), "rejected_on": f.on, "calls": f.calls, "call_site": f.call_site,
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
        "stacks": [{"label": label, **{n: getattr(env, n) for n in ("torch_npu", "cann", "soc")}}
                   for label, env in zip(r.stacks.labels(), r.stacks.envs)],
    }
