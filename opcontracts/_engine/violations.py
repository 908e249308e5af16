"""What a guard does with a call that does not conform, eager or traced.

The violation itself (expected vs got, shape bindings, the hint, the fix), the record and the
warning once per call site and mode (``_violated``, with a bounded per-site cache so a repeated
violation skips the slow path), violations inside a violating call (``_nested``), and the
``fix`` mode's planner (``plan_fix``) with the repairs a call site learns.  The eager guard
(``enforce.make_guard``) and the traced guard (``traced``) both call it; it imports neither.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .._lang import modes as _modes
from .._lang import values as _values
from .._lang.dtypes import dtype_name, int_range, parse_dtype
from .._lang.shapes import ShapeSpec, eval_dim, parse_shape
from ..errors import ContractFixWarning, ContractViolation, ContractWarning
from . import conditional as _conditional
from . import memo, nesting
from . import records as _report_mod
from . import registry as _registry
from .callsite import CallSite, find_call_site, user_frame
from .compile import MISSING, CompiledContract, RawViolation, Rule
from .nesting import call_within
from .records import bump, current_rank, record

_FIX_ROUNDS = 16


# --------------------------------------------------------------------------- messages
def _fmt_shape(v: torch.Tensor) -> str:
    return "(" + ", ".join(str(int(s)) for s in v.shape) + ("," if v.dim() == 1 else "") + ")"


def _actual(raw: RawViolation) -> str:
    v, kind = raw.value, raw.rule.kind
    if kind == "missing":
        return "was not passed" if v is MISSING else "is None"
    if kind == "type":
        return f"is a {type(v).__name__}"
    if kind == "value":
        return f"{raw.note}"
    if kind in ("allowed", "bound"):
        return f"is {v!r}" + (f" ({raw.note})" if raw.note else "")
    if kind == "list_len":
        return f"has {len(v)} tensors"
    if not isinstance(v, torch.Tensor):
        return f"is {v!r}"
    if kind in ("dtype", "same_dtype"):
        return f"has dtype {dtype_name(v.dtype)} (shape {_fmt_shape(v)})"
    if kind == "device":
        return f"is on {v.device}"
    if kind == "contiguous":
        return f"is not contiguous (strides {tuple(v.stride())})"
    return f"has shape {_fmt_shape(v)}"


class NeedsValues(Exception):
    """An integer narrowing was asked of a tensor whose values cannot be read (a meta tensor,
    while ``torch.compile`` traces): whether the values fit decides the repair."""


def _fix_target(raw: RawViolation, partner_value: Any) -> torch.dtype | None:
    """The dtype ``fix`` mode would cast to, or None if a cast cannot repair this.
    Raises ``NeedsValues`` for an integer narrowing of a meta tensor."""
    v, rule = raw.value, raw.rule
    spec = rule.arg_spec
    if not isinstance(v, torch.Tensor) or spec is None or spec.fix == "never":
        return None
    if rule.kind == "same_dtype":
        if not isinstance(partner_value, torch.Tensor):
            return None
        t = partner_value.dtype
        if v.is_floating_point() and t.is_floating_point:
            return t
        return None
    if rule.kind != "dtype" or spec.dtype is None:
        return None
    allowed = [parse_dtype(d) for d in spec.dtype]
    if v.is_floating_point():
        floats = [d for d in allowed if d.is_floating_point]
        return floats[0] if floats else None
    if spec.fix == "cast" and not v.is_complex() and v.dtype is not torch.bool:
        ints = [d for d in allowed if not d.is_floating_point and not d.is_complex and d is not torch.bool]
        if not ints:
            return None
        if v.numel() == 0:
            return ints[0]
        if v.is_meta:
            raise NeedsValues(raw.rule.arg)
        lo, hi = int(v.min()), int(v.max())
        for d in ints:
            dlo, dhi = int_range(d)
            if dlo <= lo and hi <= dhi:
                return d
    return None


def why_not_fixed(raw: RawViolation, partner_value: Any) -> str | None:
    """Why ``fix`` mode leaves this violation to the user, in words (None: it is not a dtype
    matter, or a cast would repair it)."""
    v, rule = raw.value, raw.rule
    spec = rule.arg_spec
    if not isinstance(v, torch.Tensor) or spec is None:
        return None
    if rule.kind not in ("dtype", "same_dtype"):
        return f"a {rule.kind} rule cannot be repaired by a cast"
    if spec.fix == "never":
        return "the contract says fix = \"never\" for this argument"
    if rule.kind == "same_dtype":
        if v.is_floating_point():
            return None
        return "fix mode casts only floating tensors to their partner's dtype"
    allowed = [parse_dtype(d) for d in spec.dtype or ()]
    if v.is_floating_point():
        return None if any(d.is_floating_point for d in allowed) else \
            "no floating dtype is allowed here: a cast would change what the values mean"
    ints = [d for d in allowed if not d.is_floating_point and not d.is_complex and d is not torch.bool]
    if spec.fix != "cast":
        to = f" -> {dtype_name(ints[0])}" if ints else ""
        return (f"fix mode casts floats only; an integer or bool cast ({dtype_name(v.dtype)}{to}) "
                "needs fix = \"cast\" on the argument, which checks that the values fit")
    if not ints or v.is_complex() or v.dtype is torch.bool:
        return "no integer dtype is allowed here"
    return f"the values do not fit in {', '.join(dtype_name(d) for d in ints)}"


def _concrete(spec: ShapeSpec, bindings: dict[str, int]) -> str:
    """A shape with the sizes the bindings decide filled in: ``(8, H)`` for ``N*K H``."""
    dims = []
    for d in spec.dims:
        v = eval_dim(d, bindings) if d.kind in ("name", "expr", "int") else None
        dims.append(str(v) if v is not None else d.text)
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def _hint(raw: RawViolation, partner_value: Any) -> str | None:
    rule = raw.rule
    spec = rule.arg_spec
    if spec is not None and spec.hint:
        return spec.hint
    a = rule.arg or "x"
    ref = a if raw.index is None else f"{a}[{raw.index}]"
    b = raw.bindings
    where = ", ".join(f"{k}={v}" for k, v in b.items())
    kind = rule.kind
    if kind == "same_dtype":
        return f"{ref} = {ref}.to({rule.partner}.dtype)"
    if kind == "dtype" and spec is not None and spec.dtype:
        try:
            t = _fix_target(raw, partner_value)
        except NeedsValues:
            t = None
        if t is None:
            v = raw.value
            pick = [d for d in spec.dtype if isinstance(v, torch.Tensor)
                    and parse_dtype(d).is_floating_point == v.is_floating_point()]
            t = parse_dtype((pick or list(spec.dtype))[0])
        return f"{ref} = {ref}.to(torch.{dtype_name(t)})"
    if kind == "contiguous":
        return f"{ref} = {ref}.contiguous()"
    if kind == "device":
        return f"move {ref} to the device of the other tensor arguments ({ref}.to(other.device))"
    if kind == "missing":
        return f"pass a {'tensor' if spec is None or spec.is_tensor else 'value'} for {ref}"
    if kind == "type":
        if rule.expected == "a list of tensors":
            return f"pass {ref} as a list (or tuple) of tensors"
        if rule.expected == "a number":
            return f"pass a number for {ref} (got a {type(raw.value).__name__})"
        return f"pass a torch.Tensor for {ref} (got a {type(raw.value).__name__})"
    if kind == "list_len":
        return f"pass at most {rule.expected.split()[2]} tensors in {ref} (split the call)"
    if kind == "allowed" and spec is not None and spec.allowed is not None:
        if len(spec.allowed) == 1:
            return f"pass {ref}={spec.allowed[0]!r} (the only value the kernel supports)"
        return f"pass {ref} as one of {', '.join(map(repr, spec.allowed))}"
    if kind == "bound" and isinstance(rule.detail, tuple):
        sym, bound = rule.detail
        value = "" if isinstance(bound, int) else \
            f" ({bound} = {_bound_value(bound, b)} here)" if _bound_value(bound, b) is not None \
            else ""
        return f"pass {ref} {sym} {bound}{value}"
    if isinstance(rule.detail, tuple) and rule.detail and rule.detail[0] == "dims":
        _, name, sym, bound = rule.detail
        return (f"{ref}'s size {name} is {b.get(name, '?')}; the kernel supports only {name} "
                f"{sym} {bound}: no cast repairs this (split the work, or use the unfused path)")
    if isinstance(rule.detail, tuple) and rule.detail and rule.detail[0] == "numel":
        return (f"pass {ref} with fewer than {rule.detail[1]} elements (split the batch, or "
                "use the unfused path)")
    if kind in ("shape", "rank"):
        shapes = rule.detail if isinstance(rule.detail, list) else []
        if len(shapes) == 1 and where:
            concrete = _concrete(shapes[0], b)
            if concrete != f"({shapes[0].text.replace(' ', ', ')})":
                return f"pass {ref} with shape {concrete} ({shapes[0].text} where {where})"
        return f"pass {ref} with {rule.expected}" + (f" where {where}" if where else "")
    if kind == "same_shape":
        return f"pass {ref} with the shape of {rule.partner}"
    return None


def _bound_value(bound: str, bindings: dict[str, int]) -> int | None:
    try:
        return eval_dim(parse_shape(bound).dims[0], bindings)
    except Exception:  # a message must never fail on its hint
        return None


def _expected(raw: RawViolation, partner_value: Any) -> str:
    """The rule's expectation, with what the call made of it: a partner's dtype."""
    rule = raw.rule
    if rule.kind == "same_dtype" and isinstance(partner_value, torch.Tensor):
        text = f"the dtype of {rule.partner}"
        return rule.expected.replace(text, f"{text} ({dtype_name(partner_value.dtype)})", 1)
    return rule.expected


def violation_from_raw(raw: RawViolation, site: CallSite | None, partner_value: Any = None,
                       reading: str | None = None) -> ContractViolation:
    rule = raw.rule
    arg = rule.arg if raw.index is None else f"{rule.arg}[{raw.index}]"
    blame = raw.blame  # a broken relation: which argument to change, said by blame.attribute
    return ContractViolation(
        op=rule.op, arg=arg, rule=rule.kind,
        expected=blame.expected if blame is not None else _expected(raw, partner_value),
        actual=_actual(raw),
        bindings=raw.bindings, call_site=str(site) if site else None, source=rule.source,
        fix=blame.fix if blame is not None else _hint(raw, partner_value), rank=current_rank(),
        layer=rule.layer, reading=reading,
    )


# --------------------------------------------------------------------------- warn once
_registries: dict[tuple[Any, ...], dict[Any, Any]] = {}
_reg_lock = threading.Lock()


def _warn(exc: ContractViolation, site: CallSite | None, message: str,
          category: type[Warning]) -> None:
    """Warn at the user's call site; the text is the first message seen for this site and
    rule, so the warnings machinery shows it once (``default`` action) and still raises on
    every call under ``-W error::opcontracts.ContractWarning``."""
    site_key = str(site) if site else "?"
    _emit(_SiteEntry(site, message, category, [(exc.op, exc.arg, exc.rule, site_key, "")], None))


def reset_warnings() -> None:
    with _reg_lock:
        _registries.clear()
    _site_cache.clear()
    _nested_sites.clear()
    _conditional.reset()


# --------------------------------------------------------------------------- slow path
class _Bound:
    """Positional and keyword arguments addressed by parameter name, without
    ``inspect.Signature.bind``; copies the containers, never the tensors."""

    __slots__ = ("args", "kwargs", "pos")

    def __init__(self, cc: CompiledContract, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = list(args)
        self.kwargs = dict(kwargs)
        self.pos = _positions(cc)

    def get(self, name: str | None) -> Any:
        if name is None:
            return None
        if name in self.kwargs:
            return self.kwargs[name]
        i = self.pos.get(name, -1)
        return self.args[i] if 0 <= i < len(self.args) else None

    def set(self, name: str, index: int | None, new: Any) -> None:
        if index is not None:
            old = self.get(name)
            items = list(old)
            items[index] = new
            new = tuple(items) if isinstance(old, tuple) else items
        i = self.pos.get(name, -1)
        if name not in self.kwargs and 0 <= i < len(self.args):
            self.args[i] = new
        else:
            self.kwargs[name] = new

    def element(self, name: str, index: int | None) -> Any:
        v = self.get(name)
        return v if index is None else v[index]


# by the compiled contract itself (weakly): an id could be reused by a newer one
_pos_cache: weakref.WeakKeyDictionary[CompiledContract, dict[str, int]] = \
    weakref.WeakKeyDictionary()


def _positions(cc: CompiledContract) -> dict[str, int]:
    pos = _pos_cache.get(cc)
    if pos is None:
        pos = {}
        for i, p in enumerate(cc.params):
            if p.kind not in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
                break
            pos[p.name] = i
        _pos_cache[cc] = pos
    return pos


def _record_and_message(exc: ContractViolation, site: CallSite | None, m: _modes.Mode,
                        fixed: bool) -> tuple[str, bool]:
    rec, new = record(exc.op, exc.arg, exc.rule, str(site) if site else "?", m.value, str(exc),
                      fixed=fixed, rank=exc.rank, expected=exc.expected, got=exc.got)
    return (rec.message if rec is not None else str(exc)), new


class _SiteEntry:
    """What a repeated violation at one call site needs: no frame walk, no message, no bind."""

    __slots__ = ("site", "message", "category", "keys", "steps", "registry", "same", "casts",
                 "nargs")

    def __init__(self, site: CallSite | None, message: str, category: type[Warning],
                 keys: list[tuple[str, str | None, str, str, str]],
                 steps: list[tuple[str, int | None, str, Any]] | None) -> None:
        self.site = site
        self.message = message
        self.category = category
        self.keys = keys
        self.steps = steps
        self.registry: dict[Any, Any] | None = None
        # ``fix``: a C++ check of the metadata of the call the repair was planned for (see
        # ``_engine.memo``) and the repair as (position, dtype or None for .contiguous()): a call with
        # the same metadata needs exactly these casts and then conforms, so neither the
        # binding nor the re-check is needed
        self.same: Callable[..., bool] | None = None
        self.casts: tuple[tuple[int, torch.dtype | None], ...] = ()
        self.nargs = -1  # the positional count ``same`` was learnt for (one line may call twice)


_site_cache: dict[tuple[Any, ...], _SiteEntry] = {}
_report_mod._reset_callbacks.append(_site_cache.clear)  # cached entries point at records


SITE_CACHE_SIZE = 4096
"""cached violating call sites (the repeat path); beyond it the oldest is dropped (and pays the
slow path again: its warn-once memory is kept separately, in ``_registries``)"""
WARN_MEMORY_SIZE = 1 << 16
"""(op, argument, rule, call site) warned about; beyond it the oldest may warn once more"""


def _evict_oldest(d: dict[Any, Any], size: int) -> None:
    """Keep ``d`` below ``size`` by dropping its oldest entries (insertion order)."""
    while len(d) >= size:
        try:
            del d[next(iter(d))]
        except (StopIteration, KeyError, RuntimeError):  # emptied or changed by another thread
            return


def _cache(key: tuple[Any, ...], entry: _SiteEntry) -> None:
    _evict_oldest(_site_cache, SITE_CACHE_SIZE)  # bounded, whatever the number of call sites
    _site_cache[key] = entry


def _emit(entry: _SiteEntry) -> None:
    """Warn again at a cached site: the warnings machinery dedups (``default`` action) or
    raises (``error``), with the registry kept on the entry so nothing is rebuilt."""
    site = entry.site
    if entry.registry is None:
        k = entry.keys[0]
        key = (k[0], k[1], k[2], str(site), entry.category)
        with _reg_lock:
            reg = _registries.get(key)
            if reg is None:
                _evict_oldest(_registries, WARN_MEMORY_SIZE)
                reg = _registries[key] = {}
        entry.registry = reg
    if site is None:
        warnings.warn(entry.message, entry.category, stacklevel=4)
    else:
        warnings.warn_explicit(entry.message, entry.category, site.filename, site.lineno,
                               module=site.module, registry=entry.registry)


def _violated(m: _modes.Mode, cc: CompiledContract, fn: Callable[..., Any],
              args: tuple[Any, ...], kwargs: dict[str, Any], depth: int = 2) -> Any:
    """The optimistic check failed: find out why (careful check), then act per mode.

    Repeats at one call site are cached: ``fix`` replays the same casts and re-runs the fast
    check (no careful check, no frame walk, no binding); ``warn`` skips the message building.
    """
    __tracebackhide__ = True  # pytest: show the user's frame, not ours
    # the user's frame: a guarded packet's ``__call__``, a stand-in or an observer's wrapper
    # between it and the guard must not make every call one site
    caller = user_frame(sys._getframe(depth))
    reading, decided = None, None
    if _conditional.resolution(cc) is not None:
        # the op's readings disagree (a version unknown, several targets): judged on each
        if _conditional.repeat(cc, caller.f_code, caller.f_lineno, args, kwargs):
            return fn(*args, **kwargs)
        try:
            first = cc.check(*args, **kwargs)
        except TypeError:  # the arguments do not even bind: let the original say so
            return fn(*args, **kwargs)
        if first is None:  # e.g. the fast check is stricter about an exotic argument type
            return fn(*args, **kwargs)
        verdict = _conditional.judge(cc, args, kwargs)  # None: the strict verdict stands
        if verdict is not None and verdict.decided is None:
            # (inside a violating guarded call the user's mistake is already reported)
            if verdict.conditional and nesting.outer() is None:
                _conditional.warn_conditional(verdict, cc, _actual, caller, args, kwargs)
            return fn(*args, **kwargs)  # conditional (warned), or accepted on every reading
        if verdict is not None and verdict.decided is not None:
            reading = _conditional.reading_note(verdict)
            if verdict.resolution.targets:  # a declared target rejects: in its own words
                decided = verdict.decided[1]
    outer = nesting.outer() if m is not _modes.STRICT else None
    if outer is not None:  # inside a violating guarded call: the same mistake, attached to it
        return _nested(outer, m, cc, fn, args, kwargs, caller)
    if m is _modes.FIX:
        entry = _site_cache.get((cc.key, caller.f_code, caller.f_lineno, m))
        if entry is not None and entry.same is not None and not kwargs \
                and len(args) == entry.nargs and not _values_switch(cc)[0] and entry.same(*args):
            new = list(args)
            for i, target in entry.casts:
                new[i] = new[i].contiguous() if target is None else new[i].to(target)
            bump(entry.keys, fixed=True)
            _emit(entry)
            return call_within(entry.keys[0], fn, new, {})
        if entry is not None and entry.steps is not None:
            b = _Bound(cc, args, kwargs)
            if _replay(entry.steps, b) and cc.fast is not None and cc.fast(*b.args, **b.kwargs) is True:
                bump(entry.keys, fixed=True)
                _emit(entry)
                return call_within(entry.keys[0], fn, b.args, b.kwargs)
    try:
        raw = cc.check(*args, **kwargs)
    except TypeError:  # the arguments do not even bind: let the original say so
        return fn(*args, **kwargs)
    if raw is None:  # e.g. the fast check is stricter about an exotic argument type
        return fn(*args, **kwargs)
    if decided is not None and m is not _modes.FIX:
        raw = decided
    ckey = (cc.key, id(raw.rule), caller.f_code, caller.f_lineno, m)
    entry = _site_cache.get(ckey)
    if entry is not None and m is _modes.WARN:
        bump(entry.keys, fixed=False)
        _emit(entry)
        return call_within(entry.keys[0], fn, args, kwargs)
    site = find_call_site(caller)
    b = _Bound(cc, args, kwargs)
    if m is _modes.FIX:
        return _fix_and_call(raw, cc, fn, b, site, (cc.key, caller.f_code, caller.f_lineno, m))
    exc = violation_from_raw(raw, site, b.get(raw.rule.partner), reading)
    msg, _ = _record_and_message(exc, site, m, False)
    if m is _modes.WARN:
        key = (exc.op, exc.arg, exc.rule, str(site) if site else "?", m.value)
        entry = _SiteEntry(site, msg, ContractWarning, [key], None)
        _cache(ckey, entry)
        _emit(entry)
        _report_mod.mark_shown(key)
        return call_within(key, fn, args, kwargs)
    # strict: the exception carries the whole message; the end-of-run report gives its line
    _report_mod.mark_shown((exc.op, exc.arg, exc.rule, str(site) if site else "?", m.value))
    raise exc


_nested_sites: dict[tuple[Any, ...], tuple[str, str | None, str, str]] = {}


def _nested(outer: nesting.Key, m: _modes.Mode, cc: CompiledContract, fn: Callable[..., Any],
            args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any) -> Any:
    """A violation inside a violating guarded call (``warn`` or ``fix``): attached to the
    outer call's record, no record or warning of its own; ``fix`` still repairs it."""
    __tracebackhide__ = True
    try:
        raw = cc.check(*args, **kwargs)
    except TypeError:
        return fn(*args, **kwargs)
    if raw is None:
        return fn(*args, **kwargs)
    b = _Bound(cc, args, kwargs)
    if m is _modes.FIX:
        repairs = plan_fix(cc, b, raw)
        broken = repairs[-1].new is None
    else:
        repairs, broken = [Repair(raw, None, None, None)], False
    for r in repairs:
        ckey = (cc.key, id(r.raw.rule), r.raw.index, caller.f_code, caller.f_lineno)
        what = _nested_sites.get(ckey)
        if what is None or broken:
            site = find_call_site(caller)
            exc = violation_from_raw(r.raw, site, b.get(r.raw.rule.partner))
            if broken and r is repairs[-1]:
                raise exc  # nothing can repair it: as at the top level, the call fails
            what = (exc.op, exc.arg, exc.rule, str(site) if site else "?")
            _evict_oldest(_nested_sites, SITE_CACHE_SIZE)
            _nested_sites[ckey] = what
        _report_mod.nest(outer, *what)
    return fn(*b.args, **b.kwargs)


