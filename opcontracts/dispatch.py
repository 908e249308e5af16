"""A dispatcher-level catcher for calls that bypass Python names.

Code that captured ``torch.ops.npu.npu_moe_token_unpermute.default``, calls an op from C++, or
reaches a grad op from the autograd engine never goes through a patched attribute.
``ContractDispatchMode`` is a ``TorchDispatchMode``: every aten/npu op of the block reaches it,
and it checks those whose ``namespace::name`` has a contract with a ``torch.ops.<ns>.<name>``
target (or that you pass in).  Meant for tests and debugging, where completeness matters more
than speed: a Python dispatch mode costs every op of the block a trip through Python (measured
by ``benchmarks/bench_patch.py``).

    with opcontracts.dispatch.ContractDispatchMode():
        loss.backward()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch.utils._python_dispatch import TorchDispatchMode

from ._engine import registry
from ._engine.compile import CompiledContract
from ._engine.enforce import _schema_params, compiled_for
from ._engine.violations import _violated
from ._lang import modes

if TYPE_CHECKING:
    from .spec import Contract

__all__ = ["ContractDispatchMode"]


def _op_key(target: str) -> tuple[str, str] | None:
    parts = target.split(".")
    if len(parts) == 4 and parts[0] == "torch" and parts[1] == "ops":
        return parts[2], parts[3]
    return None


class ContractDispatchMode(TorchDispatchMode):
    """Check guarded ops at the dispatcher.  ``contracts`` defaults to every registered contract
    (shipped ones included) that targets ``torch.ops.<namespace>.<op>``."""

    def __init__(self, contracts: Iterable[Contract] | None = None) -> None:
        super().__init__()
        if contracts is None:
            registry.load_shipped()
            chosen = []
            for op in sorted({c.op for c in registry.all_contracts()}):
                c = registry.resolve(op)
                if c is not None:
                    chosen.append(c)
            contracts = chosen
        self._by_name: dict[tuple[str, str], Contract] = {}
        for c in contracts:
            for t in c.targets:
                key = _op_key(t)
                if key is not None:
                    self._by_name[key] = c
        self.namespaces = frozenset(ns for ns, _ in self._by_name)
        # OpOverload -> compiled contract (or None): one dict lookup per op after the first
        self._cache: dict[Any, CompiledContract | None] = {}

    def _entry(self, func: Any) -> CompiledContract | None:
        ns = getattr(func, "namespace", None)
        c = None
        if ns in self.namespaces:
            c = self._by_name.get((ns, func._schema.name.split("::")[-1]))
        cc = compiled_for(c, _schema_params(func._schema)) if c is not None else None
        self._cache[func] = cc
        return cc

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            cc = self._cache[func]
        except KeyError:
            cc = self._entry(func)
        if cc is None:
            return func(*args, **kwargs)
        m = modes.mode_for(cc.contract.op)
        if m is modes.OFF:
            return func(*args, **kwargs)
        fast = cc.fast
        if fast is not None and fast(*args, **kwargs) is True:
            return func(*args, **kwargs)
        return _violated(m, cc, func, args, kwargs)



