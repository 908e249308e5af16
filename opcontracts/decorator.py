"""``@opcontracts.enforce``: guard a user's own custom-op wrapper, and ``opcontracts.check``."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from typing_extensions import ParamSpec

from ._engine import registry
from ._engine.enforce import check_call, compiled_for, make_guard, params_of
from .errors import ContractFileError, ContractViolation

if TYPE_CHECKING:
    from ._engine.compile import CompiledContract
    from .spec import Arg, Contract

__all__ = ["enforce", "check"]

P = ParamSpec("P")
R = TypeVar("R")


def _annotated_args(fn: Callable[..., Any]) -> dict[str, Arg]:
    from .spec import Arg

    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # unresolved forward references: fall back to raw annotations
        hints = dict(getattr(fn, "__annotations__", {}))
    out: dict[str, Arg] = {}
    for name, hint in hints.items():
        if name == "return":
            continue
        if typing.get_origin(hint) is typing.Annotated:
            for meta in typing.get_args(hint)[1:]:
                if isinstance(meta, Arg):
                    out[name] = meta
    return out


def _contract_for(fn: Callable[..., Any], target: Contract | None) -> Contract:
    from .spec import Contract

    annotated = _annotated_args(fn)
    if isinstance(target, Contract):
        base = target
    else:
        if not annotated:
            raise ContractFileError(
                f"@enforce on {fn.__qualname__}: give an op name, a Contract, or annotate "
                "parameters with Annotated[torch.Tensor, opcontracts.Arg(...)]")
        return Contract(f"{fn.__module__}.{fn.__qualname__}", annotated,
                        source=f"annotations of {fn.__module__}.{fn.__qualname__}")
    if annotated:
        args = dict(base.args)
        args.update(annotated)
        base = base.model_copy(update={"args": args})
    return base


@overload
def enforce(target: Callable[P, R]) -> Callable[P, R]: ...
@overload
def enforce(target: str | Contract | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def enforce(target: Any = None) -> Any:
    """Guard a function with a contract.

    ``@enforce("npu_moe_token_unpermute")`` uses a registered contract, and follows the
    registry (a contract replaced, versions changed: the next call checks the new rules);
    ``@enforce(Contract(...))`` an inline one; bare ``@enforce`` (or ``@enforce()``) builds one
    from ``Annotated[torch.Tensor, Arg(...)]`` parameter annotations.  The wrapper keeps the
    function's name, docstring and signature.
    """
    from .spec import Contract

    if callable(target) and not isinstance(target, (str, Contract)):
        return enforce(None)(target)
    if isinstance(target, str):
        op = target
        _lookup(op)  # an unknown op fails at decoration time

        def by_name(fn: Callable[P, R]) -> Callable[P, R]:
            def factory() -> CompiledContract | None:
                # at decoration and after every change to what applies (set_versions,
                # register(..., replace=True)): the guard follows the registry
                found = registry.resolve(op)
                if found is None:
                    return None
                contract = _contract_for(fn, found)
                return compiled_for(contract, params_of(fn, contract))

            return make_guard(fn, factory(), op=op, factory=factory)  # type: ignore[return-value]

        return by_name

    def deco(fn: Callable[P, R]) -> Callable[P, R]:
        contract = _contract_for(fn, target)
        params = params_of(fn, contract)
        cc = compiled_for(contract, params)
        return make_guard(fn, cc)  # type: ignore[return-value]

    return deco


def _release_params(contract: Contract) -> list[Any] | None:
    from ._lang import versions
    from .wheel.release_params import params_for

    return params_for(tuple(contract.targets), versions.current().torch_npu)


def _lookup(op: str) -> Contract:
    return registry.get_contract(op)  # loads the shipped packs on a miss


def check(op: str | Contract, /, *args: Any, **kwargs: Any) -> None:
    """Check a call of ``op`` without making it; raises ``ContractViolation`` if it would
    violate the contract, whatever the mode.  A torch_npu op's call is bound as its guard
    binds it, to the op's schema in the torch_npu release detected or pinned (the wheel
    digest's), so an argument left out is judged at the schema's default."""
    __tracebackhide__ = True
    contract = _lookup(op) if isinstance(op, str) else op
    try:
        check_call(compiled_for(contract, _release_params(contract)), args, kwargs)
    except ContractViolation as exc:  # the traceback ends here, at the user's check() call
        raise exc.with_traceback(None)  # noqa: B904 - the checked call broke the contract



