"""The shipped contracts' targets, precomputed: what ``import opcontracts.patch`` reads.

The patch needs, at import, each shipped contract's op, targets and ``when`` table.  Parsing
the contract files with ``tomllib`` for that was a third of ``import opcontracts.patch``
(~17 ms of 63 on a quiet machine); the same entries, written once to ``contracts/index.json``
with a hash of every contract file they were read from, load in well under a millisecond, and
hashing the files (blake2b) is cheaper than parsing them.

Never wrong targets: the index is used only when it names exactly the contract files that are
there, each with the hash it was built from; any difference (a file edited, added, removed,
an index missing or unreadable) and the caller reads the files themselves, as before.  The
test suite checks that the committed index is current; regenerate it with::

    python -m opcontracts._engine.contract_index
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from .._jsonout import replace_text

__all__ = ["INDEX_NAME", "UnreadableFile", "build", "entries_from_files", "fingerprint", "load", "shipped_folder",
           "write"]

INDEX_NAME = "index.json"
_VERSION = 1


def shipped_folder() -> Path:
    """The folder of contract files shipped with the package (``opcontracts/contracts``)."""
    try:
        from importlib.resources import files

        p = Path(str(files("opcontracts.contracts")))
        if p.is_dir():
            return p
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - broken install
        pass
    return Path(__file__).resolve().parents[2] / "contracts"  # pragma: no cover - a checkout


def _files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.toml"))


def fingerprint(folder: Path) -> dict[str, str]:
    """Each contract file under ``folder`` (posix path relative to it) -> its blake2b hash."""
    return {f.relative_to(folder).as_posix(): hashlib.blake2b(f.read_bytes(),
                                                              digest_size=16).hexdigest()
            for f in _files(folder)}


class UnreadableFile(Exception):
    """A contract file that cannot be read or is not TOML (``file``, ``reason``)."""

    def __init__(self, file: Path, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason


def entries_from_files(folder: Path) -> list[dict[str, Any]]:
    """The entries, read from the contract files (``tomllib`` alone: no pydantic at ``import
    opcontracts.patch``): op, targets, when, the raw argument tables, file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    out: list[dict[str, Any]] = []
    for f in _files(folder):
        try:
            data = tomllib.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise UnreadableFile(f, str(exc)) from None
        for t in data.get("contract", []):
            targets = t.get("targets", ())
            targets = [targets] if isinstance(targets, str) else list(targets)
            args = t.get("args")
            out.append({"op": str(t.get("op")), "targets": targets, "when": t.get("when"),
                        "args": args if isinstance(args, dict) else None,
                        "file": f.relative_to(folder).as_posix()})
    return out


def build(folder: Path) -> dict[str, Any]:
    """The index of ``folder``'s contract files."""
    return {"version": _VERSION, "files": fingerprint(folder),
            "entries": entries_from_files(folder)}


def load(folder: Path) -> list[dict[str, Any]] | None:
    """The index's entries when it is current for ``folder``'s files; None when it is
    missing, unreadable, of another version or stale (the caller then reads the files)."""
    try:
        data = json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return None
    try:
        current = fingerprint(folder)
    except OSError:
        return None
    if data.get("files") != current:
        return None
    entries = data.get("entries")
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("op"), str)
            and isinstance(e.get("targets"), list) and e.get("file") in current
            and isinstance(e.get("args"), (dict, type(None)))
            for e in entries):
        return None
    return entries


def write(folder: Path) -> Path:
    """(Re)write ``folder``'s index; returns its path."""
    path = folder / INDEX_NAME
    replace_text(path, json.dumps(build(folder), indent=1, sort_keys=True) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and (args[0].startswith("-") or len(args) > 1):
        print("usage: python -m opcontracts._engine.contract_index [CONTRACTS_FOLDER]\n"
              "(re)write the folder's index.json; default: the shipped contracts", file=sys.stderr)
        return 0 if args[0] in ("-h", "--help") else 2
    folder = Path(args[0]) if args else shipped_folder()
    print(f"wrote {write(folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
