"""``opcontracts wheel verify``: every contract against every torch_npu release its ``when``
covers, from the real wheels or from a digest.

Per contract and release (releases with byte-identical docs and the same outcome are one group):

* the op is in the release's schema (``custom`` section) and every ``torch_npu.X`` /
  ``torch.ops.npu.X`` target is bound (``custom_ops.py``); every contract argument is in the
  schema; ``optional`` agrees with ``Tensor?``, ``list`` with ``Tensor[]``; the contract's
  ``signature`` has the schema's positional order and its keyword-only arguments after them;
* dtypes per argument against the docstring: (a) allowed by the contract, not listed by the doc;
  (b) listed by the doc, forbidden by the contract; (c) a false alarm: (b) on a contract whose
  ``when`` is decided by the torch_npu version alone (no CANN / chip / MindSpeed condition, or
  only ones every value meets), so strict mode rejects, on that release, a call the release
  documents; (d) not verifiable (no statement found), with the reason;
* ranks and dtypes against the meta kernel's ``torch._check`` calls (a rank or dtype the contract
  allows and the meta kernel rejects is an error, like (a)); its output dtypes are shown.

Per release, the routes of the contracted MoE token ops (``structure``): where a release reaches
a contracted op's kernel through another op (2.13's ``_npu_moe_token_unpermute``, the
``_grad_v2`` backward kernels its C++ nodes call), that op needs a contract covering the release
(``unguarded-route``, failing): a guard on the public name alone misses it.  Contracts with
``rules_of`` are verified as the contracts they take (``_engine.derive``).

``doc_conflict = "why"`` on an argument marks a deliberate disagreement with the doc: (a), (b)
and (c) on it are reported as marked and do not fail.  Exit status 1 when anything fails: an
unmarked (a) or (c), a missing op, target or argument, a schema disagreement, a meta-kernel
rejection.  MindSpeed contracts (``mindspeed.*`` ops), fla_npu's (``fla_npu.*``) and the ATB
plugin's (``atb.*``: torch.ops.atb, whose schemas the wheel's yaml files do not hold) are
reported as "not a torch_npu op".
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .._lang.shapes import parse_shape
from .._lang.versions import Env, applies, satisfies
from ._meta import MAX_RANK
from .digest import Digest, Release

if TYPE_CHECKING:
    from ..spec import Arg, Contract, When

__all__ = ["Finding", "Group", "ContractResult", "verify", "version_only", "render",
           "to_json", "summary"]

_PROBES = ("0.1", "1.0", "7.0.0", "8.0rc1", "8.0rc3", "8.0.0", "8.1.0", "9.0", "99.0")
_FAILING = {"missing-op", "missing-target", "missing-arg", "optional", "list", "order",
            "kw-only", "a", "c", "meta-rank", "meta-dtype", "unguarded-route"}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
_EXPRESSIBLE = {"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
                "int64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"}


@dataclass
class Finding:
    kind: str
    """missing-op, missing-target, missing-arg, optional, list, order, kw-only, a, b, c, d,
    meta-rank, meta-dtype, unguarded-route, unchecked, note"""
    arg: str | None
    text: str
    marked: str | None = None
    """the argument's ``doc_conflict`` when it marks this finding"""

    @property
    def fails(self) -> bool:
        return self.kind in _FAILING and self.marked is None


@dataclass
class Row:
    arg: str
    contract: str
    doc: str
    meta: str
    verdict: str


@dataclass
class Group:
    versions: list[str]
    docs: str | None
    rows: list[Row] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    @property
    def fails(self) -> bool:
        return any(f.fails for f in self.findings)


@dataclass
class ContractResult:
    op: str
    file: str | None
    source: str | None
    when: str
    version_only: bool
    skipped: str | None = None
    groups: list[Group] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)

    @property
    def fails(self) -> bool:
        return any(g.fails for g in self.groups)


def _dt(names: Iterable[str]) -> str:
    return "/".join(_SHORT.get(n, n) for n in names) or "-"


def when_text(when: When | None) -> str:
    if when is None:
        return "no when (every release)"
    parts = []
    for name in ("torch_npu", "cann", "mindspeed", "torch", "soc"):
        v = getattr(when, name)
        if v:
            parts.append(f"soc {' or '.join(v)}" if name == "soc" else f"{name} {v}")
    return ", ".join(parts)


def version_only(when: When | None) -> bool:
    """Whether ``when`` is decided by the torch_npu (and torch) version alone: no CANN, chip or
    MindSpeed condition, or only ones that every probed version meets (``cann = ">=0"``)."""
    if when is None:
        return True
    if when.soc:
        return False
    for name in ("cann", "mindspeed"):
        spec = getattr(when, name)
        if spec and not all(satisfies(p, spec) for p in _PROBES):
            return False
    return True


