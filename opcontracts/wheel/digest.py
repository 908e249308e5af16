"""The digest: what the wheel tools need from each torch_npu release, compact and offline.

``opcontracts wheel digest WHEEL... -o FILE`` reads real wheels and writes it; the package ships
one (``opcontracts/wheel/torch_npu_digest.json.gz``), so verify, draft and diff run without the
network and the tests check every shipped contract against it.

Library API (for other parts of opcontracts and for users)::

    from opcontracts.wheel import digest
    d = digest.load()                      # the committed digest (or digest.load("my.json.gz"))
    d.versions                             # ['2.5.1', ..., '2.14.0'], in version order
    r = d.release("2.14.0")                # one release (KeyError naming the known ones)
    r.schemas                              # op -> [OpSchema, ...]: the default overload first
    r.schema("npu_moe_token_unpermute")    # the default overload's OpSchema, or None
    r.docs["npu_rms_norm"].args["self"].dtypes   # ('float16', 'bfloat16', 'float32')
    r.meta["npu_moe_token_permute"].ranks        # {'tokens': (2,), 'indices': (1, 2)}
    r.bound("npu_swiglu")                  # torch_npu.npu_swiglu is bound to torch.ops.npu
    r.node_saves("npu_rms_norm")           # ('gamma', 'self', 1): its autograd node's saved tensors
    digest.op_schemas("2.14.0")            # shortcut: op -> [OpSchema, ...] of one release
    d.groups("docs")                       # {file id: [versions shipping it byte-identical]}

``OpSchema`` (``opcontracts.wheel._schema``) has ``name``, ``overload``, ``params`` (each a
``Param`` with ``name``, ``type``, ``default``, ``kw_only``, ``nullable``, ``is_list``,
``is_tensor``), ``returns`` and ``func`` (the schema string, ready for ``torch.library``).
A release may be named by its version or by a file id of ``groups()`` (then the first release
of that group).  Nothing here imports torch or torch_npu.

Format (gzip'd JSON, keys sorted, gzip header without a time stamp, so the same wheels give the
same bytes): ``versions`` maps each release to the content ids of its files (and the torch it
pins); ``schema``/``docs``/``meta``/``bindings``/``autograd`` map ids to the parsed content
(``autograd``: node -> saved names, from ``Functions.h``; absent in a digest made before it was
read), schemas and per-op records by index into two pools (``funcs``: schema strings;
``entries``: parsed per-op records), so what several releases share is stored once.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, TypeVar

from .._jsonout import replace_bytes
from ._bindings import parse_bindings
from ._docs import OpDoc, parse_docs
from ._meta import MetaKernel, parse_meta
from ._nodes import node_name, parse_nodes
from ._schema import OpSchema, by_op, custom_funcs, default_schemas, split_top
from ._source import WheelFiles, file_id

__all__ = ["Digest", "Release", "DigestError", "build", "load", "save", "dumps", "loads",
           "compare", "op_schemas", "resolve_release", "default_path", "FORMAT"]

FORMAT = 1


class DigestError(ValueError):
    """A digest file that cannot be read (names the file and what is wrong)."""


def default_path() -> Path:
    """The digest shipped inside the package."""
    return Path(__file__).resolve().parent / "torch_npu_digest.json.gz"


def _json_id(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False,
                                     separators=(",", ":")).encode("utf-8")).hexdigest()[:12]


# --------------------------------------------------------------------------- build
def _parsed(w: WheelFiles, role: str, parse: Any) -> Any:
    """``parse(text)`` of one of the wheel's files; a file that does not parse (a syntax
    error, a NUL byte, a schema line that cannot be read) is a ``WheelReadError`` naming the
    wheel and the file, never a traceback."""
    from ._source import PATHS, WheelReadError

    try:
        return parse(w.text(role) or "")
    except (SyntaxError, ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
        if isinstance(exc, WheelReadError):
            raise
        raise WheelReadError(f"{w.origin}: {PATHS[role]} cannot be read "
                             f"({type(exc).__name__}: {exc})") from None


def build(wheels: Iterable[WheelFiles]) -> dict[str, Any]:
    """The digest of ``wheels`` as a JSON-able dict (see the module docstring for the layout)."""
    funcs: list[str] = []
    func_index: dict[str, int] = {}
    entries: list[Any] = []
    entry_index: dict[str, int] = {}

    def func_ref(f: str) -> int:
        if f not in func_index:
            func_index[f] = len(funcs)
            funcs.append(f)
        return func_index[f]

    def entry_ref(obj: Any) -> int:
        key = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        if key not in entry_index:
            entry_index[key] = len(entries)
            entries.append(obj)
        return entry_index[key]

    versions: dict[str, Any] = {}
    schema_g: dict[str, list[int]] = {}
    docs_g: dict[str, dict[str, int]] = {}
    meta_g: dict[str, dict[str, int]] = {}
    bind_g: dict[str, list[str]] = {}
    nodes_g: dict[str, dict[str, list[str]]] = {}
    parsed_schemas: dict[str, dict[str, OpSchema]] = {}
    for w in wheels:
        rec: dict[str, Any] = {"torch": w.torch, "files": {}}
        missing = [r for r in ("schema", "docs", "meta", "bindings") if r not in w.files]
        if missing:
            rec["missing"] = missing
        if "schema" in w.files:
            sid = file_id(w.files["schema"])
            rec["schema"] = sid
            if sid not in schema_g:
                fl = _parsed(w, "schema", custom_funcs)
                schema_g[sid] = [func_ref(f) for f in fl]
                parsed_schemas[sid] = _parsed(w, "schema", lambda _, fl=fl: default_schemas(fl))
        if "docs" in w.files:
            did = file_id(w.files["docs"])
            rec["files"]["docs"] = did
            key = did + "+" + rec.get("schema", "")
            rec["docs"] = key
            if key not in docs_g:
                known = parsed_schemas.get(rec.get("schema", ""), {})
                docs = _parsed(w, "docs", lambda text, known=known: parse_docs(text, known))
                docs_g[key] = {op: entry_ref(d.to_json()) for op, d in docs.items()}
        if "meta" in w.files:
            mid = file_id(w.files["meta"])
            rec["meta"] = mid
            if mid not in meta_g:
                meta = _parsed(w, "meta", parse_meta)
                meta_g[mid] = {op: entry_ref(k.to_json()) for op, k in meta.items()}
        if "bindings" in w.files:
            names = sorted(_parsed(w, "bindings", parse_bindings))
            bid = _json_id(names)
            rec["bindings"] = bid
            bind_g.setdefault(bid, names)
        if "autograd" in w.files:  # optional: a tree without the headers has no nodes
            nodes = _parsed(w, "autograd", parse_nodes)
            aid = _json_id(nodes)
            rec["autograd"] = aid
            nodes_g.setdefault(aid, nodes)
        if "schema" in rec:
            rec["files"]["schema"] = rec["schema"]
        if "meta" in rec:
            rec["files"]["meta"] = rec["meta"]
        versions[w.version] = rec
    return {"format": FORMAT, "tool": "opcontracts wheel digest", "versions": versions,
            "schema": schema_g, "docs": docs_g, "meta": meta_g, "bindings": bind_g,
            "autograd": nodes_g, "funcs": funcs, "entries": entries}


def dumps(data: dict[str, Any]) -> bytes:
    """Deterministic gzip'd JSON (no time stamp, keys sorted)."""
    raw = json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="", compresslevel=9) as gz:
        gz.write(raw)
    return buf.getvalue()


