"""Every shipped guard, called as a hostile job would call it, never raises for its own reasons.

Each op's guard is made as the patch makes it (``make_guard`` following the registry, with the
parameters of the callable it wraps) around a stub kernel with the op's parameters that only
records that it was reached.  So an exception can only come from the guard itself, and the
only one it may raise is ``ContractViolation``, in strict mode (and in fix mode, for a call no
cast repairs).  The calls start from the op's reference example and vary it: positional or
keyword, optional arguments left out, an unknown keyword, a required one missing, tensors
recast, empty, 0-d, not contiguous or of the wrong type, NaN, infinite and huge scalars; each
call is made from two lines, and one line makes two calls of different forms.  Every mode,
with versions unknown (conditional calls), pinned, and declared as two targets, with value
checks on and off.  Also: the kernel is reached exactly once by every call that does not raise,
and no tensor of the caller's is modified in place.

Deterministic (``derandomize``): the same examples on every run.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opcontracts
from opcontracts import ContractViolation, reference
from opcontracts._engine import registry
from opcontracts._engine.enforce import compiled_for, make_guard, params_of

OPS = reference.names()
MODES = ("off", "warn", "strict", "fix")
# (name, set_versions, set_targets, value checks)
STACKS: list[tuple[str, dict[str, str], tuple[str, ...], bool]] = [
    ("unknown", {"torch_npu": "unknown", "cann": "unknown", "soc": "unknown",
                 "mindspeed": "unknown"}, (), False),
    ("emulation-like", {"torch_npu": "2.13.0", "cann": "unknown", "soc": "unknown",
                        "mindspeed": "unknown"}, (), True),
    ("a2-old", {"torch_npu": "2.7.1", "cann": "8.0.RC3", "soc": "Ascend910B3",
                "mindspeed": "2.0.0"}, (), False),
    ("two-targets", {"torch_npu": "unknown", "cann": "unknown", "soc": "unknown",
                     "mindspeed": "unknown"},
     ("torch_npu=2.14.0,cann=8.3.RC1,soc=Ascend910B3", "cann=8.0.RC3"), True),
]
MUTATIONS = ("f32", "f16", "bf16", "f64", "i64", "i32", "empty", "0-d", "not-contiguous",
             "wrong-type", "none", "nan", "inf", "huge", "negative", "list", "keep")
FORMS = ("as-given", "keywords", "positional", "optional-left-out", "unknown-keyword",
         "required-missing")
# (a longer hunt: FUZZ_EXAMPLES=500 pytest tests/test_guard_fuzz.py)
EXAMPLES_PER_STACK = int(os.environ.get("FUZZ_EXAMPLES", "25"))


class _Kernel:
    """The stub the guard wraps: counts the calls that reached it."""

    def __init__(self, signature: inspect.Signature) -> None:
        self.reached = 0
        self.__signature__ = signature

    def __call__(kernel, /, *args: Any, **kwargs: Any) -> None:  # noqa: N805 - ops take `self`
        kernel.reached += 1


_guards: dict[str, tuple[Callable[..., Any], _Kernel]] = {}
_examples: dict[str, tuple[inspect.Signature, dict[str, Any], int]] = {}


def _guard(op: str) -> tuple[Callable[..., Any], _Kernel]:
    """The op's guard as ``patch`` makes one (lazy, following the registry)."""
    if op not in _guards:
        ref = reference.get(op)
        assert ref is not None
        kernel = _Kernel(inspect.signature(ref.forward))

        def factory() -> Any:
            contract = registry.resolve(op)
            return None if contract is None else compiled_for(contract, params_of(kernel, contract))

        _guards[op] = (make_guard(kernel, op=op, factory=factory), kernel)
    return _guards[op]


def _example(op: str) -> tuple[inspect.Signature, dict[str, Any], int]:
    """The reference example bound to the op's parameters, and how many came positionally."""
    if op not in _examples:
        ref = reference.get(op)
        assert ref is not None and ref.example is not None
        args, kwargs = ref.example(torch.Generator().manual_seed(0))
        sig = inspect.signature(ref.forward)
        _examples[op] = (sig, dict(sig.bind(*args, **kwargs).arguments), len(args))
    return _examples[op]


