"""References of the norm quant family (issue 15): the forward of each op in plain PyTorch,
and one ``Reference`` entry per op in ``REFERENCES`` (``_table`` appends them)."""

from __future__ import annotations

from . import Reference

__all__ = ["REFERENCES"]

REFERENCES: tuple[Reference, ...] = ()