def _replay(steps: list[tuple[str, int | None, str, Any]], b: _Bound) -> bool:
    """Apply cached repairs; False if one no longer applies (then the slow path decides)."""
    for name, index, kind, what in steps:
        v = b.element(name, index)
        if not isinstance(v, torch.Tensor):
            return False
        if kind == "contiguous":
            new = v.contiguous()
        elif kind == "cast":
            if not v.is_floating_point():
                return False
            new = v.to(what)
        else:  # same dtype as a partner argument
            partner = b.get(what)
            if not isinstance(partner, torch.Tensor) or not partner.is_floating_point() \
                    or not v.is_floating_point():
                return False
            new = v.to(partner.dtype)
        b.set(name, index, new)
    return True


class Repair(NamedTuple):
    """One step of ``fix`` mode's repair of a call."""

    raw: RawViolation
    partner: Any  # the value of the rule's partner argument when it broke
    new: Any      # the repaired argument (or list element); None: nothing can repair it
    step: tuple[str, int | None, str, Any] | None
    """(name, index, "contiguous" | "cast" | "partner", dtype or partner name), replayable by
    ``_replay``; None for an integer narrowing, which depends on the values"""
    why: str | None = None
    """why nothing repairs the call, when the planner (not a rule) says so: its casts conflict"""


