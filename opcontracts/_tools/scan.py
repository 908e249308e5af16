"""``opcontracts scan``: a code base's fused-op call sites, and which of them a contract guards.

Read, never run: every ``.py`` file under the paths is parsed with :mod:`ast` (no import of the
code, no torch, no regular expression over the text).  A name is followed through what binds
it in its file, flow-insensitively (a scanner, not an interpreter):

- ``import torch_npu``, ``import torch_npu as tnpu``, ``from torch_npu import npu_x as f``;
- ``import torch`` then ``torch.ops.npu.x(...)``, ``torch.ops.npu.x.default(...)`` (an overload
  is its op), ``from torch.ops import npu``, ``ops = torch.ops.npu``, ``fn = torch_npu.npu_x``;
- ``getattr(torch_npu, "npu_x")`` with a constant name;
- MindSpeed's op wrappers (``mindspeed.ops.<module>.<function>``), imported absolutely or
  relatively (a file's package is found from its folders' ``__init__.py``);
- ``torch.ops.atb.<op>`` (ATB's namespace).

An op the scanned code defines itself in one of those namespaces (``torch.library.custom_op(
"atb::linear")``, ``torch._custom_op.impl.custom_op``, ``torch.library.define``, a
``Library("atb", ...)``'s ``define``: dlinfer's graph placeholders) is not torch_npu's: its
calls are listed apart (``ScanResult.defined_here``) and not counted as fused-op call sites.

A call site is *guarded* when a shipped contract that targets its op (``torch_npu.X`` and
``torch.ops.npu.X`` are one op) applies, or may apply, on the stacks judged: the declared
targets (``--targets``, ``OPCONTRACTS_TARGETS``, ``[tool.opcontracts]``), else this
environment.  A contract whose ``when`` excludes every stack judged does not guard.

Exit status: 0; 1 with ``--fail-unguarded`` when a call site is unguarded; 2 for usage (a path
that does not exist, a bad target).
"""

from __future__ import annotations

import ast
import fnmatch
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["NOT_OPS", "Site", "ScanResult", "add_parser", "defined_ops", "scan",
           "sites_in_source"]

# namespaces whose members are fused ops; for torch_npu, only names that start with these
_TORCH_NPU_PREFIXES = ("npu_", "_npu_")
_OPS_NAMESPACES = ("torch.ops.npu", "torch.ops.atb")
_MINDSPEED_OPS = "mindspeed.ops."
# MindSpeed functions named like op wrappers that launch no kernel: listed apart, never counted
# as call sites (a contract for them would guard nothing); the reason is shown with them
NOT_OPS: dict[str, str] = {
    "mindspeed.ops.gmm.npu_gmm_param_verification": (
        "a pure-Python argument check (types, group_list's rank and dtype, one device) that "
        "MindSpeed's gmm wrappers run before their kernel; it launches none"),
}
_SKIP_DIRS = {".git", "__pycache__", "node_modules", ".tox", ".venv", "venv", "build", "dist",
              "site-packages", ".eggs"}


@dataclass(frozen=True)
class Site:
    """One call of a fused op in a file."""

    file: str
    line: int
    op: str
    """``torch_npu.npu_x`` (also for ``torch.ops.npu.npu_x``: one op), ``torch.ops.atb.x``, or a
    MindSpeed wrapper's module path"""
    status: str = "unknown"
    """``guarded``; ``partly`` (on some stacks judged only); ``excluded`` (a contract exists,
    its ``when`` excludes every stack judged); ``unknown`` (no contract names the op)"""


@dataclass
class ScanResult:
    roots: list[str]
    files: int
    sites: list[Site]
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    judged_on: list[str] = field(default_factory=list)
    seconds: float = 0.0
    defined_here: list[Site] = field(default_factory=list)
    """calls of ops the scanned code defines itself (``torch.library``): not counted"""
    not_ops: list[Site] = field(default_factory=list)
    """calls of functions named like ops that launch no kernel (``NOT_OPS``): not in ``sites``"""

    @property
    def guarded(self) -> int:
        return sum(s.status == "guarded" for s in self.sites)

    def by_op(self) -> dict[str, tuple[int, str]]:
        counts = Counter(s.op for s in self.sites)
        status = {s.op: s.status for s in self.sites}
        return {op: (n, status[op]) for op, n in counts.most_common()}

    def by_folder(self, depth: int = 1) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for s in self.sites:
            parts = Path(s.file).parts[:-1][:depth]
            key = "/".join(parts) + "/" if parts else "./"
            out[key][0] += 1
            out[key][1] += s.status == "guarded"
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}


