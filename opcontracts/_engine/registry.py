"""The loaded contracts, by op name, and which of them apply in this environment.

Several contracts may share an op name when their ``when`` conditions differ (MindSpeed's
bf16-only rule next to torch_npu 2.13's wider one).  ``resolve(op)`` returns the one contract
to enforce: the single applicable one, or, when several may apply because a version is
unknown, their intersection (every rule of every candidate: the strictest reading).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._lang import targets as _targets
from .._lang import versions
from ..errors import ContractFileError, OpContractsError
from . import contract_index
from .derive import join_sources

if TYPE_CHECKING:  # pydantic is imported when contracts are first validated, not at import
    from ..spec import Arg, Contract
    from .readings import Resolution

__all__ = ["register", "unregister", "get_contract", "resolve", "all_contracts", "clear", "expanded",
           "shipped_contracts_dir", "load_shipped", "UnknownOpError", "merge_contracts",
           "on_change", "GENERATION"]


class UnknownOpError(OpContractsError, LookupError):
    """No contract is registered under that op name.  With ``op``, the message lists the
    registered (and shipped) op names nearest to it and says how to load a contract file."""

    def __init__(self, message: str, *, op: str | None = None) -> None:
        self.op = op
        self.near: tuple[str, ...] = () if op is None else tuple(near_ops(op))
        if op is not None:
            if self.near:
                message += f"; near matches: {', '.join(self.near)}"
            message += ("; to use your own contracts, load them with opcontracts.use('FILE.toml')"
                        " (or set OPCONTRACTS_CONTRACTS); `opcontracts list` shows every op")
        super().__init__(message)


def near_ops(op: str, n: int = 5) -> list[str]:
    """Op names close to ``op``: the registered ones and the shipped index's (``near_names``)."""
    with _lock:
        known = set(_by_op)
    try:
        known.update(e.op for e in shipped_index())
    except OpContractsError:  # pragma: no cover - a broken install: the registered ones
        pass
    known.discard(op)
    return near_names(op, known, n)


def near_names(word: str, names: Iterable[str], n: int = 5, cutoff: float = 0.6) -> list[str]:
    """The names in ``names`` nearest to ``word``, for a "near matches: ..." hint (``@enforce``,
    ``list``, ``probe``): by spelling (difflib), against the whole name and against each of its
    tails after a ``_`` or ``.`` (``unpremute`` finds ``npu_moe_token_unpermute``), then by
    containment (``unpermute`` finds ``npu_moe_token_unpermute_grad``); case-insensitive."""
    import difflib
    import re

    low = word.lower()
    if not low:
        return []
    scored = []
    for name in set(names):
        full = name.lower()
        parts = re.split(r"[._]", full)
        tails = {full, *("_".join(parts[i:]) for i in range(1, len(parts)))}
        ratio = 0.0
        for tail in tails:
            m = difflib.SequenceMatcher(None, low, tail)
            if m.real_quick_ratio() >= cutoff and m.quick_ratio() >= cutoff:
                ratio = max(ratio, m.ratio())
        if ratio >= cutoff:
            scored.append((-ratio, len(name), name))
    close = [name for *_, name in sorted(scored)]
    contains = sorted((k for k in set(names) if low in k.lower() or k.lower() in low),
                      key=lambda k: (len(k), k))
    return list(dict.fromkeys(close + contains))[:n]


_lock = threading.RLock()
_by_op: dict[str, list[Contract]] = {}
_resolved: dict[str, Contract | None] = {}
_resolutions: dict[str, Resolution] = {}


class _Generation:
    """How many times what applies has changed.  A plain object attribute: code traced by
    ``torch.compile`` reads it, so dynamo guards on it and recompiles after a change."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


GENERATION = _Generation()
_listeners: list[Callable[[], None]] = []


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` after every change to what applies (contracts registered, replaced,
    removed; versions changed).  The enforcer resets its guards from here, so a guard never
    keeps a decision the registry no longer makes, and its hot path tests nothing for it."""
    _listeners.append(callback)


def _changed() -> None:
    """Called with ``_lock`` held, after a change: drop resolutions, tell the listeners."""
    _resolved.clear()
    _resolutions.clear()
    GENERATION.value += 1
    for cb in list(_listeners):
        cb()


def shipped_contracts_dir() -> Path:
    """The folder of contract files shipped with the package (``opcontracts/contracts``)."""
    return contract_index.shipped_folder()