def plan_fix(cc: CompiledContract, b: _Bound, raw: RawViolation) -> list[Repair]:
    """Repair the call bound in ``b`` (in place: new containers, never a user tensor), rule by
    rule, until it conforms; the last repair has ``new`` None when one cannot be repaired.
    Shared by eager calls and by ``torch.compile``'s trace-time decision (on meta tensors,
    where an integer narrowing raises ``NeedsValues``).

    A ``same_dtype`` rule first casts the argument to its partner's dtype.  When a later rule
    then wants that argument back in another dtype (``query_rope`` must be bf16 and match
    ``query``, which came as fp32), the casts conflict: the plan starts over casting the
    partner to the argument's dtype instead, and if that conflicts too, nothing is cast and the
    last repair says why."""
    args, kwargs = list(b.args), dict(b.kwargs)
    for toward_argument in (False, True):
        out = _plan(cc, b, raw, toward_argument)
        if out is not None:
            return out
        b.args, b.kwargs = list(args), dict(kwargs)  # start over from the call as it came
    return [Repair(raw, b.get(raw.rule.partner), None, None,
                   why=_conflict_text(cc, raw))]


def _conflict_text(cc: CompiledContract, raw: RawViolation) -> str:
    rule = raw.rule
    arg = rule.arg if raw.index is None else f"{rule.arg}[{raw.index}]"
    return (f"the casts it would make conflict (repairing '{arg}' breaks another rule of "
            f"{cc.contract.op}): cast the tensors to one dtype the contract allows for all of them")