def _is_torch_npu(c: Contract) -> bool:
    if c.op.startswith(("mindspeed.", "fla_npu.", "atb.")):  # not in the wheel's schema files
        return False
    return any(t.startswith(("torch_npu.", "torch.ops.npu.")) for t in c.targets) or not c.targets


def _allowed(c: Contract, name: str, seen: frozenset[str] = frozenset()) -> set[str] | None:
    """The dtypes the contract lets through for ``name`` (its own list, or its partner's for
    ``same_dtype_as``, with the exceptions), or None when it has no dtype rule."""
    a = c.args[name]
    if a.dtype:
        return set(a.dtype).union(*(a.dtype_if_present or {}).values())
    if a.same_dtype_as and a.same_dtype_as in c.args and a.same_dtype_as not in seen:
        base = _allowed(c, a.same_dtype_as, seen | {name})
        if base is not None:
            for extra in (a.same_dtype_except or {}).values():
                base |= set(extra)
            return base
    return None


def _contract_ranks(a: Arg) -> set[int] | None:
    out: set[int] | None = None
    if a.rank:
        out = set(a.rank)
    if a.shape:
        shape_ranks: set[int] = set()
        for s in a.shape:
            spec = parse_shape(s)
            if spec.has_ellipsis:
                shape_ranks |= set(range(spec.fixed_rank, MAX_RANK + 1))
            else:
                shape_ranks.add(spec.fixed_rank)
        out = shape_ranks if out is None else out & shape_ranks
    return out


def _ranks_text(r: Iterable[int]) -> str:
    rs = sorted(r)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return "/".join(map(str, rs)) or "none"


def _doc_for(r: Release, op: str) -> tuple[Any, str]:
    """The op's docstring, or, for a backward op without one (``X_grad``, ``X_backward``,
    ``X_grad_v2``), the forward op's: the contracts of backward ops cite it, and their kernels follow it."""
    doc = r.docs.get(op)
    if doc is None:
        import re

        # X_grad, X_backward, and a versioned X_grad_v2 -> X_v2
        m = re.fullmatch(r"(.+?)_(?:grad|backward)(_v\d+)?", op)
        fwd = m.group(1) + (m.group(2) or "") if m else None
        if fwd is not None and fwd in r.docs:
            return r.docs[fwd], fwd
    return doc, op


