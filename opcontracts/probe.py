"""What does this kernel really accept?  Run an op over a dtype grid and measure it.

``opcontracts probe OP`` (or ``probe(op)``) starts from the op's example inputs (``Reference.example``
in ``opcontracts.reference``: small, conforming, floating values exact in every float dtype),
then gives each tensor argument in turn every dtype of its grid (the others stay at their
conforming dtype), then gives every group of arguments the contract couples (``same_dtype_as`` one partner) each
float dtype together.  Each run of the op (contracts off: the probe measures the kernel, not the
rules) is compared with the reference on up-cast copies, as the shadow compare does
(msprobe's rules, ``_observers.judge``), and is one of:

* ``correct``: the outputs agree with the reference;
* ``wrong``: the op returned, silently, numbers that do not (the dangerous kind);
* ``raises``: the op raised;
* ``n/a``: the reference itself does not take that dtype (nothing to judge against).

The report lists per argument which dtypes are which, and, both ways, where the measured truth
and the contract that applies here disagree (as PyTorch's OpInfo tests do for dtypes):
*claimed but wrong* (the contract lets the call through, the kernel computes garbage or raises)
and *correct but forbidden* (the kernel computes it right, the contract rejects it).
``write_contract`` writes the measured dtype rules as a contract whose ``when`` pins the
detected torch_npu / CANN / SoC.

On a real NPU this measures the real kernels.  Without one it runs on the CPU emulation, whose
kernels read unsupported dtypes the way the NPU does (their bytes reinterpreted): with each
profile installed, the probe recovers that profile's dtypes.  One limit: a 0/1 mask read as
another one-byte dtype (``uint8`` for ``int8`` or ``bool``) holds the same bytes, so no output
can tell the two apart; the probe then reports the other one-byte dtypes as correct, which is
what the kernel computes.

Grids: floats ``bf16, fp16, fp32, fp64``; indices ``int64, int32, int16, int8, uint8``; masks
``bool, int8, uint8, int32``.
"""

from __future__ import annotations

import importlib
import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from . import reference
from ._jsonout import replace_text
from ._observers import layer
from ._observers.contract_out import dumps_contracts, stack, stack_text, utc_now
from ._observers.judge import judge

__all__ = ["GRIDS", "Cell", "ProbeReport", "probe"]

Status = Literal["correct", "wrong", "raises", "n/a"]
Claim = Literal["allowed", "conditional", "forbidden", "no contract"]
"""``conditional``: allowed only while a version is unknown (the guard warns, a target decides)"""

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.float64: "fp64", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
          torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
_BY_SHORT = {v: k for k, v in _SHORT.items()}

GRIDS: dict[str, tuple[torch.dtype, ...]] = {
    "float": (torch.bfloat16, torch.float16, torch.float32, torch.float64),
    "index": (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8),
    "mask": (torch.bool, torch.int8, torch.uint8, torch.int32),
}


def _short(d: torch.dtype) -> str:
    return _SHORT.get(d, str(d).removeprefix("torch."))


@dataclass(frozen=True)
class Cell:
    """One run of the op: ``args`` given ``dtype`` (one argument, or a coupled pair)."""

    args: tuple[str, ...]
    dtype: str
    status: Status
    detail: str
    claim: Claim
    rule: str | None = None   # the contract's rule that forbids it

    def to_dict(self) -> dict[str, Any]:
        return {"args": list(self.args), "dtype": self.dtype, "status": self.status,
                "detail": self.detail, "claim": self.claim, "rule": self.rule}


@dataclass
class ArgReport:
    """One tensor argument: its kind, conforming dtype and what each dtype of its grid did."""

    name: str
    kind: str
    conforming: str
    tensor_list: bool
    cells: list[Cell] = field(default_factory=list)

    def dtypes(self, status: Status) -> list[str]:
        return [c.dtype for c in self.cells if c.status == status]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "conforming": self.conforming,
                "list": self.tensor_list,
                **{s: self.dtypes(s) for s in ("correct", "wrong", "raises", "n/a")},
                "allowed_by_contract": [c.dtype for c in self.cells if c.claim == "allowed"],
                "allowed_while_unknown": [c.dtype for c in self.cells
                                          if c.claim == "conditional"]}