def _mutate(v: Any, how: str) -> Any:
    casts = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
             "f64": torch.float64, "i64": torch.int64, "i32": torch.int32}
    if isinstance(v, torch.Tensor):
        if how in casts:
            return v.to(casts[how])
        if how == "empty":
            return v[:0] if v.dim() else v.reshape(1)[:0]
        if how == "0-d":
            return torch.zeros((), dtype=v.dtype)
        if how == "not-contiguous":
            return v.transpose(0, 1) if v.dim() >= 2 else v.repeat(2)[::2]
        if how == "wrong-type":
            return "not a tensor"
        if how == "list":
            return [v, v]
    elif isinstance(v, (bool, int, float)) or v is None:
        special = {"nan": float("nan"), "inf": float("inf"), "huge": 2 ** 70, "negative": -1,
                   "wrong-type": torch.ones(3), "0-d": torch.tensor(1.0), "list": [1, 2],
                   "f32": 1.5, "i64": 3}
        if how in special:
            return special[how]
    elif isinstance(v, (list, tuple)):
        if how == "empty":
            return type(v)()
        if how == "nan":
            return [float("nan")] * max(len(v), 1)
        if how == "wrong-type":
            return 7
    elif isinstance(v, str) and how == "wrong-type":
        return 3
    return None if how == "none" else v


def _call(sig: inspect.Signature, named: dict[str, Any], n_pos: int,
          form: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    params = list(sig.parameters.values())
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if form == "optional-left-out":
        named = {k: v for k, v in named.items() if sig.parameters[k].default is inspect.Parameter.empty}
        n_pos = 0
    elif form == "required-missing":
        required = [k for k in named if sig.parameters[k].default is inspect.Parameter.empty]
        if required:
            named = {k: v for k, v in named.items() if k != required[-1]}
        n_pos = 0
    take = {"keywords": 0, "positional": len(positional)}.get(form, n_pos)
    args: list[Any] = []
    for p in positional[:take]:
        if p.name not in named:
            break
        args.append(named[p.name])
    kwargs = {k: v for k, v in named.items() if k not in {p.name for p in positional[:len(args)]}}
    if form == "unknown-keyword":
        kwargs["not_a_parameter"] = 1
    return tuple(args), kwargs


def _at_line_a(guard: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    guard(*args, **kwargs)


def _at_line_b(guard: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    guard(*args, **kwargs)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


@pytest.fixture(params=STACKS, ids=[s[0] for s in STACKS])
def stack(request: pytest.FixtureRequest) -> Iterator[str]:
    name, pins, declared, values = request.param
    prev = opcontracts.set_versions(**pins)  # type: ignore[arg-type]
    opcontracts.set_targets(*declared)
    opcontracts.set_value_checks(values)
    try:
        yield name
    finally:
        opcontracts.set_value_checks(False)
        opcontracts.set_targets()
        opcontracts.set_versions(**prev)


_mutation = st.tuples(st.integers(0, 63), st.sampled_from(MUTATIONS))


@settings(max_examples=EXAMPLES_PER_STACK, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=st.sampled_from(FORMS), second=st.sampled_from(FORMS),
       mutations=st.lists(_mutation, max_size=3))
def test_no_guard_raises_for_its_own_reasons(stack: str, first: str, second: str,
                                             mutations: list[tuple[int, str]]) -> None:
    """Each example (two call forms, up to three mutations) is made on every op, in every
    mode: a mutation lands on a different argument of each op."""
    for op in OPS:
        guard, kernel = _guard(op)
        sig, named, n_pos = _example(op)
        named = dict(named)
        keys = list(named)
        for at, how in mutations:
            k = keys[at % len(keys)]
            named[k] = _mutate(named[k], how)
        calls = [_call(sig, named, n_pos, first), _call(sig, named, n_pos, second)]
        for mode in MODES:
            opcontracts.set_mode(mode)
            _calls_never_fail_by_the_guard(stack, op, mode, guard, kernel, calls)


def _calls_never_fail_by_the_guard(stack: str, op: str, mode: str, guard: Callable[..., Any],
                                   kernel: _Kernel,
                                   calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", RuntimeWarning)  # an internal failure is one
        for line, (args, kwargs) in [(_at_line_a, calls[0]), (_at_line_b, calls[0]),
                                     (_at_line_a, calls[1]), (_at_line_a, calls[1]),
                                     (_at_line_b, calls[1])]:
            tensors = _tensors(args, kwargs)
            versions = [t._version for t in tensors]
            before = kernel.reached
            try:
                line(guard, args, kwargs)
            except ContractViolation:
                assert mode in ("strict", "fix"), f"{op}: a ContractViolation in {mode} mode"
                assert kernel.reached == before, f"{op}: raised after the kernel ran"
            else:
                assert kernel.reached == before + 1, f"{op}: the kernel was not reached once"
            assert [t._version for t in tensors] == versions, f"{op}: a user tensor modified"
    ours = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)
            and "opcontracts" in str(w.message)]
    assert not ours, f"{op} in {mode} mode on {stack}: {ours}"
