"""JSON output, one way for every command and file: ``--json [FILE]``, strict JSON, clean errors.

Every ``opcontracts`` command that speaks JSON (``list``, ``env``, ``demo``, ``run``, ``report
merge``, ``probe``, ``wheel verify`` / ``diff``, and those added later) declares the option with
``add_json_option`` and writes with ``write_json``; report files are written with ``json_text``
too.  So ``--json`` means one thing everywhere:

* bare ``--json`` or ``--json -``: the JSON goes to stdout, instead of the human text;
* ``--json FILE``: the human text as usual, and the JSON in ``FILE`` (folders created);
  where an optional positional may follow (``list --json PATTERN``), a word that neither ends
  with ``.json`` nor names a folder is that positional (``settle``).

The text is strict JSON (RFC 8259): a float that is not finite is written as the string
``"nan"``, ``"inf"`` or ``"-inf"`` (what ``float()`` reads back), never as a bare ``NaN`` or
``Infinity`` that strict parsers (``jq``, JavaScript, Go) reject.  A file that cannot be
written is an ``OutputError`` naming the option and the path (one line, exit status 2);
``check_writable`` says so before the work starts.

Every file opcontracts writes (these, report files, contract files, digests) is written by
``replace_bytes``: the text is encoded first, written to a temporary file in the same folder
and renamed over the target (``os.replace``), so a text that cannot be encoded or a write that
fails leaves the file that was there as it was, never empty or cut short.

This module sits in the bottom layer (it imports only ``errors``): the wheel tools, the engine's
report files and the command line all use it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from typing import IO, Any

from .errors import OpContractsError

__all__ = ["OutputError", "add_json_option", "check_writable", "json_text", "replace_bytes",
           "replace_text", "settle", "strict", "to_stdout", "write_json", "write_text"]

STDOUT = "-"


class OutputError(OpContractsError):
    """An output file that cannot be written: the message names the option and the path."""


def strict(data: Any) -> Any:
    """``data`` with every non-finite float as the string ``"nan"``, ``"inf"`` or ``"-inf"``
    (containers copied only where they hold one)."""
    if isinstance(data, float):
        if math.isfinite(data):
            return data
        return "nan" if math.isnan(data) else ("inf" if data > 0 else "-inf")
    if isinstance(data, Mapping):
        return {k: strict(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [strict(v) for v in data]
    return data


def json_text(data: Any, *, indent: int | None = 2) -> str:
    """Strict JSON text of ``data`` (objects it does not know are written as ``str``)."""
    text = json.dumps(strict(data), indent=indent, ensure_ascii=False, allow_nan=False,
                      default=str)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (a file name in no encoding): escaped
            text = json.dumps(strict(data), indent=indent, allow_nan=False, default=str)
    return text


def to_stdout(target: str | None) -> bool:
    """Whether ``--json`` was given without a file (bare, or ``-``): JSON on stdout."""
    return target == STDOUT


def add_json_option(parser: Any, what: str = "the results") -> None:
    """``--json [FILE]`` on an argparse parser: ``ns.json`` is None (not given), ``"-"``
    (stdout) or the file."""
    parser.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="FILE",
                        help=f"{what} as JSON: on stdout instead of the text (bare --json, or "
                        "--json -), or in FILE next to the text")


def settle(ns: Any, positional: str) -> None:
    """For a command with an optional positional after which ``--json`` may come (``list
    --json PATTERN``): a word ``--json`` took that is no file name (it neither ends with
    ``.json`` nor names a folder) is the positional, and the JSON goes to stdout."""
    target = getattr(ns, "json", None)
    if target in (None, STDOUT) or getattr(ns, positional, None) is not None:
        return
    if target.endswith(".json") or os.sep in target or "/" in target:
        return
    setattr(ns, positional, target)
    ns.json = STDOUT


def check_writable(path: str, option: str) -> None:
    """``OutputError`` now, before any work, when ``path`` cannot be written later: a folder
    where a file should be, a parent that is a file, an existing file that cannot be opened for
    writing, a folder in which no file can be created.  Tried for real (the file opened
    without truncating it, or a temporary file made and removed in the nearest existing
    folder: permissions, a read-only file system), so nothing is left behind; a missing folder
    is not made here (``write_text`` makes it)."""
    if path == STDOUT:
        return
    why = _unwritable(path)
    if why:
        raise OutputError(f"{option} {path}: cannot write: {why}")


def _unwritable(path: str) -> str | None:
    if "\0" in path:
        return "the path holds a NUL character"
    if os.path.isdir(path):
        return "it is a folder"
    if os.path.lexists(path):
        try:
            with open(path, "r+b"):  # opened for writing, not truncated, nothing written
                pass
        except OSError as exc:
            return _why(exc)
        return None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # created when written: the first existing one decides
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    if not os.path.isdir(parent):
        return f"{parent} is not a folder"
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=".opcontracts-", suffix=".tmp", dir=parent)
    except OSError as exc:
        return f"{parent}: {_why(exc)}"
    os.close(fd)
    try:
        os.remove(probe)
    except OSError:  # pragma: no cover - made a moment ago
        pass
    return None


def _why(exc: OSError) -> str:
    return exc.strerror if exc.strerror else str(exc)


def replace_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: into a temporary file beside it, then
    renamed over it (``os.replace``, atomic on one file system); the file's mode is kept.  A
    path that names no regular file (``/dev/stdout``, a pipe) is written directly.  Folders
    are created.  ``OSError`` when it cannot be written (the temporary file removed)."""
    target = os.path.realpath(os.fspath(path))  # through a symbolic link, as open() writes
    if os.path.exists(target) and not os.path.isfile(target):
        with open(target, "wb") as f:
            f.write(data)
        return
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(target)}.{os.getpid()}."
                               f"{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "xb") as f:  # created with the umask's mode, as open(path, "w") would
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(target):
            os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def replace_text(path: str | os.PathLike[str], text: str) -> None:
    """``text`` in UTF-8, written whole or not at all (``replace_bytes``); a text UTF-8 cannot
    encode (a lone surrogate) is a ``UnicodeEncodeError`` before the file is touched."""
    replace_bytes(path, text.encode("utf-8"))


def write_text(path: str, text: str, option: str) -> str:
    """Write ``text`` to ``path`` (folders created), whole or not at all; ``OutputError``
    naming ``option`` and the path when it cannot be.  Returns the path."""
    try:
        replace_text(path, text)
    except UnicodeEncodeError as exc:
        raise OutputError(f"{option} {path}: cannot write: the text holds a character UTF-8 "
                          f"cannot encode ({exc.object[exc.start:exc.end]!r})") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = _why(exc) if isinstance(exc, OSError) else str(exc)
        raise OutputError(f"{option} {path}: cannot write: {why}") from None
    return path


def write_json(target: str, data: Any, *, option: str = "--json",
               stdout: IO[str] | None = None) -> None:
    """The JSON of ``data`` on stdout (``target`` ``"-"``) or in the file ``target``."""
    text = json_text(data) + "\n"
    if to_stdout(target):
        (stdout or sys.stdout).write(text)
        return
    write_text(target, text, option)
