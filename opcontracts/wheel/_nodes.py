"""``torch_npu/include/torch_npu/csrc/aten/Functions.h``: torch_npu's generated autograd nodes
and what each keeps for its backward.

torchgen writes one ``struct TORCH_API <Op>Backward0 : public TraceableFunction`` per
derivative (op-plugin's ``derivatives.yaml``); each tensor the formula reads is a member
``SavedVariable <name>_`` (``std::vector<SavedVariable> <name>_`` for a tensor list), named
for the argument, the named return, or ``result`` / ``resultN`` for an unnamed output.  What
is not saved is kept as sizes and dtypes only (``<name>_sym_argsize_0``, ``_scalar_type``).
Read as text (no C++ parser): the declaration lines are generated, one member a line.
"""

from __future__ import annotations

import re

__all__ = ["parse_nodes", "node_name"]

# ``struct TORCH_API X : public TraceableFunction {`` (the ``#ifdef _WIN32`` twin has no
# TORCH_API and the same body: read once)
_STRUCT = re.compile(r"^struct TORCH_API (\w+) : public \w+ \{\n(.*?)^\};", re.M | re.S)
_SAVED = re.compile(r"^\s*(?:SavedVariable|std::vector<SavedVariable>)\s+(\w+)_;", re.M)


def parse_nodes(text: str) -> dict[str, list[str]]:
    """node name -> the names it saves, in declaration order (``probs``, ``result1``)."""
    out: dict[str, list[str]] = {}
    for m in _STRUCT.finditer(text):
        out[m.group(1)] = _SAVED.findall(m.group(2))
    return out


def node_name(op: str) -> str:
    """The node torchgen names for ``op``'s derivative: ``npu_rms_norm`` ->
    ``NpuRmsNormBackward0`` (a leading underscore dropped: ``_npu_moe_token_unpermute`` ->
    ``NpuMoeTokenUnpermuteBackward0``)."""
    return "".join(p[:1].upper() + p[1:] for p in op.split("_") if p) + "Backward0"