def _check_release(c: Contract, r: Release) -> tuple[list[Row], list[Finding], list[str]]:
    rows: list[Row] = []
    out: list[Finding] = []
    s = r.schema(c.op)
    if s is None:
        out.append(Finding("missing-op", None, f"torch.ops.npu.{c.op} is not in this release's "
                           "schema (npu_native_functions_by_codegen.yaml, custom section)"))
        return rows, out, []
    for t in c.targets:
        parts = t.split(".")
        if parts[0] == "torch_npu" and len(parts) == 2:
            if not r.bound(parts[1]):
                out.append(Finding("missing-target", None, f"{t} is not bound in "
                                   "torch_npu/utils/custom_ops.py"))
        elif parts[:3] == ["torch", "ops", "npu"] and len(parts) == 4:
            if parts[3] not in r.schemas:
                out.append(Finding("missing-target", None, f"{t}: no such op in the schema"))
    # signature: the schema's order for the names both have; keyword-only ones last
    if c.signature is not None:
        names = list(s.names)
        kwset = {p.name for p in s.params if p.kw_only}
        sig = list(c.signature)
        common = [n for n in sig if n in names]
        pos_sig = [n for n in common if n not in kwset]
        pos_schema = [n for n in names if n in common and n not in kwset]
        if pos_sig != pos_schema:
            out.append(Finding("order", None, f"signature order ({', '.join(pos_sig)}) differs "
                               f"from the schema's ({', '.join(pos_schema)})"))
        else:
            first_kw = next((i for i, n in enumerate(common) if n in kwset), len(common))
            late = [n for n in common[first_kw:] if n not in kwset]
            if late:
                out.append(Finding("kw-only", None, f"signature puts keyword-only "
                                   f"'{common[first_kw]}' before positional {', '.join(late)}"))
        extra = [n for n in sig if n not in names]
        lacking = [n for n in names if n not in sig]
        if extra or lacking:
            text = "signature differs from the schema in names (it is only a fallback for "
            text += "targets whose signature cannot be read)"
            if extra:
                text += f"; not in this release: {', '.join(extra)}"
            if lacking:
                text += f"; not in the signature: {', '.join(lacking)}"
            out.append(Finding("note", None, text))
    doc, doc_op = _doc_for(r, c.op)
    if doc is not None and doc_op != c.op:
        out.append(Finding("note", None, f"no docstring of its own: dtypes read from the doc of "
                           f"{doc_op} (the forward op) for the arguments they share"))
    meta_ranks, meta_cond = r.meta_ranks(c.op)
    meta_dtypes = r.meta_dtypes(c.op)
    for name, a in c.args.items():
        p = s.param(name)
        if p is None:
            out.append(Finding("missing-arg", name, f"'{name}' is not an argument of "
                               f"{c.op} in this release ({', '.join(s.names)})"))
            rows.append(Row(name, "-", "-", "-", "missing"))
            continue
        if a.optional and not p.nullable and not p.has_default:
            out.append(Finding("optional", name, f"the contract allows None, the schema says "
                               f"'{p.text()}'"))
        if p.is_tensor and p.nullable and not a.optional and a.is_tensor:
            out.append(Finding("optional", name, f"the schema takes None ('{p.text()}'), the "
                               "contract rejects it: add optional = true"))
        if a.tensor_list and not p.is_list:
            out.append(Finding("list", name, f"list = true, but the schema says '{p.text()}'"))
        if p.is_tensor and p.is_list and not a.tensor_list and a.is_tensor and \
                (a.dtype or a.shape or a.rank):
            out.append(Finding("list", name, f"the schema takes a list ('{p.text()}'): add "
                               "list = true"))
        if not a.is_tensor or not p.is_tensor:
            rows.append(Row(name, "(not a tensor)", "-", "-", "-"))
            continue
        allowed = _allowed(c, name)
        ad = doc.args.get(name) if doc is not None else None
        documented: set[str] | None = set(ad.dtypes) if ad is not None and ad.dtypes else None
        cond = bool(ad and any(st.condition for st in ad.statements))
        verdict = "ok"
        marked = a.doc_conflict
        if documented is None:
            if doc is None:
                why = "the op has no docstring in this release"
            elif ad is None:
                why = "the argument has no entry in the docstring"
            else:
                why = ad.why or "no dtype statement"
            if allowed is not None:
                out.append(Finding("d", name, f"not verifiable: {why}"))
                verdict = "unverifiable"
        elif allowed is None:
            out.append(Finding("unchecked", name, f"the contract has no dtype rule; the doc "
                               f"lists {_dt(sorted(documented))}"))
            verdict = "no rule"
        else:
            extra = sorted(allowed - documented)
            forbidden = sorted(documented - allowed)
            where = (ad.line if ad else "")[:120]
            if extra:
                out.append(Finding("a", name, f"allows {_dt(extra)}, which the doc does not "
                                   f"list ({_dt(sorted(documented))}): {where}", marked))
                verdict = "(a)"
            if forbidden:
                inexpressible = [d for d in forbidden if d not in _EXPRESSIBLE]
                text = (f"the doc lists {_dt(forbidden)}, which the contract forbids"
                        + (" (per chip or scenario)" if cond else "")
                        + (f" ({_dt(inexpressible)}: no contract can name it)" if inexpressible
                           else "") + f": {where}")
                kind = "c" if version_only(c.when) else "b"
                out.append(Finding(kind, name, text, marked))
                verdict = (verdict + " " if extra else "") + f"({kind})"
            if marked and (extra or forbidden):
                verdict += " marked"
        # meta kernel
        meta_text = "-"
        cr = _contract_ranks(a)
        mr = meta_ranks.get(name)
        if mr is not None:
            meta_text = "rank " + _ranks_text(mr)
            if cr is not None:
                rejected = sorted(cr - set(mr))
                if rejected:
                    out.append(Finding("meta-rank", name, f"the contract allows rank "
                                       f"{_ranks_text(rejected)}; the meta kernel's torch._check "
                                       f"demands {_ranks_text(mr)}"))
                    verdict += " rank!"
        elif name in meta_cond:
            meta_text = "rank " + _ranks_text(meta_cond[name]) + " (conditional)"
        md = meta_dtypes.get(name)
        if md:
            meta_text += " " + _dt(md)
            if allowed is not None:
                rej = sorted(allowed - set(md))
                if rej:
                    out.append(Finding("meta-dtype", name, f"the contract allows {_dt(rej)}; the "
                                       f"meta kernel's torch._check accepts {_dt(md)}"))
                    verdict += " dtype!"
        doc_text = _dt(sorted(documented)) if documented else "?"
        if documented and cond:
            doc_text += "*"
        if ad is not None and ad.same_as:
            doc_text += f" (=dtype of {ad.same_as})"
        rows.append(Row(name, _dt(sorted(allowed)) if allowed else "any", doc_text,
                        meta_text, verdict))
    outputs = [o or "?" for o in r.meta_outputs(c.op)]
    return rows, out, outputs