def register(contracts: Contract | Iterable[Contract], *, replace: bool = False) -> None:
    """Add contracts to the registry.  With ``replace``, contracts for the same op (and the
    same ``when``, from the same side: shipped or the user's) are replaced instead of raising.

    A user's contract (any contract not from the shipped packs) never replaces a shipped one:
    both apply, and a call must satisfy both, unless the user's contract says ``replace =
    true`` (``Contract.replace``).  A user's contract whose dtype set for an argument shares
    nothing with that of another contract of the op that applies here too is refused with a
    ``ContractFileError`` naming both files (no call could satisfy both)."""
    from ..spec import Contract

    items = [contracts] if isinstance(contracts, Contract) else list(contracts)
    with _lock:
        before = {op: list(lst) for op, lst in _by_op.items()}  # nothing half-registered
        try:
            for c in items:
                side = is_shipped(c)
                lst = _by_op.setdefault(c.op, [])
                same = [i for i, old in enumerate(lst)
                        if old.when == c.when and is_shipped(old) == side]
                if same and not replace and lst[same[0]] != c:
                    old = lst[same[0]]
                    raise OpContractsError(
                        f"two contracts for op {c.op!r} with the same 'when' "
                        f"({old.file or 'inline'} and {c.file or 'inline'}); give them "
                        "different 'when' conditions or register with replace=True"
                    )
                if not side:
                    _refuse_disjoint(c)
                if same:
                    lst[same[0]] = c
                else:
                    lst.append(c)
        except OpContractsError:
            _by_op.clear()
            _by_op.update(before)
            raise
        if items:
            _changed()


_shipped_root: str | None = None


def is_shipped(c: Contract) -> bool:
    """Whether ``c`` comes from the shipped packs (its file lies in ``shipped_contracts_dir``)."""
    global _shipped_root
    if c.file is None:
        return False
    if _shipped_root is None:
        _shipped_root = str(shipped_contracts_dir().resolve()) + os.sep
    try:
        return str(Path(c.file).resolve()).startswith(_shipped_root)
    except OSError:  # pragma: no cover - an unresolvable path is no shipped file
        return False


def _dtype_sets(args: Any) -> dict[str, frozenset[str]]:
    """Argument -> its dtype set (canonical names), for the arguments that have one."""
    from .._lang.dtypes import dtype_name, parse_dtype

    out: dict[str, frozenset[str]] = {}
    for name, a in (args or {}).items():
        raw = a.get("dtype") if isinstance(a, dict) else a.dtype
        if raw:
            items = [raw] if isinstance(raw, str) else list(raw)
            try:
                out[name] = frozenset(dtype_name(parse_dtype(x)) for x in items)
            except ValueError:  # pragma: no cover - the shipped files are validated by the suite
                continue
    return out


def _refuse_disjoint(c: Contract) -> None:
    """``ContractFileError`` when a dtype set of the user's contract ``c`` shares nothing with
    that of a contract it would be merged with here (the shipped ones, read from the index so
    they need not be validated yet, unless a user's ``replace = true`` contract stands in for
    them; other user files').  Called with ``_lock`` held."""
    from ..errors import FileProblem

    env = versions.current()
    if c.replace or versions.applies(c.when, env) is False:
        return
    mine = _dtype_sets(c.args)
    if not mine:
        return
    users = [o for o in _by_op.get(c.op, ()) if not is_shipped(o) and o.file != c.file
             and o.when != c.when  # (the one ``c`` replaces)
             and versions.applies(o.when, env) is not False]
    others: list[tuple[str, dict[str, frozenset[str]]]] = [
        (o.file or "inline", _dtype_sets(o.args)) for o in users]
    if not any(o.replace for o in users):
        others += [(e.file, _dtype_sets(e.args)) for e in shipped_index()
                   if e.op == c.op and versions.applies(e.when, env) is not False]
    problems = []
    for file, theirs in others:
        for name, dts in mine.items():
            if name in theirs and not dts & theirs[name]:
                problems.append(FileProblem(
                    f"dtype {sorted(dts)} shares no dtype with {sorted(theirs[name])} in {file}, "
                    "which applies here too: no call can satisfy both (a user's contract adds "
                    "to the others); to use yours instead, say replace = true in it",
                    c.file, c.op, f"args.{name}.dtype"))
    if problems:
        raise ContractFileError.of(problems)


def unregister(op: str) -> None:
    with _lock:
        _by_op.pop(op, None)
        _changed()


def clear() -> None:
    """Forget every contract (the shipped ones are loaded again on the next need)."""
    global _shipped_loaded
    with _lock:
        _by_op.clear()
        _shipped_loaded = False
        _changed()


def invalidate() -> None:
    """Forget resolutions (after versions change); every guard decides anew."""
    with _lock:
        _changed()