def _plan(cc: CompiledContract, b: _Bound, raw: RawViolation,
          toward_argument: bool) -> list[Repair] | None:
    """One planning pass (see ``plan_fix``); None when its casts conflict: an argument breaks
    a rule it was already repaired for, or the rounds run out."""
    out: list[Repair] = []
    done: set[tuple[str, int | None, str]] = set()  # (argument, element, rule) repaired
    for _ in range(_FIX_ROUNDS):
        name = raw.rule.arg
        assert name is not None
        if (name, raw.index, raw.rule.kind) in done:
            return None
        partner = b.get(raw.rule.partner)
        if toward_argument and raw.rule.kind == "same_dtype":
            flipped = _flip(cc, raw, partner)
            if flipped is not None:
                raw, partner = flipped
                name = raw.rule.arg
                assert name is not None
                if (name, None, "same_dtype") in done:
                    return None
        v = raw.value
        new: Any = None
        step: tuple[str, int | None, str, Any] | None = None
        if raw.rule.kind == "contiguous" and isinstance(v, torch.Tensor):
            new = v.contiguous()
            step = (name, raw.index, "contiguous", None)
        else:
            target = _fix_target(raw, partner)
            if target is not None:
                new = v.to(target)  # autograd-tracked; never in place
                if raw.rule.kind == "same_dtype":
                    step = (name, raw.index, "partner", raw.rule.partner)
                elif v.is_floating_point():
                    step = (name, raw.index, "cast", target)
        out.append(Repair(raw, partner, new, step))
        if new is None:
            return out
        b.set(name, raw.index, new)
        done.add((name, raw.index, raw.rule.kind))
        try:
            nxt = cc.check(*b.args, **b.kwargs)
        except TypeError:
            nxt = None
        if nxt is None:
            return out
        raw = nxt
    return None


