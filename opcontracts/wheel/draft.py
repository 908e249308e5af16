"""``opcontracts wheel draft``: draft TOML contracts for torch_npu ops that have none yet.

One file per op (``<op>.toml``): a draft is reviewed, finished and moved into a contract pack
one op at a time, and a file per op keeps that review (and its git history) per op.

From the schema: argument names and order (``signature``), ``optional`` (``Tensor?``),
``list`` (``Tensor[]``).  From the docstring: dtypes per argument (per-chip statements are
merged into their union, and say so), "same dtype as x" couplings (``same_dtype_as``), one
``shape (...)`` statement per argument when it parses as a shape string of the right rank,
ranks (``2维Tensor``), ``allowed = [false]`` for "only False is supported".  From the meta
kernel: ranks its ``torch._check`` calls demand (they win over the doc's).  Every rule carries
the doc line (or the meta kernel) it came from as a comment; what could not be read is listed as
``# TODO``.  The ``when`` table names the releases of the digest whose docstring entry and
schema for the op are the same as the drafted release's.

An op is drafted *completely* when every tensor argument has a dtype rule (arguments the doc
says must be None count as complete: there is no dtype to state), *partly* when some have, *not
at all* when none has.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._jsonout import replace_text
from ._docs import ArgDoc
from .digest import Digest, Release

__all__ = ["Draft", "draft_op", "draft_release", "summary_line", "write", "releases"]

_CONTRACT_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
                   "int8": "int8", "uint8": "uint8", "int16": "int16", "int32": "int32",
                   "int64": "int64", "bool": "bool", "complex64": "complex64",
                   "complex128": "complex128", "float8_e4m3fn": "float8_e4m3fn",
                   "float8_e5m2": "float8_e5m2"}
_SHAPE = re.compile(r"shape\s*(?:为|是|支持|要求为|需要为|：|:)?\s*[(\[（]([^()\[\]（）]{1,80})[)\]）]")
_DIM_OK = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$|^\d+$|^[A-Za-z0-9_]+(?:\s*(?:\*|\+|-|//)\s*[A-Za-z0-9_]+)+$")
_ONLY_FALSE = re.compile(r"(仅支持|只支持|当前仅支持|目前仅支持)\s*(?:为|设置为|取值为)?\s*(False|True)")


def _s(text: str) -> str:
    """A TOML basic string."""
    return json.dumps(text, ensure_ascii=False)


def _comment(text: str) -> str:
    """One line of a doc as a TOML comment: whitespace runs as one space, and a control
    character (which TOML forbids in a comment: the draft would not load) written as ``\\xNN``."""
    one = " ".join(text.split())
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in one)[:220]


@dataclass
class Draft:
    op: str
    version: str
    text: str
    tensors: int
    with_dtype: int
    todo: list[str] = field(default_factory=list)
    reserved: int = 0
    """tensor arguments the doc reserves (must be None): complete without a dtype"""

    @property
    def status(self) -> str:
        if self.tensors == 0 or self.with_dtype == self.tensors:
            return "complete"
        return "partly" if self.with_dtype else "not at all"


def _shape_of(arg: ArgDoc, rank: tuple[int, ...] | None) -> tuple[str, str] | None:
    """A shape string from the entry's one ``shape (...)`` statement, or None."""
    from .._lang.shapes import parse_shape

    found = []
    for line in [arg.line] + [s.line for s in arg.statements]:
        for m in _SHAPE.finditer(line):
            found.append((m.group(1), line))
    uniq = {f[0] for f in found}
    if len(uniq) != 1:
        return None
    inner, line = found[0]
    dims = [d.strip() for d in re.split(r"[,，]", inner) if d.strip()]
    if not dims or not all(_DIM_OK.match(d) for d in dims):
        return None
    text = " ".join(re.sub(r"\s+", "", d) for d in dims)
    try:
        spec = parse_shape(text)
    except ValueError:
        return None
    if rank is not None and spec.fixed_rank not in rank:
        return None
    return text, line


def _when(pool: Sequence[Release], r: Release, op: str) -> tuple[str, list[str]]:
    """Releases of ``pool`` (in version order) whose docstring entry and default schema for
    ``op`` match ``r``'s, as a ``torch_npu`` alternatives list of runs; a run that reaches the
    newest release is left open (``>=2.12.0.post3``)."""
    ref_doc = r.docs.get(op)
    ref_schema = r.schema(op)
    key = (json.dumps(ref_doc.to_json() if ref_doc else None, sort_keys=True),
           ref_schema.func if ref_schema else None)
    versions = [o.version for o in pool]
    same = []
    for o in pool:
        od, os_ = o.docs.get(op), o.schema(op)
        same.append((json.dumps(od.to_json() if od else None, sort_keys=True),
                     os_.func if os_ else None) == key)
    runs: list[tuple[str, str]] = []
    start = None
    for i, ok in enumerate(same):
        if ok and start is None:
            start = i
        if start is not None and (not ok or i == len(same) - 1):
            end = i if ok else i - 1
            runs.append((versions[start], versions[end]))
            start = None
    alts = []
    members = [v for v, ok in zip(versions, same) if ok]
    for a, b in runs:
        if b == versions[-1]:
            alts.append(f">={a}")
        elif a == b:
            alts.append(f"=={a}")
        else:
            alts.append(f">={a},<={b}")
    return "[" + ", ".join(_s(a) for a in alts) + "]", members