def verify(contracts: Sequence[Contract], digest: Digest,
           versions: Iterable[str] | None = None, op: str | None = None, *,
           routes: bool = False) -> list[ContractResult]:
    """Check ``contracts`` against the releases of ``digest`` (or ``versions`` of it); ``op``:
    only ops matching this glob pattern; ``routes``: also fail where a release reaches a
    contracted op's kernel through an op none of ``contracts`` covers (``unguarded-route``:
    meant for a complete set, such as the shipped packs with a user's contracts)."""
    chosen = digest.versions if versions is None else [digest.release(v).version for v in versions]
    derived_from = {c.op for c in contracts if c.rules_of}
    contracts = _expanded(contracts)
    results = []
    for c in contracts:
        if op and not fnmatch.fnmatchcase(c.op, op):
            continue
        res = ContractResult(c.op, c.file, c.source, when_text(c.when), version_only(c.when))
        results.append(res)
        if not _is_torch_npu(c):
            res.skipped = ("not a torch_npu op (MindSpeed's and fla_npu's ops are not in the "
                           "wheel, ATB's plugin ops not in its schema files)")
            continue
        by_key: dict[str, Group] = {}
        for v in chosen:
            r = digest.release(v)
            if applies(c.when, Env(torch_npu=v, torch=r.torch)) is False:
                res.not_covered.append(v)
                continue
            rows, findings, outputs = _check_release(c, r)
            key = json.dumps([r.file_id("docs"), [asdict(x) for x in rows],
                              [asdict(f) for f in findings], outputs])
            g = by_key.get(key)
            if g is None:
                g = by_key[key] = Group([], r.file_id("docs"), rows, findings, outputs)
                res.groups.append(g)
            g.versions.append(v)
        if not res.groups and c.op in derived_from:
            results.pop()  # a version of the other op's rules no release of this op has
    if routes:
        results.extend(_routes(contracts, digest, chosen, op))
    return results


def _expanded(contracts: Sequence[Contract]) -> list[Contract]:
    """``contracts`` with each ``rules_of`` one replaced by the contracts it takes."""
    from .._engine.derive import derive

    out: list[Contract] = []
    for c in contracts:
        out.extend(derive(c, [x for x in contracts if x.op == c.rules_of]) if c.rules_of else [c])
    return out


def _routes(contracts: Sequence[Contract], digest: Digest, chosen: Sequence[str],
            op: str | None) -> list[ContractResult]:
    """One failing result per op a release reaches a contracted op's kernel through, in the
    releases no contract of that op covers."""
    from .structure import structure

    def covered(name: str, env: Env) -> bool:
        return any(c.op == name and applies(c.when, env) is not False for c in contracts)

    missing: dict[tuple[str, str], list[str]] = {}
    for v in chosen:
        r = digest.release(v)
        env = Env(torch_npu=v, torch=r.torch)
        for public, reached in structure(v).routes().items():
            if not covered(public, env):
                continue
            for name in reached:
                if not covered(name, env) and not (op and not fnmatch.fnmatchcase(name, op)):
                    missing.setdefault((name, public), []).append(v)
    out = []
    for (name, public), vs in missing.items():
        res = ContractResult(name, None, None, "-", False)
        res.groups.append(Group(vs, None, findings=[Finding(
            "unguarded-route", None,
            f"these releases reach {public}'s kernel through {name} (internal op or the backward "
            f"kernel its C++ node calls), and no contract of {name} covers them: write one "
            f"(rules_of = {public!r} for the same kernel)")]))
        out.append(res)
    return out