def _flip(cc: CompiledContract, raw: RawViolation, partner: Any,
          ) -> tuple[RawViolation, Any] | None:
    """A ``same_dtype`` violation read the other way: the partner (a plain tensor argument)
    must have the argument's dtype.  None when it cannot be (a list element, not floats)."""
    rule, v = raw.rule, raw.value
    if raw.index is not None or rule.partner is None or rule.arg is None \
            or not isinstance(partner, torch.Tensor) or not isinstance(v, torch.Tensor) \
            or not (partner.is_floating_point() and v.is_floating_point()):
        return None
    spec = cc.contract.args.get(rule.partner)
    if spec is None:
        return None
    flipped = Rule(rule.op, rule.partner, "same_dtype", f"the dtype of {rule.arg}",
                   rule.source, spec, rule.arg, None, rule.layer)
    return RawViolation(flipped, partner, raw.bindings), v


def fixed_message(cc: CompiledContract, r: Repair, exc: ContractViolation) -> str:
    """The first line of a ``ContractFixWarning``: what was done to which argument."""
    done = "contiguous" if r.raw.rule.kind == "contiguous" else dtype_name(r.new.dtype)
    return f"{cc.contract.op}: fixed argument '{exc.arg}': {exc.actual.split(' (')[0]} -> {done} ({exc.fix})"