@dataclass
class ProbeReport:
    """What the probe measured for one op."""

    op: str
    target: str
    versions: dict[str, str | None]
    profile: str | None
    contract_source: str | None
    contract_targets: tuple[str, ...]
    args: list[ArgReport]
    coupled: list[Cell]
    seconds: float
    contract_optional: dict[str, bool] = field(default_factory=dict)  # the contract's optional

    @property
    def cells(self) -> list[Cell]:
        return [c for a in self.args for c in a.cells] + self.coupled

    @property
    def claimed_but_wrong(self) -> list[Cell]:
        """The contract lets these through; the kernel computes garbage (or raises)."""
        return [c for c in self.cells if c.claim == "allowed" and c.status in ("wrong",
                                                                                "raises")]

    @property
    def unknown_but_wrong(self) -> list[Cell]:
        """Allowed only while a version is unknown (warned, not raised) and computed wrong: a
        target (or the versions) decides them."""
        return [c for c in self.cells if c.claim == "conditional" and c.status in ("wrong",
                                                                                    "raises")]

    @property
    def correct_but_forbidden(self) -> list[Cell]:
        """The kernel computes these right; the contract rejects them."""
        return [c for c in self.cells if c.claim == "forbidden" and c.status == "correct"]

    def table(self) -> str:
        from ._engine.records import aligned

        head = [f"opcontracts probe: {self.op} ({self.target}), {len(self.cells)} run(s) in "
                f"{self.seconds:.2f} s",
                f"  on {', '.join(f'{k} {v or chr(63)}' for k, v in self.versions.items())}"
                + (f"; emulation profile '{self.profile}'" if self.profile else "")]
        rows = [("argument", "kind", "correct", "wrong (silent)", "raises", "contract allows")]
        for a in self.args:
            allowed = [c.dtype + ("?" if c.claim == "conditional" else "") for c in a.cells
                       if c.claim in ("allowed", "conditional")]
            rows.append((a.name + ("[]" if a.tensor_list else ""), a.kind,
                         ", ".join(a.dtypes("correct")) or "-",
                         ", ".join(a.dtypes("wrong")) or "-",
                         ", ".join(a.dtypes("raises")) or "-",
                         ", ".join(allowed) or ("-" if any(c.claim != "no contract"
                                                           for c in a.cells) else "(no contract)")))
        lines = head + [""] + aligned(rows)
        if any(c.claim == "conditional" for c in self.cells):
            lines.append("  (?: allowed only while a version is unknown: the guard warns; a "
                         "target decides)")
        if self.coupled:
            lines += ["", "coupled (the contract ties their dtypes; all given the dtype):"]
            for c in self.coupled:
                lines.append(f"  {' + '.join(c.args)} = {c.dtype}: {c.status}"
                             f" (contract: {c.claim})")
        lines.append("")
        bad = self.claimed_but_wrong
        lines.append("claimed but wrong (the contract allows it, the kernel gets it wrong): "
                     + ("none" if not bad else ""))
        for c in bad:
            lines.append(f"  {' + '.join(c.args)} = {c.dtype}: {c.status} ({c.detail})")
        unsure = self.unknown_but_wrong
        if unsure:
            lines.append("allowed while a version is unknown, and wrong (set the target to "
                         "decide them):")
            for c in unsure:
                lines.append(f"  {' + '.join(c.args)} = {c.dtype}: {c.status} ({c.detail})")
        good = self.correct_but_forbidden
        lines.append("correct but forbidden (the kernel computes it right, the contract rejects "
                     "it): " + ("none" if not good else ""))
        for c in good:
            lines.append(f"  {' + '.join(c.args)} = {c.dtype} (rule: {c.rule})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "target": self.target, "versions": self.versions,
                "profile": self.profile, "seconds": self.seconds,
                "args": [a.to_dict() for a in self.args],
                "coupled": [c.to_dict() for c in self.coupled],
                "claimed_but_wrong": [c.to_dict() for c in self.claimed_but_wrong],
                "correct_but_forbidden": [c.to_dict() for c in self.correct_but_forbidden]}

    # ----------------------------------------------------------------- the measured contract
    def when(self) -> dict[str, Any]:
        """The detected torch_npu / CANN / SoC, pinned (unknown ones left out)."""
        out: dict[str, Any] = {}
        for name in ("torch_npu", "cann"):
            v = self.versions.get(name)
            if v:
                out[name] = "==" + v.removesuffix(" (emulation)")
        soc = self.versions.get("soc")
        if soc:
            out["soc"] = [soc]
        if not out:  # nothing detected: pin torch, so that the table still differs
            out["torch"] = "==" + str(self.versions.get("torch") or torch.__version__)
        return out

    def contract(self) -> dict[str, Any]:
        """The measured dtype rules as a plain-data contract (``write_contract`` writes it)."""
        args: dict[str, dict[str, Any]] = {}
        for a in self.args:
            correct = a.dtypes("correct")
            if not correct:
                continue
            ordered = sorted(correct, key=lambda d: (d != a.conforming, correct.index(d)))
            rule: dict[str, Any] = {"dtype": ordered}
            if a.tensor_list:
                rule["list"] = True
            if self.contract_optional.get(a.name):
                rule["optional"] = True
            args[a.name] = rule
        return {"op": self.op, "targets": list(self.contract_targets) or [self.target],
                "source": f"measured by opcontracts probe on {utc_now()}: {stack_text()}"
                          + (f"; emulation profile '{self.profile}'" if self.profile else ""),
                "when": self.when(),
                "doc": "dtypes measured against the op's plain-PyTorch reference "
                       "(opcontracts.reference), judged with msprobe's thresholds",
                "args": args}

    def write_contract(self, path: str | Path) -> Path:
        p = Path(path)
        if p.parent != Path(""):
            p.parent.mkdir(parents=True, exist_ok=True)
        header = [f"Measured by `opcontracts probe {self.op}` on {utc_now()}.",
                  "Loaded through OPCONTRACTS_CONTRACTS it applies where its `when` holds, merged "
                  "with the shipped contract (strictest reading)."]
        none = [a.name for a in self.args if not a.dtypes("correct")]
        if none:
            header.append(f"No dtype of the grid gave correct results for: {', '.join(none)} "
                          "(no rule written).")
        replace_text(p, dumps_contracts([self.contract()], header))
        return p