def save(data: dict[str, Any], path: str | Path) -> int:
    """Write the digest; returns its size in bytes."""
    blob = dumps(data)
    replace_bytes(path, blob)  # whole or not at all; -o into a new folder: created
    return len(blob)


def loads(blob: bytes, origin: str = "<bytes>") -> dict[str, Any]:
    try:
        raw = gzip.decompress(blob) if blob[:2] == b"\x1f\x8b" else blob
        data = json.loads(raw.decode("utf-8"))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DigestError(f"{origin}: not a digest (gzip'd JSON): {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DigestError(f"{origin}: digest format {data.get('format') if isinstance(data, dict) else '?'}"
                          f", expected {FORMAT} (regenerate it with `opcontracts wheel digest`)")
    for key in ("versions", "schema", "docs", "meta", "bindings", "funcs", "entries"):
        if key not in data:
            raise DigestError(f"{origin}: field {key!r} missing")
    data.setdefault("autograd", {})  # a digest made before the nodes were read: none known
    _check_versions(data["versions"], origin)
    return data


def _check_versions(versions: Any, origin: str) -> None:
    """``DigestError`` naming the file and the field when ``versions`` is not a table of
    releases by version (everything reading a digest orders them by version)."""
    from packaging.version import InvalidVersion, Version

    if not isinstance(versions, dict):
        raise DigestError(f"{origin}: field 'versions': expected a table of releases by version, "
                          f"got {type(versions).__name__}")
    for name, rec in versions.items():
        try:
            Version(name)
        except InvalidVersion:
            raise DigestError(f"{origin}: field 'versions': release {name!r} is not a version "
                              "(such as '2.7.1.post11'; regenerate the digest with `opcontracts "
                              "wheel digest`)") from None
        if not isinstance(rec, dict):
            raise DigestError(f"{origin}: field 'versions.{name}': expected a table, got "
                              f"{type(rec).__name__}")