def all_contracts() -> list[Contract]:
    with _lock:
        return [c for lst in _by_op.values() for c in lst]


def candidates(op: str) -> list[Contract]:
    with _lock:
        return list(_by_op.get(op, ()))


def resolve(op: str) -> Contract | None:
    """The contract to enforce for ``op`` here, or ``None`` if none applies."""
    with _lock:
        if op in _resolved:
            return _resolved[op]
        lst = _by_op.get(op)
        if not _shipped_loaded and (not lst or any(e.op == op for e in shipped_index())):
            load_shipped()  # validated on first need (a user's contract adds to them)
            lst = _by_op.get(op)
        if not lst:
            raise UnknownOpError(f"no contract registered for op {op!r}", op=op)
        from .readings import resolve_readings

        if any(c.rules_of for c in lst):
            lst = _derived(lst)
        targets = _targets.declared()[0]
        found = resolve_readings(op, lst, _targets.stacks(versions.current(), targets), targets,
                                 merge_contracts, is_shipped)
        _resolutions[op] = found
        _resolved[op] = found.strict
        return found.strict


def resolution(op: str) -> Resolution | None:
    """How ``resolve(op)`` decided: the readings still possible on the stacks judged (the
    targets, or this environment) and the strictest merge that is enforced; None if no
    contract is registered for ``op``."""
    try:
        resolve(op)
    except UnknownOpError:
        return None
    with _lock:
        return _resolutions.get(op)


def resolution_on(op: str, targets: tuple[_targets.Target, ...]) -> Resolution:
    """The readings of ``op`` on the given targets (a tool's own flags: the msprobe dump
    reader), whatever is declared; not cached, not what the guards enforce.  ``targets`` empty:
    this environment.  ``UnknownOpError`` if no contract is registered for ``op``."""
    from .readings import resolve_readings

    resolve(op)  # loads the shipped packs on a miss; raises for an unknown op
    return resolve_readings(op, _derived(candidates(op)), _targets.stacks(versions.current(), targets),
                            targets, merge_contracts, is_shipped)


def resolution_of(contract: Contract | None) -> Resolution | None:
    """The resolution whose enforced contract is ``contract`` (the very object), if any."""
    if contract is None:
        return None
    found = _resolutions.get(contract.op)
    return found if found is not None and found.strict is contract else None


def _derived(lst: list[Contract]) -> list[Contract]:
    """``lst`` with each ``rules_of`` contract replaced by the contracts it takes (``derive``)."""
    from .derive import derive

    out: list[Contract] = []
    for c in lst:
        out.extend(derive(c, _by_op.get(c.rules_of, ())) if c.rules_of else [c])
    return out


def expanded(op: str) -> list[Contract]:
    """Every contract of ``op``, ``rules_of`` ones replaced by what they take (all versions)."""
    with _lock:
        if not _shipped_loaded:
            load_shipped()
        return _derived(list(_by_op.get(op, ())))


def get_contract(op: str) -> Contract:
    c = resolve(op)
    if c is None:
        raise UnknownOpError(f"no contract for op {op!r} applies in this environment "
                             f"(see `opcontracts list --all`)")
    return c


def _merge_arg(a: Arg, b: Arg) -> Arg:
    """Both rules at once: the dtypes and the values both accept (in ``a``'s order), every rule
    either sets (``a``'s wins where both set the same field), optional only if both say so.
    Disjoint dtype sets cannot both hold: the narrower one is kept so calls are still checked."""
    from ..spec import Arg

    data = a.model_dump(by_alias=False)
    for k, v in b.model_dump(by_alias=False).items():
        if data.get(k) in (None, False) and v not in (None, False):
            data[k] = v
    # size limits name the sizes of a shape: they go with the shape they were written for
    # (one contract's shape with the other's dims may name sizes it does not have)
    if a.shape is not None and b.shape is not None and a.shape != b.shape:
        named = _names(a.shape)  # a's shape is kept: b's limits only on sizes it names
        dims = {k: v for k, v in (b.dims or {}).items() if k in named}
        dims.update(a.dims or {})
        data["dims"] = {k: v.model_dump() for k, v in dims.items()} or None
    if a.dtype is not None and b.dtype is not None:
        inter = tuple(d for d in a.dtype if d in b.dtype)
        data["dtype"] = inter or (b.dtype if len(b.dtype) < len(a.dtype) else a.dtype)
        # a mode's extra dtypes hold only where both allow them
        ea, eb = a.dtype_if_present or {}, b.dtype_if_present or {}
        extra = {k: tuple(d for d in ea[k] if d in eb[k]) for k in ea if k in eb}
        data["dtype_if_present"] = {k: v for k, v in extra.items() if v} or None
    elif b.dtype is not None:
        data["dtype_if_present"] = b.dtype_if_present
    if a.allowed is not None and b.allowed is not None:
        # both lists hold: the values both allow (disjoint ones: the shorter list is kept)
        both = [v for v in a.allowed if v in b.allowed]
        data["allowed"] = both or list(b.allowed if len(b.allowed) < len(a.allowed) else a.allowed)
    data["optional"] = a.optional and b.optional
    if a.layer != b.layer and a.layer is not None and b.layer is not None:
        # rules of two layers in one argument: each source says its layer
        data["layer"] = None
        data["source"] = join_sources(_with_layer(a.source, a.layer), _with_layer(b.source, b.layer))
    else:
        data["source"] = join_sources(a.source, b.source)
    return Arg.model_validate({("list" if k == "tensor_list" else k): v for k, v in data.items()})


