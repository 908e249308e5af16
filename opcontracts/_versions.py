"""Versions of torch_npu, CANN, MindSpeed and the chip, and ``when`` conditions over them.

Placeholder for the version detection of issue #3: everything unknown, so every candidate
contract applies (the strictest reading).
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import When

__all__ = ["Env", "current", "applies"]


@dataclass(frozen=True)
class Env:
    torch_npu: str | None = None
    cann: str | None = None
    mindspeed: str | None = None
    torch: str | None = None
    soc: str | None = None


def current() -> Env:
    return Env()


def applies(when: When | None, env: Env) -> bool | None:
    """True, False, or None when a version it needs is unknown."""
    if when is None:
        return True
    return None


def explain(when: When | None, env: Env) -> str:
    return "version conditions not met"


def describe(env: Env) -> dict[str, str]:
    return {k: (v or "unknown") for k, v in env.__dict__.items()}