def draft_op(pool: Sequence[Release], r: Release, op: str) -> Draft:
    """The draft of one op of release ``r`` (``pool``: every release known, ``r`` among them,
    in version order: where the ``when`` table comes from)."""
    s = r.schema(op)
    if s is None:
        raise KeyError(f"{op} is not an op of torch_npu {r.version}")
    doc = r.docs.get(op)
    meta_ranks, _ = r.meta_ranks(op)
    when, members = _when(pool, r, op)
    lines: list[str] = []
    todo: list[str] = []
    head = [
        f"# DRAFT contract for torch.ops.npu.{op}, generated by `opcontracts wheel draft` from",
        f"# torch_npu {r.version} (docs {r.file_id('docs')}, schema {r.file_id('schema')}).",
        "# Review every rule against its doc line, finish the TODOs, then move it into a pack.",
        f"# schema: {_comment(s.func)}",
    ]
    if len(members) > 1:
        head.append(f"# the same doc entry and schema in: {', '.join(members)}")
    if doc is None:
        todo.append("the op has no docstring: no dtype can be drafted")
    else:
        for note in doc.notes:
            todo.append(f"doc: {note}")
        if doc.blocks > 1:
            head.append(f"# documented {doc.blocks} times: the last block (read at import) is used")
    outs = r.meta_outputs(op)
    if outs:
        head.append(f"# outputs (meta kernel): {', '.join(o or '?' for o in outs)}")
    sources = [f"torch_npu {r.version} wheel, torch_npu/_op_plugin_docs.py ({op})",
               "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"]
    if op in r.meta:
        sources.append("torch_npu/op_plugin/meta/_meta_registrations.py")
    lines += head + ["", "[[contract]]", f"op = {_s(op)}",
                     f"targets = [{_s('torch_npu.' + op)}, {_s('torch.ops.npu.' + op)}]"
                     if r.bound(op) else f"targets = [{_s('torch.ops.npu.' + op)}]",
                     f"when = {{torch_npu = {when}}}",
                     f"source = {_s(' + '.join(sources))}",
                     "signature = [" + ", ".join(_s(n) for n in s.names) + "]",
                     f"doc = {_s('DRAFT from torch_npu ' + r.version + ': review before use.')}"]
    tensors = with_dtype = reserved = 0
    body: list[str] = []
    for p in s.params:
        ad = doc.args.get(p.name) if doc is not None else None
        if not p.is_tensor:
            if p.base == "bool" and ad is None and doc is not None:
                ad = None
            rule = None
            if doc is not None and p.base == "bool":
                entry = doc.args.get(p.name)
                text = entry.line if entry else ""
                m = _ONLY_FALSE.search(text)
                if m:
                    rule = (f"allowed = [{m.group(2).lower()}]", text)
            if rule:
                body += ["", f"# doc: {_comment(rule[1])}", f"[contract.args.{p.name}]", rule[0]]
            continue
        tensors += 1
        arg: list[str] = []
        notes: list[str] = []
        if ad is not None and ad.reserved and not ad.dtypes:
            with_dtype += 1
            reserved += 1
            notes.append(f"# doc: {_comment(ad.reserved)}")
            notes.append("# reserved by the doc (pass None): no dtype to state")
            arg.append("optional = true")
            body += ["", *notes, f"[contract.args.{p.name}]", *arg]
            continue
        if p.is_list:
            arg.append("list = true")
        if p.nullable or p.default == "None":
            arg.append("optional = true")
        if ad is None:
            todo.append(f"{p.name}: not documented (no entry in the docstring)")
            notes.append(f"# TODO: {p.name} has no entry in the docstring: state its dtype")
        elif not ad.dtypes:
            todo.append(f"{p.name}: {ad.why or 'no dtype statement'}")
            notes.append(f"# doc: {_comment(ad.line)}")
            notes.append(f"# TODO: {ad.why or 'no dtype statement'}: state its dtype")
        else:
            names = [_CONTRACT_NAMES[x] for x in ad.dtypes if x in _CONTRACT_NAMES]
            odd = [x for x in ad.dtypes if x not in _CONTRACT_NAMES]
            lines_seen = []
            for st in ad.statements:
                if st.line not in lines_seen:
                    lines_seen.append(st.line)
            for ln in lines_seen:
                notes.append(f"# doc: {_comment(ln)}")
            if ad.same_as and ad.same_line and ad.same_line not in lines_seen:
                notes.append(f"# doc: {_comment(ad.same_line)}")
            if any(st.condition for st in ad.statements):
                conds = sorted({st.condition for st in ad.statements if st.condition})
                notes.append("# TODO: per-chip or per-scenario statements (" + "; ".join(
                    _comment(c)[:60] for c in conds) + "): their union is drafted")
                todo.append(f"{p.name}: per-chip or per-scenario dtype statements merged")
            if odd:
                notes.append(f"# TODO: the doc also lists {', '.join(odd)}: no contract dtype "
                             "name exists for it")
                todo.append(f"{p.name}: {', '.join(odd)} cannot be named")
            if names:
                with_dtype += 1
                arg.append("dtype = [" + ", ".join(_s(n) for n in names) + "]")
            else:
                todo.append(f"{p.name}: no dtype a contract can name")
            if ad.same_as and ad.same_as in s.names and ad.same_as != p.name:
                partner = s.param(ad.same_as)
                if partner is not None and partner.is_tensor and partner.is_list == p.is_list:
                    arg.append(f"same_dtype_as = {_s(ad.same_as)}")
        # ranks: the meta kernel's checks win over the doc's statement
        rank: tuple[int, ...] | None = None
        if p.name in meta_ranks and meta_ranks[p.name]:
            rank = meta_ranks[p.name]
            notes.append(f"# meta kernel: torch._check demands rank {'/'.join(map(str, rank))}")
        elif ad is not None and ad.rank:
            rank = ad.rank
            notes.append(f"# doc: {_comment(ad.rank_line or ad.line)}")
        shape = _shape_of(ad, rank) if ad is not None and not p.is_list else None
        if shape is not None:
            if shape[1] not in [n[7:] for n in notes]:
                notes.append(f"# doc: {_comment(shape[1])}")
            notes.append("# check: the shape names bind across arguments as the doc means them")
            arg.append(f"shape = {_s(shape[0])}")
        elif rank:
            arg.append("rank = [" + ", ".join(map(str, rank)) + "]")
        if not arg:
            arg.append("optional = false")  # a table needs a field; says "required"
        body += ["", *dict.fromkeys(notes), f"[contract.args.{p.name}]", *arg]
    if not any(ln.startswith("[contract.args.") for ln in body):
        # a contract needs at least one argument: the first one, with its (absent) rules
        first = s.params[0].name if s.params else "self"
        body += ["", "# TODO: nothing could be drafted for any argument",
                 f"[contract.args.{first}]", "optional = false"]
    text = "\n".join(lines) + "\n" + ("\n".join(f"# TODO: {t}" for t in todo) + "\n" if todo
                                      else "") + "\n".join(body) + "\n"
    return Draft(op, r.version, text, tensors, with_dtype, todo, reserved)


