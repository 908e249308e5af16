"""The options of a command that runs a script (``run``, ``preflight``), read word by word.

``opcontracts run [options] script.py [args]`` cannot use argparse for its own options: every
word after the script (or ``-m module``) is the script's, whatever it looks like.  ``Words``
reads ``--flag VALUE`` and ``--flag=VALUE`` alike and ends at the script; each command keeps
only its own flags.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["UsageError", "Words"]


class UsageError(Exception):
    """Bad arguments of a script-running command (exit status 2)."""


class Words:
    """A command line up to the script: iterate over it; ``value`` takes a flag's value."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.words = list(argv)
        self.i = 0

    def __iter__(self) -> Iterator[str]:
        while self.i < len(self.words):
            yield self.words[self.i]
            self.i += 1

    def peek(self, ahead: int = 1) -> str | None:
        j = self.i + ahead
        return self.words[j] if j < len(self.words) else None

    def value(self, flag: str, word: str) -> str:
        """``--flag=VALUE``'s value, or the next word's for ``--flag VALUE``."""
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
        if self.i + 1 >= len(self.words):
            raise UsageError(f"{flag} needs a value")
        self.i += 1
        return self.words[self.i]

    def take_next(self) -> str:
        self.i += 1
        return self.words[self.i]

    def ends_here(self, word: str, opts: Any, *, script_required: bool) -> bool:
        """Whether ``word`` ends the options: ``-m module`` or the script (``opts.module`` /
        ``opts.script`` and ``opts.args`` set), ``--`` before the script; an option this
        command does not know is a ``UsageError``.  False for a word that is no such thing."""
        if word == "-m" or (word.startswith("-m") and len(word) > 2 and not word.startswith("--")):
            opts.module = word[2:] if len(word) > 2 else self.value("-m", word)
            opts.args = self.words[self.i + 1:]
            return True
        if word == "--":
            if self.i + 1 < len(self.words):
                opts.script, opts.args = self.words[self.i + 1], self.words[self.i + 2:]
            elif script_required:
                raise UsageError("a script or -m module is required")
            return True
        if word.startswith("-"):
            raise UsageError(f"unknown option {word!r} (options go before the script name)")
        opts.script, opts.args = word, self.words[self.i + 1:]
        return True
