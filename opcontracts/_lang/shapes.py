"""The shape-string language: parse once, then let the compiler emit straight-line checks.

A shape is a string of space-separated dimensions::

    "N*K H"      two dims: an expression over names, then a name that binds a size
    "... S 2*D"  any number of leading dims, then S, then an even size (D binds to half of it)
    "_ 128"      any size, then exactly 128

Names bind across every argument of one call, so ``"N*K"`` on one argument and ``"N K"`` on
another check the relation between them.  Expressions use ``* + - //``, integers and names.

A dimension name is a letter followed by letters, digits or ``_`` (``n_tokens``), and not a
Python keyword; ``_`` alone is "any one dimension".  A shape has at most ``MAX_DIMS``
dimensions and an expression at most ``MAX_OPS`` operators: contract files come from users,
and a 1,500-term expression would only exhaust the parser's (and the compiler's) recursion.
"""

from __future__ import annotations

import ast
import keyword
import re
from dataclasses import dataclass, field

__all__ = ["Dim", "ShapeSpec", "parse_shape", "eval_dim"]

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
NAME_RULE = ("a dimension name is a letter followed by letters, digits or '_' (such as N, "
             "n_tokens, H2), not a Python keyword; '_' alone means any one dimension")
MAX_DIMS = 64
MAX_OPS = 32
MAX_TOKEN = 128
_OPS_RE = re.compile(r"//|[*+\-/%@&|^<>]")


def _is_name(tok: str) -> bool:
    return bool(_NAME_RE.match(tok)) and not keyword.iskeyword(tok)


@dataclass(frozen=True)
class Dim:
    """One dimension of a shape.

    kind: ``int`` (fixed size), ``name`` (binds), ``expr`` (checked once its names are bound),
    ``any`` (``_``) or ``ellipsis`` (``...``).
    """

    kind: str
    text: str
    value: int = 0
    names: tuple[str, ...] = ()
    # for expr: a Python expression over the names (used by the compiler and the slow path)
    py: str = ""
    # for ``k*X`` / ``X*k`` with X unbound: (X, k) so X can be solved as size // k
    solve: tuple[str, int] | None = None
    # for expr: the divisors of its ``//`` (Python expressions over the names, innermost
    # first): where one is 0 (``N//G`` for an empty tensor's G) the dimension has no value
    # and nothing is checked against it
    divisors: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShapeSpec:
    text: str
    dims: tuple[Dim, ...]
    has_ellipsis: bool = False
    names: tuple[str, ...] = field(default=())

    @property
    def fixed_rank(self) -> int:
        """Number of dimensions other than ``...``."""
        return sum(1 for d in self.dims if d.kind != "ellipsis")


_ALLOWED_BINOPS = {ast.Mult: "*", ast.Add: "+", ast.Sub: "-", ast.FloorDiv: "//"}


def _check_expr(node: ast.AST, text: str, names: list[str],
                divisors: list[str] | None = None) -> str:
    if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_BINOPS:
        left = _check_expr(node.left, text, names, divisors)
        right = _check_expr(node.right, text, names, divisors)
        if isinstance(node.op, ast.FloorDiv) and _constant(node.right) == 0:
            raise ValueError(f"dimension {text!r} divides by zero")
        if isinstance(node.op, ast.FloorDiv) and divisors is not None \
                and _constant(node.right) is None:
            divisors.append(right)
        if isinstance(node.op, ast.Mult) and 0 in (_constant(node.left), _constant(node.right)):
            raise ValueError(f"dimension {text!r} multiplies by zero: it is always 0 and "
                             "says nothing about the names in it (write 0)")
        return f"({left} {_ALLOWED_BINOPS[type(node.op)]} {right})"
    if isinstance(node, ast.Name):
        if not _is_name(node.id):
            raise ValueError(f"bad dimension name {node.id!r} in {text!r}: {NAME_RULE}")
        if node.id not in names:
            names.append(node.id)
        return node.id
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return str(node.value)
    raise ValueError(
        f"dimension {text!r}: only integers, names and the operators * + - // are allowed"
    )