# --------------------------------------------------------------------------- running
def _resolve(path: str) -> Any:
    """The callable a target path names; for an ``autograd.Function`` subclass (the patch
    guards its ``apply``), its ``apply``."""
    if path.startswith("torch.ops."):
        obj: Any = torch.ops
        for part in path.split(".")[2:]:
            obj = getattr(obj, part)
        return obj
    module, _, name = path.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
        return obj.apply
    return obj


def _target(op: str, contract: Any) -> tuple[str, Any]:
    """The callable to probe: a ``torch.ops`` target first (the kernel itself), else the first
    target of the contract that can be imported, else ``torch.ops.npu.<op>``."""
    paths = list(contract.targets) if contract is not None else []
    paths.sort(key=lambda t: not t.startswith("torch.ops."))
    if not op.startswith("mindspeed.") and f"torch.ops.npu.{op}" not in paths:
        paths.append(f"torch.ops.npu.{op}")
    errors = []
    for path in paths:
        try:
            return path, _resolve(path)
        except (ImportError, AttributeError, RuntimeError) as exc:
            errors.append(f"{path}: {exc}")
    raise LookupError(f"cannot find a callable for {op}: " + "; ".join(errors or ["no target"]))


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "mask"
    return "float" if t.is_floating_point() else "index"


def _with(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_with(v, dtype) for v in value)
    return value


def _contract(op: str) -> Any:
    from ._engine import registry

    try:
        return registry.resolve(op)
    except registry.UnknownOpError:
        return None


