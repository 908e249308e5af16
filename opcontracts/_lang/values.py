"""Opt-in value checks (they read tensor memory, so they only run when enabled).

``ENABLED`` is a one-element list read by the generated checkers (``if _VALUES[0]``): a list
item load is the cheapest flag a generated function can test without a global lookup chain.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from .shapes import eval_dim, parse_shape

if TYPE_CHECKING:
    from ..spec import ValueRule

__all__ = ["ENABLED", "set_value_checks", "value_checks_enabled", "check_values", "describe"]

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _from_env() -> bool:
    """``OPCONTRACTS_VALUES``; a value that is neither on nor off stops a job's start-up as a
    bad ``OPCONTRACTS_MODE`` does (``_lang.modes.check_setting``): a typo must not silently turn
    value checks off."""
    raw = os.environ.get("OPCONTRACTS_VALUES", "").strip().lower()
    if raw in _ON:
        return True
    if raw not in _OFF:
        from .modes import report_setting_error

        report_setting_error(f"OPCONTRACTS_VALUES: cannot read {raw!r}; expected one of "
                             "1, true, yes, on (value checks on) or 0, false, no, off")
    return False


ENABLED: list[bool] = [_from_env()]


def set_value_checks(enabled: bool) -> bool:
    """Turn value checks on or off for the process; returns the previous setting."""
    prev = ENABLED[0]
    ENABLED[0] = bool(enabled)
    return prev


def value_checks_enabled() -> bool:
    return ENABLED[0]


_FLAGS = (("permutation", "a permutation of [0, numel)"), ("nonnegative", "non-negative"),
          ("nondecreasing", "non-decreasing"), ("increasing", "strictly increasing"))
_SETTINGS = (("lt", "< {}"), ("last", "last value == {}"), ("sum", "sum == {}"),
             ("last_le", "last value <= {}"), ("sum_le", "sum <= {}"), ("skip", "{} rows skipped"),
             ("duplicates_where_zero", "repeats only where {} is 0"))


def describe(rule: ValueRule) -> str:
    parts = [text for name, text in _FLAGS if getattr(rule, name)]
    parts += [text.format(getattr(rule, name)) for name, text in _SETTINGS
              if getattr(rule, name) is not None]
    if rule.finite:
        parts.append("finite")
    return ", ".join(parts) or "(no value rule)"


def _bound(expr: int | str, bindings: dict[str, Any]) -> int | None:
    if isinstance(expr, int):
        return expr
    return eval_dim(parse_shape(expr).dims[0], {k: v for k, v in bindings.items() if isinstance(v, int)})


def check_values(rule: ValueRule, t: torch.Tensor, bindings: dict[str, Any],
                 partner: Any = None) -> str | None:
    """Return a description of the first value problem, or ``None``.  ``partner`` is the
    tensor ``rule.duplicates_where_zero`` names (``None`` when it was not passed)."""
    if t.numel() == 0:
        return None
    flat = t.detach().reshape(-1)
    if rule.finite and flat.is_floating_point() and not bool(torch.isfinite(flat).all()):
        return "contains NaN or Inf"
    keep = None
    if rule.skip is not None:  # rows the kernel skips take part in no other rule
        keep = flat != rule.skip
        flat = flat[keep]
        if flat.numel() == 0:
            return None
    if rule.nonnegative and bool((flat < 0).any()):
        return f"has a negative value ({int(flat.min())})"
    if rule.nondecreasing and flat.numel() > 1 and bool((flat[1:] < flat[:-1]).any()):
        i = int((flat[1:] < flat[:-1]).nonzero()[0, 0])
        return f"decreases at index {i + 1} ({flat[i].item()} -> {flat[i + 1].item()})"
    if rule.increasing and flat.numel() > 1 and bool((flat[1:] <= flat[:-1]).any()):
        i = int((flat[1:] <= flat[:-1]).nonzero()[0, 0])
        return f"does not increase at index {i + 1} ({flat[i].item()} -> {flat[i + 1].item()})"
    if rule.permutation:
        problem = _permutation(rule, t, flat, keep, partner)
        if problem is not None:
            return problem
    if rule.lt is not None:
        b = _bound(rule.lt, bindings)
        if b is not None and bool((flat >= b).any()):
            return f"has a value {int(flat.max())} >= {rule.lt} ({b})"
    if rule.last is not None:
        b = _bound(rule.last, bindings)
        if b is not None and int(flat[-1]) != b:
            return f"ends with {int(flat[-1])}, not {rule.last} ({b})"
    if rule.sum is not None:
        b = _bound(rule.sum, bindings)
        if b is not None and int(flat.sum()) != b:
            return f"sums to {int(flat.sum())}, not {rule.sum} ({b})"
    if rule.last_le is not None:
        b = _bound(rule.last_le, bindings)
        if b is not None and int(flat[-1]) > b:
            return f"ends with {int(flat[-1])}, past {rule.last_le} ({b})"
    if rule.sum_le is not None:
        b = _bound(rule.sum_le, bindings)
        if b is not None and int(flat.sum()) > b:
            return f"sums to {int(flat.sum())}, more than {rule.sum_le} ({b})"
    return None


def _permutation(rule: ValueRule, t: torch.Tensor, flat: torch.Tensor, keep: Any,
                 partner: Any) -> str | None:
    """Values in ``[0, numel)`` of the whole tensor, each once; with ``duplicates_where_zero``
    a value may repeat where the partner is 0 (the kernel weights those rows by 0)."""
    n = t.numel()
    if bool((flat < 0).any()) or bool((flat >= n).any()):
        what = f"values outside [0, {n})"
        return f"has {what}" + ("" if rule.skip is None else f" other than {rule.skip}")
    weighted = flat
    if rule.duplicates_where_zero is not None and isinstance(partner, torch.Tensor) \
            and partner.numel() == n:
        w = partner.detach().reshape(-1)
        if keep is not None:
            w = w[keep]
        weighted = flat[w != 0]
    counts = torch.bincount(weighted.long(), minlength=n)
    if bool((counts > 1).any()):
        dup = int((counts > 1).nonzero()[0, 0])
        where = "" if rule.duplicates_where_zero is None else \
            f" where {rule.duplicates_where_zero} is not 0"
        return f"is not a permutation of [0, {n}): value {dup} occurs more than once{where}"
    if rule.skip is None and rule.duplicates_where_zero is None and bool((counts != 1).any()):
        return f"is not a permutation of [0, {n}): value {int((counts == 0).nonzero()[0, 0])} is missing"
    return None