# --------------------------------------------------------------------------- output
def summary(results: Sequence[ContractResult], n_versions: int) -> dict[str, Any]:
    checked = [r for r in results if r.skipped is None]
    pairs = [(r, g, f) for r in checked for g in r.groups for f in g.findings]

    def count(kind: str, failing: bool | None = None) -> int:
        return sum(len(g.versions) for _, g, f in pairs
                   if f.kind == kind and (failing is None or f.fails == failing))

    return {
        "contracts": len(results),
        "contracts_checked": len(checked),
        "ops_verified": len({r.op for r in checked if r.groups}),
        "skipped": [f"{r.op}: {r.skipped}" for r in results if r.skipped],
        "releases": n_versions,
        "false_alarms": count("c", True),
        "false_alarms_marked": count("c", False),
        "unmarked_a": count("a", True),
        "marked_a": count("a", False),
        "b": count("b"),
        "unverifiable": count("d"),
        "missing": sum(count(k) for k in ("missing-op", "missing-target", "missing-arg")),
        "schema": sum(count(k) for k in ("optional", "list", "order", "kw-only")),
        "meta": sum(count(k) for k in ("meta-rank", "meta-dtype")),
        "failing": sum(1 for r in checked if r.fails),
        "note": "counts are (finding x release) pairs",
    }


def to_json(results: Sequence[ContractResult], n_versions: int) -> dict[str, Any]:
    out = []
    for r in results:
        d = asdict(r)
        for g, gd in zip(r.groups, d["groups"]):
            for f, fd in zip(g.findings, gd["findings"]):
                fd["fails"] = f.fails
            gd["fails"] = g.fails
        d["fails"] = r.fails
        out.append(d)
    return {"summary": summary(results, n_versions), "contracts": out}


def _versions_text(vs: list[str]) -> str:
    return ", ".join(vs)


def render(results: Sequence[ContractResult], n_versions: int, *, verbose: bool = False) -> str:
    """The report as text: per contract, per group of releases, a table of its arguments and
    the findings (``!`` fails, ``~`` marked by doc_conflict, ``-`` information)."""
    lines: list[str] = []
    quiet = 0  # contracts that pass, left out without ``verbose``
    for r in results:
        if not verbose and not r.fails:
            quiet += 1
            continue
        head = f"{r.op}  [{r.when}]"
        if r.file:
            head += f"  {r.file.split('contracts/')[-1]}"
        lines.append(head)
        if r.skipped:
            lines.append(f"  skipped: {r.skipped}")
            lines.append("")
            continue
        if not r.groups:
            lines.append("  no release of the digest is covered by its when")
        for g in r.groups:
            status = "FAIL" if g.fails else "ok"
            docs = f" (docs {g.docs})" if g.docs else ""
            lines.append(f"  {status}  torch_npu {_versions_text(g.versions)}{docs}")
            if g.rows and (verbose or g.fails or any(f.kind in ("b", "d") for f in g.findings)
                           or len(r.groups) == 1):
                w = [max(len(x) for x in col) for col in zip(
                    *[("argument", "contract", "doc", "meta kernel", "")] +
                    [(x.arg, x.contract, x.doc, x.meta, x.verdict) for x in g.rows])]
                lines.append("      " + "  ".join(h.ljust(n) for h, n in zip(
                    ("argument", "contract", "doc", "meta kernel", ""), w)).rstrip())
                for x in g.rows:
                    lines.append("      " + "  ".join(v.ljust(n) for v, n in zip(
                        (x.arg, x.contract, x.doc, x.meta, x.verdict), w)).rstrip())
            for f in g.findings:
                mark = "!" if f.fails else ("~" if f.marked else "-")
                label = f"({f.kind})" if f.kind in ("a", "b", "c", "d") else f.kind
                text = f"    {mark} {label} {f.arg + ': ' if f.arg else ''}{f.text}"
                if f.marked:
                    text += f"  [doc_conflict: {f.marked}]"
                lines.append(text)
            if verbose and g.outputs:
                lines.append(f"    - outputs (meta kernel): {', '.join(g.outputs)}")
        if r.not_covered and verbose:
            lines.append(f"  not covered by its when: {_versions_text(r.not_covered)}")
        lines.append("")
    s = summary(results, n_versions)
    lines.append(
        f"{s['contracts_checked']} contract(s), {s['ops_verified']} torch_npu op(s), verified "
        f"against {n_versions} release(s); {len(s['skipped'])} skipped (not torch_npu ops)")
    lines.append(
        f"false alarms (c): {s['false_alarms']} ({s['false_alarms_marked']} more marked); "
        f"unmarked (a): {s['unmarked_a']} ({s['marked_a']} marked); (b): {s['b']}; "
        f"unverifiable (d): {s['unverifiable']}; missing: {s['missing']}; "
        f"schema: {s['schema']}; meta kernel: {s['meta']}  (finding x release)")
    if quiet:
        lines.append(f"({quiet} contract(s) that pass not shown: --verbose shows every contract, "
                     "table and finding)")
    lines.append(f"{s['failing']} contract(s) fail" if s["failing"] else "all contracts pass")
    return "\n".join(lines)