# --------------------------------------------------------------------------- reading a file
def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def _op_of(path: str, known: frozenset[str] = frozenset()) -> str | None:
    """The op a fully qualified dotted path reaches, or None when it is no fused op.  A
    MindSpeed path counts when it is an op wrapper: named ``npu_*`` (MindSpeed's convention) or
    a contract's target (``known``); its helpers (``check_npu_version``, triton utilities) do not."""
    for ns in _OPS_NAMESPACES:
        if path.startswith(ns + "."):
            rest = path[len(ns) + 1:].split(".")
            # torch.ops.npu.x.default: the overload is its op; torch.ops.npu.x is torch_npu.x
            return f"{'torch_npu' if ns == 'torch.ops.npu' else ns}.{rest[0]}"
    if path.startswith("torch_npu."):
        rest = path[len("torch_npu."):].split(".")
        if rest[0].startswith(_TORCH_NPU_PREFIXES):
            return f"torch_npu.{rest[0]}"
        return None
    if path.startswith(_MINDSPEED_OPS):
        rest = path[len(_MINDSPEED_OPS):].split(".")
        if len(rest) >= 2 and rest[0] and rest[1]:
            op = f"{_MINDSPEED_OPS}{rest[0]}.{rest[1]}"
            if rest[1].startswith("npu_") or op in known:
                return op
    return None


def _is_namespace(path: str) -> bool:
    """Whether a name bound to ``path`` can lead to an op through attributes."""
    return (path in ("torch", "torch.ops", "torch_npu", "mindspeed", "mindspeed.ops")
            or path in _OPS_NAMESPACES or path.startswith(_MINDSPEED_OPS)
            or _op_of(path) is not None)


def _resolve_relative(module: str | None, level: int, name: str | None, is_package: bool) -> str | None:
    if not level:
        return name
    if module is None:
        return None
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    if level - 1 > len(parts):
        return None
    base = parts[:len(parts) - (level - 1)]
    if name:
        base.append(name)
    return ".".join(base) or None