def draft_release(pool: Sequence[Release], r: Release, pattern: str = "*", *,
                  skip_ops: set[str] | None = None, documented_only: bool = True
                  ) -> tuple[list[Draft], list[str]]:
    """Drafts for every op matching ``pattern`` (documented ones only, unless asked),
    skipping ``skip_ops`` (ops that already have a contract); returns the drafts and the ops
    skipped, each with why."""
    out, skipped = [], []
    for op in sorted(r.schemas):
        if not fnmatch.fnmatchcase(op, pattern):
            continue
        if skip_ops and op in skip_ops:
            skipped.append(f"{op}: has a contract")
            continue
        if documented_only and op not in r.docs:
            skipped.append(f"{op}: no docstring")
            continue
        out.append(draft_op(pool, r, op))
    return out, skipped


def releases(d: Digest) -> list[Release]:
    """Every release of a digest, in version order (the ``pool`` of ``draft_release``)."""
    return [d.release(v) for v in d.versions]


def write(drafts: list[Draft], folder: str | Path) -> list[Path]:
    p = Path(folder)
    p.mkdir(parents=True, exist_ok=True)
    paths = []
    for dr in drafts:
        f = p / f"{dr.op}.toml"
        replace_text(f, dr.text)
        paths.append(f)
    return paths


def summary_line(drafts: list[Draft]) -> str:
    n = {"complete": 0, "partly": 0, "not at all": 0}
    for dr in drafts:
        n[dr.status] += 1
    done = [dr for dr in drafts if dr.status == "complete"]
    notensor = sum(1 for dr in done if dr.tensors == 0)
    res = sum(1 for dr in done if dr.tensors and dr.reserved)
    return (f"{len(drafts)} op(s) drafted: {n['complete']} completely ({len(done) - notensor - res}"
            f" with a doc dtype for every tensor argument, {res} whose other tensor arguments "
            f"the doc reserves (pass None), {notensor} without tensor arguments), "
            f"{n['partly']} partly, {n['not at all']} not at all")
