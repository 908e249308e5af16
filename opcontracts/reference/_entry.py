"""One op's reference entry (``Reference``): what the package and its family modules share, kept
out of ``reference/__init__.py`` so the family modules do not import their package."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BackwardFn", "Reference"]

BackwardFn = Callable[[dict[str, Any], Any, Any], dict[str, Any]]


@dataclass(frozen=True)
class Reference:
    """One op's reference.

    ``forward`` takes the op's arguments (same names, same order) and returns its outputs;
    ``backward`` is the composite formula ``(inputs, outputs, grads) -> {arg: grad}`` the
    emulation runs for ops without a backward kernel of their own (None: autograd through
    ``forward``); ``example(generator) -> (args, kwargs)`` builds small conforming inputs (the
    probe's starting point); ``grad_of`` names the forward op of a ``*_grad`` op; ``source`` says
    which documentation the formula follows."""

    name: str
    forward: Callable[..., Any]
    backward: BackwardFn | None = None
    example: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    source: str = ""
    grad_of: str | None = None