class _Bindings(ast.NodeVisitor):
    """Names bound in a file to a namespace or an op (imports and plain assignments)."""

    def __init__(self, module: str | None, is_package: bool) -> None:
        self.names: dict[str, str] = {}
        self.module = module
        self.is_package = is_package

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.asname:
                if _is_namespace(a.name):
                    self.names[a.asname] = a.name
            else:
                top = a.name.split(".")[0]
                if _is_namespace(top) or top in ("torch", "torch_npu", "mindspeed"):
                    self.names[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve_relative(self.module, node.level, node.module, self.is_package)
        if base is None:
            return
        for a in node.names:
            if a.name == "*":
                continue
            path = f"{base}.{a.name}"
            if _is_namespace(path):
                self.names[a.asname or a.name] = path

    def visit_Assign(self, node: ast.Assign) -> None:
        self._bind(node.targets, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._bind([node.target], node.value)
        self.generic_visit(node)

    def _bind(self, targets: Sequence[ast.expr], value: ast.expr) -> None:
        path = self.path(value)
        if path is None or not _is_namespace(path):
            return
        for t in targets:
            if isinstance(t, ast.Name):
                self.names.setdefault(t.id, path)

    def path(self, node: ast.AST) -> str | None:
        """The fully qualified dotted path an expression names, through the bindings."""
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "getattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            inner = self.path(node.args[0])
            return f"{inner}.{node.args[1].value}" if inner else None
        parts = _dotted(node)
        if not parts:
            return None
        head = self.names.get(parts[0])
        if head is None:
            return None
        return ".".join([head, *parts[1:]])


def _module_name(file: Path) -> tuple[str | None, bool]:
    """The dotted module a file is, from the ``__init__.py`` files above it; whether it is a
    package's ``__init__``."""
    is_package = file.name == "__init__.py"
    parts = [] if is_package else [file.stem]
    folder = file.parent
    while (folder / "__init__.py").is_file():
        parts.append(folder.name)
        if folder.parent == folder:
            break
        folder = folder.parent
    return (".".join(reversed(parts)) or None), is_package


def sites_in_source(source: str, filename: str = "<source>", module: str | None = None,
                    is_package: bool = False, known: frozenset[str] = frozenset()
                    ) -> list[tuple[int, str]]:
    """(line, op) for every fused-op call in ``source`` (``SyntaxError`` when it does not
    parse); ``known``: the contracts' targets (MindSpeed wrappers not named ``npu_*``)."""
    tree = ast.parse(source, filename=filename)
    b = _Bindings(module, is_package)
    b.visit(tree)
    # a name assigned an op may be bound after a use of it in the file: visit twice
    b.visit(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            path = b.path(node.func)
            op = _op_of(path, known) if path else None
            if op is not None:
                out.append((node.lineno, op))
    out.sort()
    return out


_DEFINERS = ("custom_op", "define", "triton_op")
"""callees whose first argument names a new op ``ns::name`` (``torch.library.custom_op``,
``torch._custom_op.impl.custom_op``, ``torch.library.define``, ``triton_op``)"""


def _qualname(node: ast.Call) -> str | None:
    arg: ast.expr | None = node.args[0] if node.args else None
    if arg is None:
        arg = next((k.value for k in node.keywords if k.arg in ("qualname", "name")), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def defined_ops(source: str, filename: str = "<source>") -> set[str]:
    """The ``torch.ops.<ns>.<name>`` of ops ``source`` defines itself in a scanned namespace:
    ``custom_op("atb::linear")`` and kin, and ``lib.define("name(...) -> ...")`` on a
    ``lib = Library("atb", ...)`` of the same file (``SyntaxError`` when it does not parse)."""
    tree = ast.parse(source, filename=filename)
    libraries: dict[str, str] = {}  # a name bound to Library("ns", ...) -> ns
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and (_dotted(node.value.func) or [""])[-1] == "Library"):
            ns = _qualname(node.value)
            for target in node.targets:
                if ns and isinstance(target, ast.Name):
                    libraries[target.id] = ns
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts = _dotted(node.func)
        if not parts or parts[-1] not in _DEFINERS:
            continue
        text = _qualname(node)
        if text is None:
            continue
        if "::" in text:
            ns, _, name = text.partition("::")
        elif parts[-1] == "define" and len(parts) == 2 and parts[0] in libraries:
            ns, name = libraries[parts[0]], text
        else:
            continue
        name = name.split("(", 1)[0].split(".", 1)[0].strip()
        qualified = f"torch.ops.{ns.strip()}"
        if qualified in _OPS_NAMESPACES and name.isidentifier():
            out.add(f"{qualified}.{name}")
    return out


def _own(op: str) -> str:
    """The ``torch.ops`` name a site's op has, to match the definitions against."""
    if op.startswith("torch_npu."):
        return "torch.ops.npu." + op[len("torch_npu."):]
    return op


# --------------------------------------------------------------------------- which ops are guarded
def _twins(op: str) -> tuple[str, ...]:
    """The names one op has: ``torch_npu.X`` is ``torch.ops.npu.X``; ``torch_npu._npu_X`` may
    be ATB's ``torch.ops.atb._npu_X`` too (torch_npu's ``op_plugin/atb/_atb_ops.py`` binds its
    ATB ops there: ``torch_npu._npu_paged_attention`` loads the plugin and calls the atb op)."""
    if op.startswith("torch_npu._npu_"):
        name = op[len("torch_npu."):]
        return op, "torch.ops.npu." + name, "torch.ops.atb." + name
    if op.startswith("torch_npu."):
        return op, "torch.ops.npu." + op[len("torch_npu."):]
    if op.startswith("torch.ops.npu."):
        return op, "torch_npu." + op[len("torch.ops.npu."):]
    return (op,)


def _guards(stacks: Sequence[Any]) -> dict[str, list[bool]]:
    """target name -> for each stack judged, whether a shipped contract naming it may apply."""
    from .._engine.registry import shipped_index
    from .._lang.versions import applies

    out: dict[str, list[bool]] = {}
    for e in shipped_index():
        on = [applies(e.when, env) is not False for env in stacks]
        for t in e.targets:
            have = out.setdefault(t, [False] * len(stacks))
            out[t] = [a or b for a, b in zip(have, on)]
    return out


def _status(op: str, guards: dict[str, list[bool]]) -> str:
    per_stack: list[bool] | None = None
    for name in _twins(op):
        if name in guards:
            got = guards[name]
            per_stack = got if per_stack is None else [a or b for a, b in zip(per_stack, got)]
    if per_stack is None:
        return "unknown"
    if all(per_stack):
        return "guarded"
    return "partly" if any(per_stack) else "excluded"


# --------------------------------------------------------------------------- walking
def _is_test_path(rel: Path) -> bool:
    return (any(p in ("test", "tests", "testing", "unit_tests", "tests_extend") for p in rel.parts[:-1])
            or rel.name.startswith("test_") or rel.name.endswith("_test.py")
            or rel.name == "conftest.py")


def _excluded(rel: Path, patterns: Sequence[str]) -> bool:
    text = rel.as_posix()
    return any(fnmatch.fnmatch(text, p) or fnmatch.fnmatch(text, p.rstrip("/") + "/*")
               for p in patterns)


def _files(root: Path, skip_tests: bool, exclude: Sequence[str] = ()) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            p = Path(dirpath) / name
            rel = p.relative_to(root)
            if (skip_tests and _is_test_path(rel)) or _excluded(rel, exclude):
                continue
            yield p


def scan(paths: Iterable[str | os.PathLike[str]], *, targets: Sequence[str] | None = None,
         skip_tests: bool = False, exclude: Sequence[str] = ()) -> ScanResult:
    """Every fused-op call under ``paths`` and whether a contract guards it on the stacks judged
    (``targets`` in ``OPCONTRACTS_TARGETS``'s form, else the declared targets, else here);
    ``exclude``: glob patterns of paths relative to each folder scanned."""
    from .._lang.targets import judged

    start = time.perf_counter()
    stacks = judged(list(targets) if targets else None)
    guards = _guards([env for _, env in stacks])
    known = frozenset(guards)
    roots = [Path(p) for p in paths]
    sites: list[Site] = []
    not_ops: list[Site] = []
    unreadable: list[tuple[str, str]] = []
    nfiles = 0
    defined_here: list[Site] = []
    for root in roots:
        if not root.exists():
            raise FileNotFoundError(2, "No such file or directory", str(root))
        root_sites: list[Site] = []
        defined: set[str] = set()  # ops this root's code defines itself, in any of its files
        for f in _files(root, skip_tests, exclude):
            nfiles += 1
            shown = str(f.relative_to(root)) if root.is_dir() else str(f)
            try:
                source = f.read_text(encoding="utf-8")
                module, is_package = _module_name(f)
                found = sites_in_source(source, str(f), module, is_package, known)
                if "torch.ops" in source or "Library" in source or "::" in source:
                    defined |= defined_ops(source, str(f))
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError) as exc:
                unreadable.append((str(f), type(exc).__name__ + (f": {exc}" if str(exc) else "")))
                continue
            if len(roots) > 1 and root.is_dir():
                shown = str(Path(root.name) / shown)
            for line, op in found:
                if op in NOT_OPS:
                    not_ops.append(Site(shown, line, op, "not an op"))
                else:
                    root_sites.append(Site(shown, line, op, _status(op, guards)))
        for s in root_sites:
            if _own(s.op) in defined:
                defined_here.append(Site(s.file, s.line, s.op, "defined here"))
            else:
                sites.append(s)
    return ScanResult([str(r) for r in roots], nfiles, sites, unreadable,
                      [label for label, _ in stacks], time.perf_counter() - start,
                      defined_here=defined_here, not_ops=not_ops)


# --------------------------------------------------------------------------- the command
_STATUS_TEXT = {"guarded": "guarded", "partly": "guarded on some stacks judged only",
                "excluded": "a contract exists; its `when` excludes every stack judged",
                "unknown": "no contract"}


def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:.0f}%" if total else "-"


def _text(res: ScanResult, show_sites: bool, depth: int) -> str:
    n = len(res.sites)
    lines = [f"{n} fused-op call site(s) in {res.files} file(s); {res.guarded} guarded "
             f"({_pct(res.guarded, n)}), {n - res.guarded} not ({res.seconds:.1f} s)",
             f"judged on: {'; '.join(res.judged_on)}"]
    if res.defined_here:
        own = Counter(s.op for s in res.defined_here)
        lines.append(f"not counted: {len(res.defined_here)} call(s) of ops the code defines "
                     "itself (torch.library): "
                     + ", ".join(f"{op} ({n})" for op, n in own.most_common()))
    ops = res.by_op()
    where: dict[str, list[Site]] = defaultdict(list)
    for s in res.sites:
        where[s.op].append(s)
    unguarded = {op: v for op, v in ops.items() if v[1] != "guarded"}
    if unguarded:
        lines += ["", "not guarded, by op (sites, why, first sites):"]
        width = max(len(op) for op in unguarded)
        for op, (count, status) in unguarded.items():
            first = ", ".join(f"{s.file}:{s.line}" for s in where[op][:2])
            more = f" (+{count - 2})" if count > 2 else ""
            lines.append(f"  {op:<{width}}  {count:>4}  {_STATUS_TEXT[status]}: {first}{more}")
    guarded = {op: v for op, v in ops.items() if v[1] == "guarded"}
    if guarded:
        lines += ["", "guarded, by op (sites):"]
        width = max(len(op) for op in guarded)
        lines += [f"  {op:<{width}}  {count:>4}" for op, (count, _) in guarded.items()]
    folders = res.by_folder(depth)
    if folders:
        lines += ["", "by folder (sites, guarded):"]
        width = max(len(k) for k in folders)
        lines += [f"  {k:<{width}}  {t:>4}  {g:>4}  {_pct(g, t)}" for k, (t, g) in folders.items()]
    if res.not_ops:
        lines += ["", "named like an op, not one (no kernel; not counted above):"]
        counts = Counter(s.op for s in res.not_ops)
        width = max(len(op) for op in counts)
        for op, count in counts.most_common():
            lines.append(f"  {op:<{width}}  {count:>4}  {NOT_OPS[op]}")
    if show_sites:
        lines += ["", "every site:"]
        lines += [f"  {s.file}:{s.line}  {s.op}  {s.status}" for s in res.sites]
    if res.unreadable:
        lines += ["", f"{len(res.unreadable)} file(s) could not be read (not scanned):"]
        lines += [f"  {f}: {why}" for f, why in res.unreadable[:10]]
    return "\n".join(lines)


def _json(res: ScanResult, depth: int) -> dict[str, Any]:
    return {
        "roots": res.roots, "files": res.files, "judged_on": res.judged_on,
        "totals": {"sites": len(res.sites), "guarded": res.guarded,
                   "unguarded": len(res.sites) - res.guarded},
        "ops": {op: {"sites": n, "status": st} for op, (n, st) in res.by_op().items()},
        "folders": {k: {"sites": t, "guarded": g} for k, (t, g) in res.by_folder(depth).items()},
        "sites": [{"file": s.file, "line": s.line, "op": s.op, "status": s.status}
                  for s in res.sites],
        "unreadable": [{"file": f, "error": why} for f, why in res.unreadable],
        "defined_here": [{"file": s.file, "line": s.line, "op": s.op} for s in res.defined_here],
        "not_ops": [{"file": s.file, "line": s.line, "op": s.op, "why": NOT_OPS[s.op]}
                    for s in res.not_ops],
    }


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "scan", help="list a code base's fused-op call sites and whether a contract guards each",
        description="Read every .py file under PATH (parsed, never imported or run), find each "
        "call of a torch_npu / torch.ops.npu / torch.ops.atb op or a MindSpeed op wrapper "
        "(through imports, aliases and overloads), and say whether a shipped contract guards it "
        "on the stacks judged: --targets, else the declared targets, else this environment. "
        "Exit status: 0; 1 with --fail-unguarded when a call site is unguarded; 2 for usage.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to scan")
    p.add_argument("--targets", action="append", metavar="STACK",
                   help="a stack to judge on, as in OPCONTRACTS_TARGETS (\"torch_npu=2.7.1,"
                   "cann=8.2.RC1\"); repeatable; default: the declared targets, else here")
    p.add_argument("--skip-tests", action="store_true",
                   help="leave out test folders (test/, tests/, ...) and test_*.py files")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="leave out paths matching GLOB, relative to each folder scanned "
                   "(\"mindspeed/mindspore\", \"*/legacy/*\"); repeatable")
    p.add_argument("--sites", action="store_true", help="also list every call site")
    p.add_argument("--depth", type=int, default=1, metavar="N",
                   help="folder levels in the per-folder totals (default 1)")
    p.add_argument("--fail-unguarded", action="store_true",
                   help="exit 1 when a call site is not guarded (hold coverage in CI)")
    from .._jsonout import add_json_option

    add_json_option(p, "the call sites, per op and per folder")
    p.set_defaults(func=_cmd_scan)


def _cmd_scan(ns: Any) -> int:
    from .._jsonout import to_stdout, write_json

    if ns.depth < 1:
        from ..errors import SettingError

        raise SettingError(f"--depth {ns.depth}: must be 1 or more")
    res = scan(ns.paths, targets=ns.targets, skip_tests=ns.skip_tests, exclude=ns.exclude)
    if ns.json is not None:
        write_json(ns.json, _json(res, ns.depth))
    if not to_stdout(ns.json):
        print(_text(res, ns.sites, ns.depth))
    unguarded = len(res.sites) - res.guarded
    return 1 if ns.fail_unguarded and unguarded else 0
