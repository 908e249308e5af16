"""A JSON object read one member at a time, in bounded memory.

msprobe's ``dump.json`` of a large model runs to gigabytes, nearly all of it one object
(``data``: API name -> entry); ``json.loads`` of it holds the whole text and every entry at
once.  ``ObjectStream`` reads the file in chunks and hands out the members of the top-level
object, and of any object member the caller descends into, one at a time: each member's value
is decoded by ``json.JSONDecoder.raw_decode`` (the standard library's C scanner) and nothing is
kept once the caller has it.  Memory is one chunk plus the largest member.

Malformed text is a ``StreamError`` with the line and column, as ``json.loads`` says them; a
member nested deeper than the decoder can recurse, or larger than ``MAX_MEMBER`` characters,
is one too, naming the member.  Duplicate keys are handed out as they come (``json.loads``
keeps the last).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["ObjectStream", "StreamError", "CHUNK", "MAX_MEMBER"]

CHUNK = 1 << 20
"""characters read at a time"""
MAX_MEMBER = 256 << 20
"""the most characters one member's value may span (msprobe's entries are a few kB)"""

_WS = re.compile(r"[ \t\n\r]*")
# a member's key without escapes, and its colon: the common case, read in one match
_FIRST_KEY = re.compile(r'[ \t\n\r]*"([^"\\\x00-\x1f]*)"[ \t\n\r]*:')
_NEXT_KEY = re.compile(r'[ \t\n\r]*,[ \t\n\r]*"([^"\\\x00-\x1f]*)"[ \t\n\r]*:')
_DECODER = json.JSONDecoder()
# what raw_decode says of text that is cut short rather than malformed
_NEAR_END = 16
_KINDS = {"{": "an object", "[": "a list", '"': "a string", "t": "a boolean", "f": "a boolean",
          "n": "null"}


class StreamError(ValueError):
    """Text that is not the JSON expected: ``what`` says where (a member, or line and column)."""


class ObjectStream:
    """``with open(path, encoding="utf-8") as f: s = ObjectStream(f)``; then
    ``for key in s.members(): ...`` where the body reads the member's value with ``s.value()``
    or, for an object, descends with ``s.members(key)`` (or skips it with ``s.value()``)."""

    def __init__(self, f: IO[str]) -> None:
        self._f = f
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._lines = 0  # newlines in the text already dropped
        self._col = 0    # characters after the last newline dropped
        self._pending = False

    # -- reading ---------------------------------------------------------------------
    def _fill(self, at_least: int = CHUNK) -> bool:
        if self._eof:
            return False
        chunk = self._f.read(max(at_least, CHUNK))
        if not chunk:
            self._eof = True
            return False
        if self._pos:
            dropped = self._buf[:self._pos]
            nl = dropped.count("\n")
            if nl:
                self._lines += nl
                self._col = len(dropped) - dropped.rfind("\n") - 1
            else:
                self._col += len(dropped)
            self._buf = self._buf[self._pos:] + chunk
            self._pos = 0
        else:
            self._buf += chunk
        return True

    def peek(self) -> str:
        """The next character that is not whitespace (not consumed), ``""`` at the end."""
        while True:
            m = _WS.match(self._buf, self._pos)
            assert m is not None
            self._pos = m.end()
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._fill():
                return ""

    def where(self, pos: int | None = None) -> str:
        """``line L, column C`` of ``pos`` in the buffer (the current position by default)."""
        p = self._pos if pos is None else pos
        nl = self._buf.count("\n", 0, p)
        if nl:
            col = p - self._buf.rfind("\n", 0, p)
        else:
            col = self._col + p + 1
        return f"line {self._lines + nl + 1}, column {col}"

    def error(self, msg: str, pos: int | None = None) -> StreamError:
        return StreamError(f"not JSON ({self.where(pos)}: {msg})")

    def kind(self) -> str:
        """What the next value is, in words (``an object``, ``a list``, ``a number`` ...)."""
        return _KINDS.get(self.peek(), "a number")

    def value(self, what: str = "") -> Any:
        """The next value, decoded; ``what`` names it in errors (``data['NPU.x.0.forward']``)."""
        self._pending = False
        if not self.peek():
            raise self.error("Expecting value")
        while True:
            try:
                obj, end = _DECODER.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                cut = exc.msg.startswith("Unterminated string") or \
                    exc.pos >= len(self._buf) - _NEAR_END
                if cut and not self._eof:
                    if len(self._buf) - self._pos > MAX_MEMBER:
                        raise StreamError(f"{what or 'a value'}: more than {MAX_MEMBER >> 20} "
                                          f"MB of text from {self.where()} (one msprobe entry "
                                          "is a few kB)") from None
                    self._fill(len(self._buf) - self._pos)
                    continue
                raise self.error(exc.msg, exc.pos) from None
            except RecursionError:
                raise StreamError(f"{what or 'a value'} at {self.where()}: nested too deeply "
                                  "to read (lists or objects inside one another, about a "
                                  "thousand deep or more)") from None
            if end == len(self._buf) and not self._eof and self._fill():
                continue  # a number at the end of the chunk may go on in the next one
            self._pos = end
            return obj

    def members(self, what: str = "") -> Iterator[str]:
        """The keys of the object that comes next, one at a time; after each, the caller reads
        (or descends into) its value before asking for the next key."""
        if self.peek() != "{":
            raise self.error("Expecting '{'")
        self._pos += 1
        self._pending = False
        first = True
        while True:
            if self._pending:
                raise RuntimeError("ObjectStream.members: a member's value was not read")
            m = (_FIRST_KEY if first else _NEXT_KEY).match(self._buf, self._pos)
            if m is not None:
                self._pos = m.end()
                first = False
                self._pending = True
                yield m.group(1)
                continue
            c = self.peek()
            if c == "}":
                self._pos += 1
                return
            if not first:
                if c != ",":
                    raise self.error("Expecting ',' delimiter")
                self._pos += 1
                c = self.peek()
            if c != '"':
                raise self.error("Expecting property name enclosed in double quotes")
            key = self.value(what)
            if self.peek() != ":":
                raise self.error("Expecting ':' delimiter")
            self._pos += 1
            first = False
            self._pending = True
            yield key

    def end(self) -> None:
        """``StreamError`` unless only whitespace is left."""
        if self.peek():
            raise self.error("Extra data")