class _Runner:
    """Runs the op and its reference on one set of arguments; judges; asks the contract."""

    def __init__(self, op: str, fn: Any, ref: reference.Reference, contract: Any) -> None:
        self.op, self.fn, self.ref = op, fn, ref
        self.cc = None
        if contract is not None:
            from ._engine.enforce import compiled_for, params_of

            raw = getattr(fn, "__wrapped__", fn)
            self.cc = compiled_for(contract, params_of(raw, contract))

    def claim(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Claim, str | None]:
        if self.cc is None:
            return "no contract", None
        from ._engine.enforce import allowed_only_while_unknown, check_call
        from .errors import ContractViolation

        try:
            check_call(self.cc, args, kwargs, warn=False)  # probe's own call: no warning
        except ContractViolation as exc:
            return "forbidden", f"{exc.arg}: {exc.rule}"
        if allowed_only_while_unknown(self.cc, args, kwargs):
            return "conditional", None
        return "allowed", None

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Status, str]:
        from ._lang import modes
        from .compare import _copy, _upcast_map

        # the reference's copies are taken before the op runs: an in-place op (npu_silu_,
        # npu_scatter_nd_update_) writes into its arguments
        up = _upcast_map(args, kwargs)
        with torch.no_grad():
            ref_args = tuple(_copy(a, up, None, False) for a in args)
            ref_kwargs = {k: _copy(v, up, None, False) for k, v in kwargs.items()}
        try:
            with modes.mode("off"), torch.no_grad():
                out = self.fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a kernel that raises is a result
            return "raises", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        try:
            with torch.no_grad(), layer.busy():
                want = self.ref.forward(*ref_args, **ref_kwargs)
        except Exception as exc:  # noqa: BLE001 - nothing to judge against
            return "n/a", f"the reference raises {type(exc).__name__}"
        got, exp = list(layer.outputs(out)), list(layer.outputs(want))
        if len(got) != len(exp):
            return "wrong", f"{len(got)} output tensor(s), the reference has {len(exp)}"
        for (name, a), (_, e) in zip(got, exp):
            v = judge(a, e)
            if v.status == "error":
                return "wrong", f"{name}: {v.reason}"
        return "correct", "agrees with the reference"


def probe(op: str, *, seed: int = 0) -> ProbeReport:
    """Measure which dtypes op ``op`` computes correctly (see the module docstring)."""
    t0 = time.perf_counter()
    ref = reference.get(op)
    if ref is None or ref.example is None:
        why = reference.unmodelled(op)
        if why is not None:  # a shipped op without a reference: say why, not the whole list
            raise LookupError(f"no reference with example inputs for {op!r}: {why} (its "
                              "contract still guards its calls)")
        known = ", ".join(n for n in reference.names() if reference.get(n).example)  # type: ignore[union-attr]
        raise LookupError(f"no reference with example inputs for {op!r}; probe-able ops: {known}")
    contract = _contract(ref.name)
    path, fn = _target(ref.name, contract)
    runner = _Runner(ref.name, fn, ref, contract)
    args, kwargs = ref.example(torch.Generator().manual_seed(seed))
    names = list(inspect.signature(ref.forward).parameters)
    slots: dict[str, tuple[Any, ...]] = {}  # argument name -> where it is (position or keyword)
    for i, v in enumerate(args):
        slots[names[i] if i < len(names) else f"args[{i}]"] = ("pos", i, v)
    for k, v in kwargs.items():
        slots[k] = ("kw", k, v)

    def call_with(changes: dict[str, torch.dtype]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        a, kw = list(args), dict(kwargs)
        for name, d in changes.items():
            where, key, v = slots[name]
            if where == "pos":
                a[key] = _with(v, d)
            else:
                kw[key] = _with(v, d)
        return tuple(a), kw

    def cell(names_: tuple[str, ...], d: torch.dtype) -> Cell:
        a, kw = call_with(dict.fromkeys(names_, d))
        claim, rule = runner.claim(a, kw)
        status, detail = runner.run(a, kw)
        return Cell(names_, _short(d), status, detail, claim, rule)

    reports: list[ArgReport] = []
    for name, (_, _, v) in slots.items():
        first = v if isinstance(v, torch.Tensor) else (
            v[0] if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor)
            else None)
        if first is None:
            continue
        kind = _kind(first)
        rep = ArgReport(name, kind, _short(first.dtype), not isinstance(v, torch.Tensor))
        rep.cells = [cell((name,), d) for d in GRIDS[kind]]
        reports.append(rep)
    coupled: list[Cell] = []
    optional: dict[str, bool] = {}
    if contract is not None:
        kinds = {r.name: r.kind for r in reports}
        groups: dict[str, list[str]] = {}  # partner -> the arguments tied to its dtype
        for name, a in contract.args.items():
            optional[name] = bool(a.optional)
            partner = a.same_dtype_as
            if partner and kinds.get(name) == kinds.get(partner) == "float":
                groups.setdefault(partner, [partner]).append(name)
        for group in groups.values():
            coupled += [cell(tuple(group), d) for d in GRIDS["float"]]
    from . import emulation

    prof = emulation.current_profile() if emulation.installed() else None
    return ProbeReport(ref.name, path, stack(), prof.name if prof is not None else None,
                       getattr(contract, "source", None),
                       tuple(contract.targets) if contract is not None else (), reports, coupled,
                       time.perf_counter() - t0, optional)
