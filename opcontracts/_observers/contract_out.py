"""Contracts written out as TOML (``opcontracts run --record``, ``opcontracts probe
--write-contract``): the subset contract files use, read back by ``load_contracts``.

Python's ``tomllib`` only reads; this writes strings, booleans, integers, floats, lists of them
and one level of inline tables (``when``, ``dims``), plus each contract's ``[contract.args.X]``
tables.  TOML has no null: ``None`` values are left out by the callers.

Strings are TOML basic strings with every character TOML forbids raw escaped (the controls
U+0000-U+001F and U+007F, ``"`` and ``\\``); comments carry no control character (a newline in
a recorded path would end the comment).  TOML cannot hold a lone surrogate (a file name in no
encoding, a string from a JSON ``"\\udc80"``) at all: in descriptive text (``source``, ``doc``,
comments) it is written as its escape's text (``\\udc80``); a rule's value holding one
(``allowed``) is not written, with a comment saying so, since any stand-in would pin another
value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["dumps_contracts"]

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPE = re.compile(r'[\x00-\x1f\x7f"\\\ud800-\udfff]')
_SHORT = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"',
          "\\": "\\\\"}
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_COMMENT_BAD = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\ud800-\udfff]")


class Unwritable(ValueError):
    """A value TOML cannot hold as it is (a string with a lone surrogate)."""


def _escape(m: re.Match[str]) -> str:
    ch = m.group()
    if ch in _SHORT:
        return _SHORT[ch]
    if "\ud800" <= ch <= "\udfff":  # no TOML escape names it: its escape's text
        return f"\\\\u{ord(ch):04x}"
    return f"\\u{ord(ch):04x}"


def _string(v: str, exact: bool) -> str:
    """``v`` as a TOML basic string; ``Unwritable`` when ``exact`` and TOML cannot hold it."""
    if exact and _SURROGATE.search(v):
        raise Unwritable(f"{v!r} holds a lone surrogate, which TOML cannot hold")
    return '"' + _ESCAPE.sub(_escape, v) + '"'


def comment(text: str) -> str:
    """``text`` fit for a TOML comment: control characters and lone surrogates as escapes."""
    return _COMMENT_BAD.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace")
                            .decode("ascii"), text)


def _key(k: str) -> str:
    return k if _BARE.match(k) else _string(k, exact=True)


def _value(v: Any, exact: bool = False) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v, exact)
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_key(str(k))} = {_value(x, exact)}" for k, x in v.items()
                               if x is not None) + "}"
    if isinstance(v, Sequence):
        return "[" + ", ".join(_value(x, exact) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _table(c: Mapping[str, Any]) -> list[str]:
    out = ["[[contract]]"]
    for k, v in c.items():
        if k == "args" or v is None:
            continue
        # ``op`` and ``targets`` name code: exact; the rest is descriptive text
        out.append(f"{_key(k)} = {_value(v, exact=k in ('op', 'targets', 'when'))}")
    for name, fields in dict(c.get("args", {})).items():
        out.append("")
        out.append(f"[contract.args.{_key(name)}]")
        for k, v in fields.items():
            if v is None:
                continue
            try:
                out.append(f"{_key(k)} = {_value(v, exact=k not in ('doc', 'source', 'hint'))}")
            except Unwritable as exc:
                out.append(comment(f"# {k}: not written: {exc}"))
    return out


def _problem(c: Mapping[str, Any], text: str) -> str | None:
    """Why the table ``text`` written for ``c`` would not load, or None."""
    from ..errors import ContractFileError
    from ..spec import contracts_from_toml

    if not c.get("args"):
        return "no rule to write (no argument gave one)"
    try:
        contracts_from_toml(text, "<written>")
    except ContractFileError as exc:
        return str(exc).replace("<written>: ", "").replace("\n", "; ")
    return None


def dumps_contracts(contracts: Sequence[Mapping[str, Any]], header: Sequence[str] = ()) -> str:
    """``[[contract]]`` tables for plain-data contracts (``op``, ``targets``, ``source``,
    ``when``, ``doc``, ``args``: name -> field -> value); ``header`` lines become comments.

    Every table written loads (``load_contracts``): each is read back before it is kept, and
    one that would not load (no rule at all, a name no checker can take) is left out with a
    comment that says why, so a generated file never stops the next job."""
    out = [comment(f"# {line}".rstrip()) for line in header]
    for c in contracts:
        why: str | None
        try:
            table = _table(c)
        except Unwritable as exc:
            table, why = [], str(exc)
        else:
            why = _problem(c, "\n".join(table) + "\n")
        if out:
            out.append("")
        if why is not None:
            out.append(comment(f"# {c.get('op')}: not written: {why}"))
            continue
        out.extend(table)
    return "\n".join(out) + "\n"


def stack() -> dict[str, str | None]:
    """The detected versions a generated contract speaks for (``_lang.versions.current()``), with
    opcontracts' own; emulated packages marked."""
    from .._lang import versions
    from .._version import __version__

    env = versions.current()
    out: dict[str, str | None] = {"opcontracts": __version__}
    for name in versions.FIELDS:
        v = getattr(env, name)
        out[name] = f"{v} (emulation)" if v is not None and name in env.emulated else v
    return out


def stack_text() -> str:
    """``opcontracts 0.1.0, torch 2.13.0, torch_npu 2.13.0 (emulation), cann unknown, ...``"""
    return ", ".join(f"{k} {v or 'unknown'}" for k, v in stack().items())


def utc_now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
