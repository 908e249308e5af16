"""Targets: the stacks (torch_npu, CANN, SoC, MindSpeed) a call is judged against.

A CPU test machine knows no CANN and no chip, so a rule that depends on them has several
possible readings (see ``_engine.readings``).  Targets say which stacks the code is meant for;
with several (a fleet's CI), a call must hold on every one.  Where they come from, the first
that declares any:

=============================== =============================================================
``opcontracts.set_targets()``   in code (tests: a fixture)
``OPCONTRACTS_TARGETS``         ``cann=8.0.RC3,soc=Ascend910B3; torch_npu=2.7.1.post6,cann=8.5.0``
                                (stacks separated by ``;``, ``name=value`` pairs by ``,``;
                                ``none`` declares no target, over ``pyproject.toml``)
``pyproject.toml``              the nearest one, from the working directory upwards, with a
                                ``[tool.opcontracts]`` table holding ``targets``
=============================== =============================================================

A target names some of ``torch_npu``, ``cann``, ``soc``, ``mindspeed``, ``torch`` (and an
optional ``name`` for messages); what it leaves out comes from the environment (versions set
with ``set_versions``/``OPCONTRACTS_*_VERSION``, else detected).  What it names wins over
detection: a test run on the emulation (torch_npu 2.13 "detected") judges against the target's
torch_npu.  Without targets, the one stack judged is the environment itself.

Bad input (an unknown field, a value that is not a version, an unreadable ``pyproject.toml``)
raises ``SettingError`` naming the variable, or the file and the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SettingError
from .versions import FIELDS, Env, normalize_version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["VAR", "Target", "set_targets", "declared", "stacks", "judged", "find_pyproject",
           "parse_targets_text", "check"]

VAR = "OPCONTRACTS_TARGETS"
_KEYS = (*FIELDS, "name")
PYPROJECT_KEYS = ("targets",)
"""the keys a ``[tool.opcontracts]`` table may hold (another is a typo: a ``SettingError``)"""


@dataclass(frozen=True)
class Target:
    """One declared stack: the versions it names, its optional name, where it was declared."""

    versions: tuple[tuple[str, str], ...]
    name: str | None = None
    origin: str = ""

    def get(self, field: str) -> str | None:
        return dict(self.versions).get(field)

    def as_dict(self) -> dict[str, str]:
        out = dict(self.versions)
        if self.name:
            out["name"] = self.name
        return out

    @property
    def label(self) -> str:
        """``target 'a2-train' (torch_npu 2.7.1.post6, cann 8.5.0)``"""
        what = ", ".join(f"{k} {v}" for k, v in self.versions) or "the environment"
        return f"target {self.name!r} ({what})" if self.name else f"target ({what})"


def _string_targets(text: str, where: str) -> list[Target]:
    """The targets of one ``cann=8.0.RC3,soc=...`` string.  A field given several values
    (``cann=8.0.RC3,cann=9.1.0``) means one stack per value, each with the other fields;
    several fields so given, every combination.  A target has one ``name``."""
    table: dict[str, list[str]] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise SettingError(f"{where}: {part.strip()!r} is not name=value (try "
                               "'cann=8.0.RC3,soc=Ascend910B3')")
        values = table.setdefault(key.strip(), [])
        if value.strip() not in values:
            values.append(value.strip())
    if len(table.get("name", ())) > 1:
        raise SettingError(f"{where}: field name given {len(table['name'])} values "
                           f"({', '.join(table['name'])}); a target has one name (separate "
                           "targets with ';': 'cann=8.0.RC3,name=a2; cann=9.1.0,name=a5')")
    combos: list[dict[str, str]] = [{}]
    for key, values in table.items():
        combos = [{**c, key: v} for c in combos for v in values]
    return [_target(c, where) for c in combos]


def _target(data: Any, where: str) -> Target:
    """A target from a table (``{cann = "8.0.RC3"}``); ``where`` names the place for errors
    (``$OPCONTRACTS_TARGETS``, ``file: tool...[1]``)."""
    if not isinstance(data, Mapping):
        raise SettingError(f"{where}: a target is a table such as {{cann = \"8.0.RC3\"}}, got "
                           f"{type(data).__name__} {data!r}")
    versions: list[tuple[str, str]] = []
    name = None
    for key, value in data.items():
        if key not in _KEYS:
            raise SettingError(f"{where}: unknown field {key!r} (a target names "
                               f"{', '.join(_KEYS)})")
        if not isinstance(value, str) or not value.strip():
            raise SettingError(f"{where}, field {key}: expected a non-empty string, got "
                               f"{type(value).__name__} {value!r}")
        value = value.strip()
        if key == "name":
            name = value
        elif key != "soc" and normalize_version(value) is None:
            raise SettingError(f"{where}, field {key}: {value!r} is not a version (try '2.10.0.post4' "
                               "or '8.0.RC3')")
        else:
            versions.append((key, value))
    order = {f: i for i, f in enumerate(FIELDS)}
    return Target(tuple(sorted(versions, key=lambda kv: order[kv[0]])), name)


def parse_targets_text(text: str, where: str = VAR) -> tuple[Target, ...]:
    """``OPCONTRACTS_TARGETS``'s value as targets: stacks separated by ``;``; ``none`` (or
    nothing) declares none."""
    if text.strip().lower() in ("", "none"):
        return ()
    parts = [p for p in text.split(";") if p.strip()]
    many = len(parts) > 1
    out: list[Target] = []
    for i, part in enumerate(parts):
        at = f"{where} (target {i + 1} of {len(parts)})" if many else where
        out.extend(dataclasses.replace(t, origin=f"${where}" if where == VAR else where)
                   for t in _string_targets(part, at))
    return tuple(out)


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest ``pyproject.toml`` with a ``[tool.opcontracts]`` table, from ``start`` (the
    working directory) upwards."""
    d = (start or Path.cwd()).resolve()
    for folder in (d, *d.parents):
        f = folder / "pyproject.toml"
        try:
            if not f.is_file():
                continue
            raw = f.read_bytes()
        except OSError:
            continue
        if b"opcontracts" not in raw:  # not ours: keep looking (cheap test before parsing)
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SettingError(f"{f}: not UTF-8 (byte {exc.start}: {exc.reason}), which TOML "
                               "requires; opcontracts reads its [tool.opcontracts] table "
                               "(save the file as UTF-8)") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SettingError(f"{f}: invalid TOML ({exc}); opcontracts reads its "
                               "[tool.opcontracts] table") from None
        if isinstance(data.get("tool"), Mapping) and "opcontracts" in data["tool"]:
            return f
    return None