def _with_layer(source: str | None, layer: str | None) -> str | None:
    return source if layer is None else f"{source or 'no source'} (layer {layer})"


def _names(shapes: tuple[str, ...]) -> set[str]:
    from .._lang.shapes import parse_shape

    return {n for sh in shapes for n in parse_shape(sh).names}


def _unique_cases(groups: Iterable[tuple[Any, ...]]) -> tuple[Any, ...]:
    """Every contract's cases (all of them hold: the strictest reading), each once."""
    out: list[Any] = []
    for cases in groups:
        out.extend(c for c in cases if c not in out)  # models compare by value, not by hash
    return tuple(out)


def merge_contracts(items: list[Contract]) -> Contract:
    """The strictest combination: intersected dtype sets, every other rule of every contract."""
    from ..spec import Contract

    first = items[0]
    args: dict[str, Arg] = {}
    for c in items:
        for name, a in c.args.items():
            own = a.model_copy(update={"source": a.source or c.source, "layer": a.layer or c.layer})
            args[name] = _merge_arg(args[name], own) if name in args else own
    targets = tuple(dict.fromkeys(t for c in items for t in c.targets))
    layers = {c.layer for c in items}
    return Contract(
        first.op, args, targets=targets,
        source=join_sources(*(c.source for c in items)),
        layer=layers.pop() if len(layers) == 1 else None,
        signature=first.signature, same_device=any(c.same_device for c in items),
        cases=_unique_cases(tuple(k.model_copy(update={"layer": k.layer or c.layer})
                                  for k in c.cases) for c in items),
        doc=first.doc, file=first.file,
    )


_shipped_loaded = False


def load_shipped() -> None:
    """Register the shipped contract packs once."""
    global _shipped_loaded
    with _lock:
        if _shipped_loaded:
            return
        from ..spec import load_contracts

        register(load_contracts(shipped_contracts_dir()), replace=True)
        _shipped_loaded = True


@dataclass(frozen=True)
class IndexEntry:
    """What the patch needs from a contract before it is validated: its op, targets and
    ``when`` table, read with ``tomllib`` alone (no pydantic at ``import opcontracts.patch``)."""

    op: str
    targets: tuple[str, ...]
    when: dict[str, Any] | None
    file: str
    args: dict[str, Any] | None = None
    """the raw argument tables (for the dtype-overlap check of users' contracts)"""


_index: list[IndexEntry] | None = None


def shipped_index() -> list[IndexEntry]:
    """The shipped contracts' ops, targets, ``when`` and argument tables (validated later, on
    first use; the test suite validates every shipped file): from ``contracts/index.json`` when
    it is current for the shipped files (their hashes match: ``contract_index``), else read from
    the files themselves."""
    global _index
    with _lock:
        if _index is None:
            folder = shipped_contracts_dir()
            entries = contract_index.load(folder)
            if entries is None:
                try:
                    entries = contract_index.entries_from_files(folder)
                except contract_index.UnreadableFile as exc:
                    raise ContractFileError(f"cannot read: {exc.reason}",
                                            file=str(exc.file)) from None
            _index = [IndexEntry(e["op"], tuple(e["targets"]), e.get("when"),
                                 str(folder / e["file"]), e.get("args")) for e in entries]
        return list(_index)


def applicable_targets() -> dict[str, tuple[str, ...]]:
    """op -> targets of the shipped contracts that (may) apply here, from the index."""
    stacks = _targets.stacks(versions.current())
    out: dict[str, tuple[str, ...]] = {}
    for e in shipped_index():
        if all(versions.applies(e.when, env) is False for env in stacks):
            continue
        out[e.op] = tuple(dict.fromkeys(out.get(e.op, ()) + e.targets))
    return out
