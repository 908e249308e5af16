"""``torch_npu/utils/custom_ops.py``, read with ``ast``: the ``torch_npu.X = torch.ops.npu.Y``
bindings that make ``torch_npu.X`` an alias of the dispatcher op (a target ``torch_npu.X`` of a
contract is reachable only if the wheel binds it)."""

from __future__ import annotations

import ast

from ._source import parse_source

__all__ = ["parse_bindings"]


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def parse_bindings(source: str) -> dict[str, str]:
    """``{"npu_x": "npu_x"}``: torch_npu attribute -> the ``torch.ops.npu`` op it is bound to."""
    out: dict[str, str] = {}
    for node in ast.walk(parse_source(source)):
        if not isinstance(node, ast.Assign):
            continue
        value = _dotted(node.value)
        if value is None or not value.startswith("torch.ops.npu."):
            continue
        op = value.split(".")[3]
        for t in node.targets:
            name = _dotted(t)
            if name and name.startswith("torch_npu.") and name.count(".") == 1:
                out[name.split(".", 1)[1]] = op
    return dict(sorted(out.items()))
