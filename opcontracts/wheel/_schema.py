"""The ``custom`` section of torch_npu's ``npu_native_functions_by_codegen.yaml``: the
``torch.ops.npu`` namespace, one function schema per overload, parsed into structured form.

The file is PyYAML output (keys sorted, one ``func:`` per entry); a small line reader takes the
``func:`` values of the ``custom`` section without a YAML dependency.  ``parse_func`` reads one
schema string the way torchgen does for what the tools need: argument names, types, whether a
tensor is optional (``Tensor?``) or a list (``Tensor[]``), defaults, keyword-only markers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Param", "OpSchema", "custom_funcs", "parse_func", "split_top", "by_op", "default_schemas"]


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    """the type as written, alias annotations removed (``Tensor?``, ``int[]?``, ``Tensor[]``)"""
    default: str | None = None
    """the default as written in the schema (``None``, ``False``, ``'half'``), or ``None``"""
    kw_only: bool = False

    @property
    def base(self) -> str:
        """``Tensor``, ``int``, ``float``, ``bool``, ``str``, ``ScalarType``, ..."""
        return re.sub(r"[\[\]?0-9]", "", self.type)

    @property
    def nullable(self) -> bool:
        """``None`` is a valid value (``Tensor?``, ``int[]?``, ``Tensor?[]`` elements)."""
        return self.type.endswith("?")

    @property
    def is_list(self) -> bool:
        return "[" in self.type

    @property
    def is_tensor(self) -> bool:
        return self.base == "Tensor"

    @property
    def has_default(self) -> bool:
        return self.default is not None

    def text(self) -> str:
        return f"{self.type} {self.name}" + (f"={self.default}" if self.default is not None else "")


@dataclass(frozen=True)
class OpSchema:
    name: str
    overload: str
    params: tuple[Param, ...]
    returns: str
    func: str
    """the schema string as in the yaml"""

    def param(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def tensor_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.is_tensor)


def _unquote(v: str) -> str:
    v = v.strip()
    if len(v) >= 2 and v[0] == v[-1] == "'":
        return v[1:-1].replace("''", "'")
    if len(v) >= 2 and v[0] == v[-1] == '"':
        return v[1:-1].encode("utf-8").decode("unicode_escape")
    return v


def custom_funcs(yaml_text: str) -> list[str]:
    """The ``func:`` values of the top-level ``custom:`` section, in file order."""
    out: list[str] = []
    inside = False
    for line in yaml_text.splitlines():
        if line and not line[0].isspace() and not line.startswith("-"):
            inside = line.split(":", 1)[0].strip() == "custom"
            continue
        if not inside:
            continue
        m = re.match(r"^(?:- |  )func:\s*(.*)$", line)
        if m:
            out.append(_unquote(m.group(1)))
    return out


def split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    tail = "".join(cur).strip()
    if tail or parts:
        parts.append(tail)
    return parts


_HEAD = re.compile(r"^\s*([A-Za-z_][\w]*)(?:\.([\w]+))?\s*\((.*)\)\s*->\s*(.*?)\s*$", re.DOTALL)


def parse_func(func: str) -> OpSchema:
    """``npu_x.ov(Tensor a, *, Tensor? b=None) -> Tensor`` as an ``OpSchema``.
    Raises ``ValueError`` naming the schema when it cannot be read."""
    m = _HEAD.match(func)
    if m is None:
        raise ValueError(f"cannot read schema {func!r}")
    name, overload, args, returns = m.group(1), m.group(2) or "", m.group(3), m.group(4)
    params: list[Param] = []
    kw_only = False
    for raw in split_top(args):
        if not raw:
            continue
        if raw == "*":
            kw_only = True
            continue
        decl, eq, default = raw.partition("=")
        decl = re.sub(r"\([^)]*\)", "", decl).strip()  # alias annotations: Tensor(a!) -> Tensor
        bits = decl.rsplit(None, 1)
        if len(bits) != 2:
            raise ValueError(f"cannot read argument {raw!r} of schema {func!r}")
        params.append(Param(bits[1], bits[0].replace(" ", ""),
                            default.strip() if eq else None, kw_only))
    return OpSchema(name, overload, tuple(params), returns, func)


def by_op(funcs: list[str]) -> dict[str, list[OpSchema]]:
    """op name -> its overloads, the default (no overload name) first, then in file order."""
    out: dict[str, list[OpSchema]] = {}
    for f in funcs:
        s = parse_func(f)
        out.setdefault(s.name, []).append(s)
    for lst in out.values():
        lst.sort(key=lambda s: s.overload != "")
    return out


def default_schemas(funcs: list[str]) -> dict[str, OpSchema]:
    """op name -> the overload a plain ``torch.ops.npu.op(...)`` call is checked against: the
    one without an overload name, else the first in the file."""
    return {op: lst[0] for op, lst in by_op(funcs).items()}