# --------------------------------------------------------------------------- read
_T = TypeVar("_T")


class _Lazy(Mapping[str, _T]):
    """A read-only mapping whose values are built on first access (a release has ~400 ops;
    a check reads a handful)."""

    def __init__(self, keys: Mapping[str, Any], load: Callable[[str], _T]) -> None:
        self._keys = keys
        self._load = load
        self._done: dict[str, _T] = {}

    def __getitem__(self, key: str) -> _T:
        if key not in self._done:
            if key not in self._keys:
                raise KeyError(key)
            self._done[key] = self._load(key)
        return self._done[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


@dataclass
class Release:
    """One torch_npu release as the digest knows it (parsed on first use)."""

    version: str
    data: dict[str, Any] = field(repr=False)
    torch: str | None = None

    @property
    def rec(self) -> dict[str, Any]:
        return dict(self.data["versions"][self.version])

    def file_id(self, role: str) -> str | None:
        """Content id of one of the release's files (``schema``, ``docs``, ``meta``)."""
        return self.rec.get("files", {}).get(role)

    @cached_property
    def _funcs(self) -> dict[str, list[str]]:
        sid = self.rec.get("schema")
        funcs = self.data["funcs"]
        out: dict[str, list[str]] = {}
        for i in self.data["schema"].get(sid, ()) if sid else ():
            f = funcs[i]
            out.setdefault(f.split("(", 1)[0].split(".", 1)[0].strip(), []).append(f)
        return out

    @cached_property
    def schemas(self) -> Mapping[str, list[OpSchema]]:
        """op -> its overloads, the default first (parsed on first access of each op)."""
        funcs = self._funcs
        return _Lazy(funcs, lambda op: by_op(funcs[op])[op])

    def schema(self, op: str) -> OpSchema | None:
        lst = self.schemas.get(op)
        return lst[0] if lst else None

    @cached_property
    def docs(self) -> Mapping[str, OpDoc]:
        """op -> its parsed docstring (``OpDoc``), for the documented ops."""
        key = self.rec.get("docs")
        index = self.data["docs"].get(key, {}) if key else {}
        entries = self.data["entries"]
        return _Lazy(index, lambda op: OpDoc.from_json(op, entries[index[op]]))

    @cached_property
    def meta(self) -> Mapping[str, MetaKernel]:
        """op -> its meta kernel (``MetaKernel``)."""
        mid = self.rec.get("meta")
        index = self.data["meta"].get(mid, {}) if mid else {}
        entries = self.data["entries"]
        return _Lazy(index, lambda op: MetaKernel.from_json(op, entries[index[op]]))

    @cached_property
    def bindings(self) -> frozenset[str]:
        bid = self.rec.get("bindings")
        return frozenset(self.data["bindings"].get(bid, ())) if bid else frozenset()

    @cached_property
    def nodes(self) -> Mapping[str, list[str]]:
        """autograd node (``NpuRmsNormBackward0``) -> the names it saves (``Functions.h``);
        empty where the digest has no nodes for the release."""
        aid = self.rec.get("autograd")
        return dict(self.data["autograd"].get(aid, {})) if aid else {}

    def node_saves(self, op: str) -> tuple[str | int, ...] | None:
        """What the autograd node of ``op``'s derivative saves, by ``op``'s schema: argument
        names, and output indices for the outputs (``result1`` -> 1, or a named return).  None
        where the release has no node for it, or its names do not fit ``op``'s schema (the
        node is another op's: ``_x`` and ``x`` share a node name)."""
        saved = self.nodes.get(node_name(op))
        schema = self.schema(op)
        if saved is None or schema is None:
            return None
        returns = [r.strip().rsplit(" ", 1) for r in _returns(schema.returns)]
        named = {parts[1]: i for i, parts in enumerate(returns) if len(parts) == 2}
        out: list[str | int] = []
        for name in saved:
            m = re.fullmatch(r"result(\d*)", name)
            if name in schema.names:
                out.append(name)
            elif name in named:
                out.append(named[name])
            elif m is not None and (int(m.group(1) or 0)) < max(1, len(returns)):
                out.append(int(m.group(1) or 0))
            else:
                return None
        return tuple(out)

    def bound(self, name: str) -> bool:
        """Whether ``torch_npu.<name>`` is bound to ``torch.ops.npu.<name>`` in this release."""
        return name in self.bindings

    def meta_ranks(self, op: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """(ranks, conditional ranks) of the meta kernel, by the schema's argument names (the
        kernel's own parameter names map to the schema's by position)."""
        k, s = self.meta.get(op), self.schema(op)
        if k is None:
            return {}, {}
        names = dict(zip(k.params, s.names)) if s is not None else {}
        return ({names.get(a, a): r for a, r in k.ranks.items()},
                {names.get(a, a): r for a, r in k.cond_ranks.items()})

    def meta_dtypes(self, op: str) -> dict[str, tuple[str, ...]]:
        k, s = self.meta.get(op), self.schema(op)
        if k is None:
            return {}
        names = dict(zip(k.params, s.names)) if s is not None else {}
        return {names.get(a, a): d for a, d in k.dtypes.items()}

    def meta_outputs(self, op: str) -> list[str | None]:
        """Per output of the meta kernel: ``float32``, ``same as <schema arg>`` or None."""
        k, s = self.meta.get(op), self.schema(op)
        if k is None:
            return []
        names = dict(zip(k.params, s.names)) if s is not None else {}
        out: list[str | None] = []
        for o in k.outputs:
            if o and o.startswith("same as "):
                a = o[len("same as "):]
                out.append("same as " + names.get(a, a))
            else:
                out.append(o)
        return out


def _returns(text: str) -> list[str]:
    """A schema's returns one by one: ``(Tensor, Tensor out)`` -> ``['Tensor', 'Tensor out']``
    (a comma inside ``Tensor(a!)`` is not a separator: ``split_top``)."""
    t = text.strip()
    if t.startswith("(") and t.endswith(")"):
        t = t[1:-1]
    return [r for r in split_top(t) if r]


class Digest:
    """A loaded digest: releases by version, and which releases share which file."""

    def __init__(self, data: dict[str, Any], origin: str = "<digest>") -> None:
        from packaging.version import Version

        self.data = data
        self.origin = origin
        self.versions: list[str] = sorted(data["versions"], key=Version)
        self._releases: dict[str, Release] = {}

    def release(self, name: str) -> Release:
        """A release by version (``2.7.1.post11``), or the first release of a file id."""
        v = name.strip()
        if v not in self.data["versions"]:
            by_id = [ver for ver in self.versions
                     if v in self.data["versions"][ver].get("files", {}).values()]
            if not by_id:
                raise KeyError(f"torch_npu {name!r} is not in the digest {self.origin}; it has "
                               + ", ".join(self.versions))
            v = by_id[0]
        if v not in self._releases:
            rec = self.data["versions"][v]
            self._releases[v] = Release(v, self.data, rec.get("torch"))
        return self._releases[v]

    def groups(self, role: str = "docs") -> dict[str, list[str]]:
        """file id -> the releases whose ``role`` file (``docs``, ``schema``, ``meta``) is
        byte-identical, in version order."""
        out: dict[str, list[str]] = {}
        for v in self.versions:
            fid = self.data["versions"][v].get("files", {}).get(role)
            if fid is not None:
                out.setdefault(fid, []).append(v)
        return out

    def restrict(self, versions: Iterable[str]) -> dict[str, Any]:
        """The digest data of these releases only, as ``build`` would make it from their wheels
        (so a digest of a subset of the wheels can be compared with this one)."""
        keep = [v for v in self.versions if v in set(versions)]
        full = Digest(self.data, self.origin)
        rebuilt: dict[str, Any] = {"format": FORMAT, "tool": self.data.get("tool"),
                                   "versions": {}, "schema": {}, "docs": {}, "meta": {},
                                   "bindings": {}, "autograd": {}, "funcs": [], "entries": []}
        funcs: dict[str, int] = {}
        entries: dict[str, int] = {}

        def fref(f: str) -> int:
            if f not in funcs:
                funcs[f] = len(rebuilt["funcs"])
                rebuilt["funcs"].append(f)
            return funcs[f]

        def eref(obj: Any) -> int:
            key = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
            if key not in entries:
                entries[key] = len(rebuilt["entries"])
                rebuilt["entries"].append(obj)
            return entries[key]

        src_f, src_e = self.data["funcs"], self.data["entries"]
        for v in keep:
            rec = full.data["versions"][v]
            rebuilt["versions"][v] = rec
            if "schema" in rec and rec["schema"] not in rebuilt["schema"]:
                rebuilt["schema"][rec["schema"]] = [fref(src_f[i]) for i in
                                                    self.data["schema"][rec["schema"]]]
            if "docs" in rec and rec["docs"] not in rebuilt["docs"]:
                rebuilt["docs"][rec["docs"]] = {op: eref(src_e[i]) for op, i in
                                                self.data["docs"][rec["docs"]].items()}
            if "meta" in rec and rec["meta"] not in rebuilt["meta"]:
                rebuilt["meta"][rec["meta"]] = {op: eref(src_e[i]) for op, i in
                                                self.data["meta"][rec["meta"]].items()}
            if "bindings" in rec:
                rebuilt["bindings"].setdefault(rec["bindings"],
                                               self.data["bindings"][rec["bindings"]])
            if "autograd" in rec:
                rebuilt["autograd"].setdefault(rec["autograd"],
                                               self.data["autograd"][rec["autograd"]])
        return rebuilt


def load(path: str | Path | None = None) -> Digest:
    """A digest file (default: the one shipped in the package)."""
    p = Path(path) if path is not None else default_path()
    if path is None:
        return _load_default()
    try:
        blob = p.read_bytes()
    except OSError as exc:
        raise DigestError(f"{p}: cannot read: {exc}") from None
    return Digest(loads(blob, str(p)), str(p))


@lru_cache(maxsize=1)
def _load_default() -> Digest:
    p = default_path()
    try:
        blob = p.read_bytes()
    except OSError as exc:
        raise DigestError(f"{p}: the shipped digest cannot be read: {exc}") from None
    return Digest(loads(blob, str(p)), str(p))


def resolve_release(name: str, digest_path: str | Path | None = None) -> Release:
    """A release named on a command line: a digest file (``FILE.json.gz`` or ``FILE.json``,
    optionally ``@VERSION``; else its newest release), a torch_npu wheel or unpacked tree (read
    now), or a version (or file id) of ``digest_path`` / the shipped digest."""
    from . import _source

    spec, sep, at = name.partition("@")
    p = Path(spec)
    if p.exists() and p.suffix in (".gz", ".json"):
        d = load(p)
        if sep and not at.strip():
            raise DigestError(f"{name}: no release after '@' (FILE@VERSION, or FILE alone for "
                              "its newest release)")
        if not d.versions:
            raise DigestError(f"{p}: the digest holds no release")
        return d.release(at or d.versions[-1])
    if p.exists():
        w = _source.read_one(p)
        return Digest(build([w]), str(p)).release(w.version)
    return load(digest_path).release(name)


def op_schemas(version: str, digest: Digest | None = None) -> Mapping[str, list[OpSchema]]:
    """op -> its overloads (default first) in one torch_npu release of the digest."""
    return (digest or load()).release(version).schemas


def _semantic(data: dict[str, Any]) -> dict[str, Any]:
    """The digest's content with pool indices resolved (pool order is an encoding detail)."""
    f, e = data["funcs"], data["entries"]
    return {
        "versions": data["versions"],
        "schema": {k: [f[i] for i in v] for k, v in data["schema"].items()},
        "docs": {k: {op: e[i] for op, i in v.items()} for k, v in data["docs"].items()},
        "meta": {k: {op: e[i] for op, i in v.items()} for k, v in data["meta"].items()},
        "bindings": data["bindings"],
        "autograd": data.get("autograd", {}),
    }


def compare(a: dict[str, Any], b: dict[str, Any], limit: int = 20) -> list[str]:
    """What differs between two digests' content (empty when they say the same): versions,
    then per group and op."""
    sa, sb = _semantic(a), _semantic(b)
    out: list[str] = []
    va, vb = set(sa["versions"]), set(sb["versions"])
    for v in sorted(va - vb):
        out.append(f"version {v} only in the first")
    for v in sorted(vb - va):
        out.append(f"version {v} only in the second")
    for v in sorted(va & vb):
        if sa["versions"][v] != sb["versions"][v]:
            out.append(f"version {v}: files differ ({sa['versions'][v]} vs {sb['versions'][v]})")
    for part in ("schema", "docs", "meta", "bindings", "autograd"):
        ga, gb = sa[part], sb[part]
        for k in sorted(set(ga) & set(gb)):
            if ga[k] == gb[k]:
                continue
            if isinstance(ga[k], dict):
                for op in sorted(set(ga[k]) | set(gb[k])):
                    if ga[k].get(op) != gb[k].get(op):
                        out.append(f"{part} {k}: {op} differs")
            else:
                out.append(f"{part} {k} differs")
        for k in sorted(set(ga) ^ set(gb)):
            out.append(f"{part} {k} only in the {'first' if k in ga else 'second'}")
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])