def _from_pyproject(path: Path) -> tuple[Target, ...]:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    table = data["tool"]["opcontracts"]
    where = f"{path}, [tool.opcontracts]"
    if not isinstance(table, Mapping):
        raise SettingError(f"{where}: expected a table, got {type(table).__name__}")
    for key in table:
        if key not in PYPROJECT_KEYS:
            near = difflib.get_close_matches(str(key), PYPROJECT_KEYS, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise SettingError(f"{where}: unknown key {key!r} ({hint}the table holds "
                               f"{', '.join(PYPROJECT_KEYS)}; docs/targets.md)")
    items = table.get("targets")
    if items is None:
        return ()
    if isinstance(items, Mapping):
        items = [items]
    if not isinstance(items, list):
        raise SettingError(f"{where} targets: expected a list of tables such as "
                           "[{cann = \"8.0.RC3\"}], got " + type(items).__name__)
    return tuple(dataclasses.replace(_target(t, f"{where} targets[{i}]"),
                                     origin=f"{path} [tool.opcontracts] targets[{i}]")
                 for i, t in enumerate(items))


_lock = threading.Lock()
_in_code: tuple[Target, ...] | None = None
_cache: tuple[tuple[str | None, str], tuple[tuple[Target, ...], str]] | None = None


def declared() -> tuple[tuple[Target, ...], str]:
    """The declared targets and where they come from (``set_targets()``, ``$OPCONTRACTS_TARGETS``,
    a ``pyproject.toml``), or ``((), "")`` when none is.  Read once per working directory and
    value of the variable; ``SettingError`` on a bad value."""
    global _cache
    if _in_code is not None:
        return _in_code, "set_targets()"
    key = (os.environ.get(VAR), os.getcwd())
    c = _cache
    if c is not None and c[0] == key:
        return c[1]
    raw = key[0]
    if raw is not None and raw.strip():
        found: tuple[tuple[Target, ...], str] = (parse_targets_text(raw), f"${VAR}")
    else:
        path = find_pyproject(Path(key[1]))
        found = ((), "") if path is None else (_from_pyproject(path), str(path))
        if not found[0]:
            found = ((), "")
    with _lock:
        _cache = (key, found)
    return found


def check() -> None:
    """Raise ``SettingError`` now if the declared targets cannot be read (called when guards are
    made, so a bad setting stops the start-up, not a call)."""
    declared()


def set_targets(*targets: Mapping[str, str] | str, **fields: str) -> tuple[dict[str, str], ...]:
    """Declare the stacks to judge calls against, over ``OPCONTRACTS_TARGETS`` and
    ``pyproject.toml``.

    ``set_targets(cann="8.0.RC3", soc="Ascend910B3")`` declares one stack;
    ``set_targets({"cann": "8.0.RC3"}, {"cann": "9.1.0"})`` several (a call must hold on every
    one); strings in ``OPCONTRACTS_TARGETS``'s form are accepted too.  Without arguments it drops
    the declaration made in code (back to the variable and ``pyproject.toml``, read again).
    Returns the previous in-code declaration, so ``prev = set_targets(...); ...;
    set_targets(*prev)`` restores it.  Every guard that follows the registry decides anew on its
    next call.
    """
    global _in_code, _cache
    items: list[Target] = []
    for i, t in enumerate(targets):
        where = f"set_targets(#{i})"
        items.extend(parse_targets_text(t, where) if isinstance(t, str) else (_target(t, where),))
    if fields:
        items.append(_target(fields, "set_targets()"))
    new = tuple(dataclasses.replace(t, origin="set_targets()") for t in items) if items else None
    with _lock:
        prev = _in_code
        _in_code = new
        _cache = None
    _invalidate_registry()
    return tuple(t.as_dict() for t in prev or ())


def _invalidate_registry() -> None:
    # the registry (a higher layer) imports this module, never the reverse
    reg = sys.modules.get("opcontracts._engine.registry")
    if reg is not None:
        reg.invalidate()


def stacks(env: Env, targets: tuple[Target, ...] | None = None) -> tuple[Env, ...]:
    """The stacks to judge against: each target over ``env`` (what a target names replaces
    what was detected), or ``env`` itself when no target is declared.  ``targets`` given
    (flags of a tool) win over the declared ones."""
    chosen = declared()[0] if targets is None else targets
    if not chosen:
        return (env,)
    out = []
    for t in chosen:
        given = dict(t.versions)
        origins = dict(env.origins)
        origins.update({k: t.origin or "target" for k in given})
        out.append(dataclasses.replace(
            env, **given, origins=tuple(origins.items()),
            emulated=tuple(e for e in env.emulated if e not in given)))
    return tuple(out)


def judged(flags: Sequence[Mapping[str, str] | str] | None = None,
           env: Env | None = None) -> list[tuple[str, Env]]:
    """The stacks a tool judges against, each with its label for messages: the tool's own flags
    (tables, or strings in ``OPCONTRACTS_TARGETS``'s form), else the declared targets, else this
    environment (``versions.current()``).  ``SettingError`` on a bad flag or setting."""
    from . import versions

    base = versions.current() if env is None else env
    chosen: tuple[Target, ...] | None = None
    if flags:
        items: list[Target] = []
        for i, f in enumerate(flags):
            where = f"target #{i + 1}"
            items.extend(parse_targets_text(f, where) if isinstance(f, str) else (_target(f, where),))
        chosen = tuple(items)
    else:
        chosen = declared()[0]
    out = stacks(base, chosen)
    if not chosen:
        return [("this environment", out[0])]
    return [(t.label, e) for t, e in zip(chosen, out)]
