"""Emulated ops of the gemm comm family (issue 15): one ``EmulatedOp`` entry per op (see
``_family``); their references live in ``opcontracts.reference._fam_gemm_comm``."""

from __future__ import annotations

from ._family import EmulatedOp

__all__ = ["OPS"]

OPS: tuple[EmulatedOp, ...] = ()