def _fix_and_call(raw: RawViolation, cc: CompiledContract, fn: Callable[..., Any],
                  b: _Bound, site: CallSite | None, ckey: tuple[Any, ...] | None = None) -> Any:
    __tracebackhide__ = True
    repairs = plan_fix(cc, b, raw)
    if repairs[-1].new is None:
        # something cannot be repaired: the call fails, so nothing was "fixed"; every rule it
        # broke is recorded as a violation (no ContractFixWarning), the last one is raised
        for r in repairs:
            exc = violation_from_raw(r.raw, site, r.partner)
            _record_and_message(exc, site, _modes.FIX, False)
        why = repairs[-1].why or why_not_fixed(repairs[-1].raw, repairs[-1].partner)
        if why:
            exc.fix = f"{exc.fix or 'repair it in the calling code'} (fix mode did not cast: {why})"
            exc.args = (exc._message(),)
        raise exc
    keys: list[tuple[str, str | None, str, str, str]] = []
    messages: list[str] = []
    for r in repairs:
        exc = violation_from_raw(r.raw, site, r.partner)
        msg, _ = _record_and_message(exc, site, _modes.FIX, True)
        what = fixed_message(cc, r, exc)
        keys.append((exc.op, exc.arg, exc.rule, str(site) if site else "?", _modes.FIX.value))
        messages.append(what + "\n" + msg)
        _warn(exc, site, what + "\n" + msg, ContractFixWarning)
        _report_mod.mark_shown(keys[-1])
    steps = [r.step for r in repairs if r.step is not None]
    if ckey is not None and keys:
        entry = _SiteEntry(site, "\n".join(messages), ContractFixWarning, keys,
                           steps if len(steps) == len(repairs) else None)
        if entry.steps is not None and not b.kwargs and not _values_switch(cc)[0]:
            _learn_repair(entry, cc, b, repairs)
        _cache(ckey, entry)
    return call_within(keys[0] if keys else None, fn, b.args, b.kwargs)