def _constant(node: ast.AST) -> int | None:
    """The value of a sub-expression without names, or ``None`` when it has a name (or
    divides by zero itself, which ``_check_expr`` reports for that sub-expression)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_BINOPS:
        a, b = _constant(node.left), _constant(node.right)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        return None if b == 0 else a // b
    return None


def _parse_dim(tok: str) -> Dim:
    if tok == "...":
        return Dim("ellipsis", tok)
    if tok == "_":
        return Dim("any", tok)
    if len(tok) > MAX_TOKEN:
        raise ValueError(f"dimension {tok[:40]!r}... is {len(tok)} characters long "
                         f"(at most {MAX_TOKEN})")
    if tok.isascii() and tok.isdigit():
        return Dim("int", tok, value=int(tok))
    if _is_name(tok):
        return Dim("name", tok, names=(tok,))
    if _NAME_RE.match(tok) or re.match(r"^[A-Za-z_]\w*$", tok):
        raise ValueError(f"bad dimension name {tok!r}: {NAME_RULE}")
    n_ops = len(_OPS_RE.findall(tok))
    if n_ops > MAX_OPS:
        raise ValueError(f"dimension {tok[:40]!r}... has {n_ops} operators (at most {MAX_OPS})")
    try:
        node = ast.parse(tok, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ValueError(f"cannot parse dimension {tok!r}") from None
    names: list[str] = []
    divisors: list[str] = []
    py = _check_expr(node, tok, names, divisors)
    if not names:  # constant expression such as 2*64
        value = _constant(node)
        if value is None or value < 0:
            raise ValueError(f"dimension {tok!r} is {value}: a size cannot be negative")
        return Dim("int", tok, value=value)
    solve = None
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mult)
        and len(names) == 1
    ):
        a, b = node.left, node.right
        if isinstance(a, ast.Constant) and isinstance(b, ast.Name):
            solve = (b.id, int(a.value))  # type: ignore[call-overload,arg-type]
        elif isinstance(b, ast.Constant) and isinstance(a, ast.Name):
            solve = (a.id, int(b.value))  # type: ignore[call-overload,arg-type]
    return Dim("expr", tok, names=tuple(names), py=py, solve=solve, divisors=tuple(divisors))


def parse_shape(text: str) -> ShapeSpec:
    """Parse a shape string; raises ``ValueError`` with the offending token."""
    if not isinstance(text, str):
        raise ValueError(f"a shape must be a string such as 'N K', got {text!r}")
    toks = text.replace(",", " ").split()
    if len(toks) > MAX_DIMS:
        raise ValueError(f"shape {text[:40]!r}... has {len(toks)} dimensions (at most {MAX_DIMS})")
    dims = tuple(_parse_dim(t) for t in toks)
    n_ell = sum(1 for d in dims if d.kind == "ellipsis")
    if n_ell > 1:
        raise ValueError(f"shape {text!r}: at most one '...' is allowed")
    if n_ell == 1 and dims[0].kind != "ellipsis":
        raise ValueError(f"shape {text!r}: '...' stands for leading dimensions and must come first")
    names: list[str] = []
    for d in dims:
        for n in d.names:
            if n not in names:
                names.append(n)
    return ShapeSpec(text=text, dims=dims, has_ellipsis=n_ell == 1, names=tuple(names))


def eval_dim(dim: Dim, bindings: dict[str, int]) -> int | None:
    """Value of ``dim`` under ``bindings``, or ``None`` when a name is unbound or the
    expression divides by a size that is 0."""
    if dim.kind == "int":
        return dim.value
    if dim.kind in ("name", "expr"):
        if any(n not in bindings for n in dim.names):
            return None
        try:
            return int(eval(dim.py or dim.text, {"__builtins__": {}}, dict(bindings)))  # noqa: S307
        except ZeroDivisionError:
            return None
    return None