def _learn_repair(entry: _SiteEntry, cc: CompiledContract, b: _Bound, repairs: list[Repair]) -> None:
    """Give a cached ``fix`` entry the metadata check of the call it was planned for, when the
    repair is a plain series of casts of positional tensors (no list element, no keyword)."""
    pos = _positions(cc)
    casts: list[tuple[int, torch.dtype | None]] = []
    args = list(b.args)
    for r in reversed(repairs):  # undo, last first, to get the call as it came
        name = r.raw.rule.arg
        i = pos.get(name or "", -1)
        if r.raw.index is not None or not 0 <= i < len(args):
            return
        casts.append((i, None if r.raw.rule.kind == "contiguous" else r.new.dtype))
        args[i] = r.raw.value
    entry.same = memo.learn(tuple(args), _pins_strides(cc))
    entry.casts = tuple(reversed(casts))
    entry.nargs = len(args)




def _pins_strides(cc: CompiledContract) -> bool:
    """Whether a learnt check must pin strides too (a ``contiguous`` rule reads them)."""
    return any(r.kind == "contiguous" for r in cc.rules)


def _values_switch(cc: CompiledContract) -> Sequence[bool]:
    """What the guard reads to know whether value checks are on for ``cc`` right now."""
    return _values.ENABLED if cc.has_values else (False,)


def _forget_sites() -> None:
    """The registry changed what applies: the cached entries name compiled contracts that no
    longer apply."""
    _site_cache.clear()


_registry.on_change(_forget_sites)
