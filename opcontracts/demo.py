"""``opcontracts demo``: reproduce the first-step NaN of the incident, catch it, fix it.

The incident (README): an MoE model trained on Ascend NPUs ran step 1's forward pass fine and
got NaN gradients in backward, because MindSpeed's fused unpermute kernel takes bf16 ``probs``
only and the router handed it fp32 (``moe_router_dtype=fp32``).  The fix was
``probs = probs.to(torch.bfloat16)``.

The demo runs one training step (forward + backward) of a small MoE transformer
(``_demo_model.py``, loaded as user code) four ways, on the CPU emulation of the NPU kernels:

* ``reference``: the unfused MoE in plain PyTorch, the "GPU golden path";
* ``unguarded``: MindSpeed's fused permute/unpermute, ``opcontracts.mode("off")``: the loss is
  finite (and equals the reference), the gradients are NaN, as in the incident;
* ``strict``: the same, ``opcontracts.mode("strict")``: the unpermute call raises
  ``ContractViolation`` naming ``probs`` before the kernel runs;
* ``fix``: the same, ``opcontracts.mode("fix")``: probs are cast to bf16 at the call; loss and
  gradients match the reference within bf16 tolerance.

The fused calls take exactly the path of a user's job: the model file does
``from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute`` after
``import opcontracts.patch``; the shipped contracts decide; the demo only sets the mode.
``--nan-check`` also runs the NaN sentinel (``opcontracts.nan``) on the unguarded and fix runs.
The exit status is 0 only when all four outcomes are the described ones, so CI can run it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import linecache
import math
import sys
import textwrap
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._report import aligned

__all__ = ["DemoResult", "Scenario", "format_table", "main", "run", "run_demo"]

PROFILE = "incident"
PROFILE_WHY = ("the forward kernels accept fp32 probs (torch_npu 2.13 docs) while the unpermute "
               "backward kernel is bf16-only (MindSpeed's JIT-built op): the forward pass "
               "matches the reference and the gradients do not, as in the incident")

MODEL_FILE = "moe_block.py"                  # what call sites and tracebacks show
MODEL_MODULE = "_opcontracts_demo_moe_block"  # its sys.modules name while the demo runs
MODEL_SOURCE = Path(__file__).with_name("_demo_model.py")

# Tolerances of the fixed run against the reference.  bf16 rounds at 2**-8 (~0.4%), and the
# fix rounds probs to bf16 where the reference keeps fp32: the next layer's router sees slightly
# different hidden states and may flip a near-tie top-k choice, which moves a few experts'
# gradients by ~10%.  Loss and gradient norm stay within 2e-4 (seeds 0-39); the relative error
# of the whole gradient within 2.5e-2.  The unguarded run is NaN, or off by ~1e30.
LOSS_RTOL = 1e-2   # |loss - ref| <= LOSS_RTOL * |ref|
NORM_RTOL = 1e-2   # |norm - ref| <= NORM_RTOL * ref
GRAD_RTOL = 1e-1   # ||g - g_ref|| <= GRAD_RTOL * ||g_ref||, over all parameters at once
FAR = 0.5          # "far off": a finite relative gradient error above this

BATCH, SEQ, VOCAB = 4, 32, 128


# --------------------------------------------------------------------------- results
@dataclass
class Scenario:
    """One way of running the step, and whether it came out as described."""

    name: str
    mode: str | None                  # the opcontracts mode, None for the reference
    description: str
    loss: float | None = None
    grad_norm: float | None = None
    nonfinite: bool | None = None     # loss or any gradient NaN/inf
    max_abs_diff: float | None = None  # max |grad - reference grad| over all parameters
    rel_err: float | None = None       # ||grad - reference grad|| / ||reference grad||
    raised: str | None = None         # exception type
    error: str | None = None          # its message
    violation: dict[str, Any] | None = None  # op, arg, rule of a ContractViolation
    fixes: list[str] = field(default_factory=list)  # fix mode's repairs
    nan_check: dict[str, Any] | None = None  # the NaN sentinel's result (--nan-check)
    ok: bool = False
    verdict: str = ""
    seconds: float = 0.0


@dataclass
class DemoResult:
    ok: bool
    profile: str
    profile_why: str
    seed: int
    tolerance: dict[str, float]
    scenarios: list[Scenario]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        """Plain data; NaN and inf become the strings "nan", "inf" (JSON has neither)."""
        return _plain(asdict(self))


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


class _CannotRun(Exception):
    """The demo cannot run here (a real torch_npu): exit status 2."""


# --------------------------------------------------------------------------- environment
def _real_torch_npu() -> str | None:
    """Why a real torch_npu is present (never importing it), or None."""
    from .emulation._standins import is_standin

    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return None if is_standin(mod) else f"torch_npu is loaded from {getattr(mod, '__file__', '?')}"
    from . import emulation

    if emulation.installed():
        return None
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        spec = None
    return None if spec is None else f"torch_npu is importable from {spec.origin or spec.name}"


def _load_model() -> types.ModuleType:
    """Execute ``_demo_model.py`` as user code, under the file name ``moe_block.py``.

    Why not import it: opcontracts reports the first frame outside its own package as the
    call site, and this file is inside it; executed under its own name it is what a user's
    model file is (its lines are registered with ``linecache`` for tracebacks and warnings).
    It runs after ``import opcontracts.patch``, so its MindSpeed imports bind the guards.
    """
    source = MODEL_SOURCE.read_text(encoding="utf-8")
    module = types.ModuleType(MODEL_MODULE)
    module.__file__ = MODEL_FILE
    linecache.cache[MODEL_FILE] = (len(source), None, source.splitlines(True), MODEL_FILE)
    sys.modules[MODEL_MODULE] = module
    try:
        exec(compile(source, MODEL_FILE, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(MODEL_MODULE, None)
        raise
    return module


@contextlib.contextmanager
def _environment() -> Iterator[types.ModuleType]:
    """The emulation (profile ``incident``), the patch and the model module; afterwards the
    process is put back: the emulation uninstalled if installed here (else its previous
    profile restored), the patch lifted if it was not applied before."""
    reason = _real_torch_npu()
    if reason is not None:
        raise _CannotRun(
            f"a real torch_npu is present ({reason}). The demo reproduces the incident on the "
            "CPU emulation of the NPU kernels, which never shadows a real torch_npu. On this "
            "machine, guard your own job instead: opcontracts run --mode strict train.py")
    from . import emulation

    was_installed = emulation.installed()
    previous = emulation.current_profile()
    patch_mod = sys.modules.get("opcontracts.patch")
    was_patched = patch_mod is not None and patch_mod.is_applied()
    emulation.install(PROFILE)
    import opcontracts.patch as patch  # applied on first import, as in a training script

    patch.apply()  # wraps the ops the install just registered
    try:
        yield _load_model()
    finally:
        sys.modules.pop(MODEL_MODULE, None)
        linecache.cache.pop(MODEL_FILE, None)
        if was_installed:
            emulation.install(previous if previous is not None else "narrow")
            if not was_patched:
                patch.unpatch()
        else:
            # unpatch while the emulated ops exist (restoring onto live objects), then drop them
            patch.unpatch()
            emulation.uninstall()
            if was_patched:
                patch.apply()


# --------------------------------------------------------------------------- one step
@dataclass
class _Step:
    loss: float
    grads: dict[str, Any]  # name -> fp32 gradient tensor


def _batch(seed: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, targets


def _train_step(model_mod: types.ModuleType, seed: int, batch: tuple[Any, Any], fused: bool,
                ) -> _Step:
    """Build the model from the seed (bf16 weights), run forward + backward once."""
    import torch

    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left alone
        torch.manual_seed(seed)
        model = model_mod.MoEModel(vocab=VOCAB).to(torch.bfloat16)
    model.set_fused(fused)
    loss = model(*batch)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.detach().float() if g is not None
                       else torch.zeros(p.shape, dtype=torch.float32))
    return _Step(float(loss.detach()), grads)


def _grad_norm(grads: dict[str, Any]) -> float:
    return math.sqrt(sum(float((g * g).sum()) for g in grads.values()))


def _nonfinite(step: _Step) -> bool:
    import torch

    return not math.isfinite(step.loss) or any(
        not bool(torch.isfinite(g).all()) for g in step.grads.values())


def _max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for name, g in a.items():
        d = float((g - b[name]).abs().max()) if g.numel() else 0.0
        if math.isnan(d):
            return math.nan
        worst = max(worst, d)
    return worst


def _rel_err(a: dict[str, Any], b: dict[str, Any]) -> float:
    num = math.sqrt(sum(float(((g - b[n]) ** 2).sum()) for n, g in a.items()))
    den = _grad_norm(b)
    return num / den if den else (0.0 if num == 0 else math.inf)


def _fmt(v: float | None, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec) if math.isfinite(v) else str(v)


# --------------------------------------------------------------------------- the demo
def run_demo(seed: int = 0, nan_check: bool = False,
             out: Callable[[str], None] | None = None) -> DemoResult:
    """Run the four scenarios; ``out`` receives the progress lines (default: stdout).

    ``wall_s`` counts from here, after ``import torch``: the emulation's install, the patch,
    the four steps and the cleanup."""
    import torch  # noqa: F401 - imported before the clock starts

    say = out or (lambda s: print(s, flush=True))
    t0 = time.perf_counter()
    for para in (
        "opcontracts demo: the first-step NaN of the incident (MoE training on NPUs: fp32 "
        "router probs handed to MindSpeed's bf16-only fused unpermute)",
        f"emulation: profile '{PROFILE}' of the CPU emulation of the NPU kernels: {PROFILE_WHY}",
        f"model: {MODEL_FILE} (opcontracts/{MODEL_SOURCE.name}, run as user code): 3 blocks of "
        f"attention + MoE (4 experts, top-2), bf16 weights, fp32 router; batch {BATCH}x{SEQ} "
        f"tokens, seed {seed}; its MindSpeed fused permute/unpermute calls are guarded by "
        "`import opcontracts.patch` and the shipped contracts",
    ):
        say(textwrap.fill(para, width=100, subsequent_indent="  "))
    say("")
    scenarios = [
        Scenario("reference", None, "pure-PyTorch MoE, no fused ops (the GPU golden path)"),
        Scenario("unguarded", "off", "MindSpeed's fused ops, opcontracts.mode('off')"),
        Scenario("strict", "strict", "fused ops, opcontracts.mode('strict')"),
        Scenario("fix", "fix", "fused ops, opcontracts.mode('fix')"),
    ]
    batch = _batch(seed)
    ref: _Step | None = None
    with _environment() as model_mod:
        for i, sc in enumerate(scenarios, 1):
            say(f"[{i}/4] {sc.name}: {sc.description} ...")
            step = _run_scenario(sc, model_mod, seed, batch, ref, nan_check)
            if sc.name == "reference":
                ref = step
            _judge(sc, ref)
            if sc.error:
                say("    " + sc.error.replace("\n", "\n    "))
            for line in sc.fixes:
                say(f"    fixed: {line}")
    wall = time.perf_counter() - t0
    ok = all(sc.ok for sc in scenarios)
    return DemoResult(ok, PROFILE, PROFILE_WHY, seed,
                      {"loss_rtol": LOSS_RTOL, "norm_rtol": NORM_RTOL, "grad_rtol": GRAD_RTOL,
                       "far": FAR}, scenarios, wall)




def _run_scenario(sc: Scenario, model_mod: types.ModuleType, seed: int, batch: tuple[Any, Any],
                  ref: _Step | None, nan_check: bool) -> _Step | None:
    """One training step in ``sc``'s mode; fills ``sc`` with what came out."""
    import opcontracts
    from opcontracts import ContractFixWarning, ContractViolation

    start = time.perf_counter()
    sentinel = None
    if nan_check and sc.name in ("unguarded", "fix"):
        from .nan import NanSentinel

        sentinel = NanSentinel().enable()
    step: _Step | None = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ContractFixWarning)
            mode = opcontracts.mode(sc.mode) if sc.mode is not None else contextlib.nullcontext()
            with mode:
                step = _train_step(model_mod, seed, batch, fused=sc.name != "reference")
        fixes = [str(w.message).splitlines()[0] for w in caught
                 if issubclass(w.category, ContractFixWarning)]
        sc.fixes = [f"{m} (x{fixes.count(m)})" if fixes.count(m) > 1 else m
                    for m in dict.fromkeys(fixes)]
        for w in caught:  # anything else is the user's to see
            if not issubclass(w.category, ContractFixWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        sc.loss = step.loss
        sc.grad_norm = _grad_norm(step.grads)
        sc.nonfinite = _nonfinite(step)
        base = ref if ref is not None else step  # the reference compares with itself
        sc.max_abs_diff = _max_abs_diff(step.grads, base.grads)
        sc.rel_err = _rel_err(step.grads, base.grads)
    except ContractViolation as exc:
        sc.raised, sc.error = type(exc).__name__, str(exc)
        sc.violation = {"op": exc.op, "arg": exc.arg, "rule": exc.rule}
    finally:
        if sentinel is not None:
            result = sentinel.disable()
            sc.nan_check = {**result.to_dict(), "summary": result.summary()}
        sc.seconds = time.perf_counter() - start
    return step


def _judge(sc: Scenario, ref: _Step | None) -> None:
    """Is the outcome the described one?  Sets ``ok`` and a one-line ``verdict``."""
    nan = sc.nan_check
    first = nan.get("first") if nan else None
    if sc.name == "reference":
        sc.ok = sc.nonfinite is False
        sc.verdict = "finite" if sc.ok else "NOT finite: the reference itself is broken"
        return
    if sc.name == "strict":
        v = sc.violation or {}
        sc.ok = (sc.raised == "ContractViolation" and "npu_moe_token_unpermute" in v.get("op", "")
                 and v.get("arg") == "probs")
        sc.verdict = (f"ContractViolation: {v.get('op')}, 'probs'" if sc.ok
                      else "expected a ContractViolation naming the unpermute op and 'probs'")
        return
    assert ref is not None
    if sc.loss is None or sc.rel_err is None:
        sc.ok, sc.verdict = False, f"raised {sc.raised}"
        return
    loss_close = abs(sc.loss - ref.loss) <= LOSS_RTOL * abs(ref.loss)
    if sc.name == "unguarded":
        loss_finite = math.isfinite(sc.loss)
        far = sc.nonfinite or not (sc.rel_err <= FAR)
        sc.ok = bool(loss_finite and far)
        grads = "grads NaN/inf" if sc.nonfinite else "grads far off"
        loss = "loss = reference" if loss_close else "loss finite"
        sc.verdict = (f"{loss}, {grads} (the incident)" if sc.ok
                      else "expected a finite loss and NaN or far-off gradients")
        if nan is not None:
            named = bool(first and "npu_moe_token_unpermute" in first["op"]
                         and first["direction"] == "backward")
            sc.ok = sc.ok and named
            if named:
                assert first is not None
                sc.verdict += f"; sentinel: {first['op']}, {first['direction']}, {first['module']}"
            else:
                sc.verdict += "; the NaN sentinel did not name the unpermute backward"
        return
    # fix
    assert sc.grad_norm is not None
    norm_close = abs(sc.grad_norm - _grad_norm(ref.grads)) <= NORM_RTOL * _grad_norm(ref.grads)
    sc.ok = bool(sc.nonfinite is False and loss_close and norm_close
                 and sc.rel_err <= GRAD_RTOL)
    sc.verdict = ("matches the reference (bf16 tolerance)" if sc.ok
                  else "expected finite values within bf16 tolerance of the reference")
    if nan is not None:
        sc.ok = sc.ok and first is None
        sc.verdict += "; sentinel: silent" if first is None else "; the NaN sentinel reported a NaN"


def format_table(result: DemoResult) -> str:
    rows = [("scenario", "mode", "loss", "grad norm", "non-finite", "max |grad - ref|",
             "rel. err", "outcome")]
    for sc in result.scenarios:
        nonf = "-" if sc.nonfinite is None else ("yes" if sc.nonfinite else "no")
        if sc.raised:
            loss = norm = diff = rel = "-"
        else:
            loss, norm, diff, rel = (_fmt(sc.loss, ".6f"), _fmt(sc.grad_norm, ".4f"),
                                     _fmt(sc.max_abs_diff, ".3g"), _fmt(sc.rel_err, ".2g"))
        rows.append((sc.name, sc.mode or "-", loss, norm, nonf, diff, rel,
                     ("ok: " if sc.ok else "UNEXPECTED: ") + sc.verdict))
    return "\n".join(aligned(rows))


# --------------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    """``opcontracts demo [--json FILE] [--seed N] [--nan-check]`` (the options are defined
    with the other subcommands in ``cli.py``)."""
    from .cli import build_parser

    return run(build_parser().parse_args(["demo", *(sys.argv[1:] if argv is None else argv)]))


def run(ns: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; the exit status (0: as described, 1: not, 2:
    cannot run here)."""
    try:
        result = run_demo(seed=ns.seed, nan_check=ns.nan_check)
    except _CannotRun as exc:
        print(f"opcontracts demo: {exc}", file=sys.stderr)
        return 2
    print()
    print(format_table(result))
    for sc in result.scenarios:
        if sc.nan_check is not None:
            print()
            print(f"NaN sentinel, {sc.name} run:")
            print("  " + str(sc.nan_check["summary"]).replace("\n", "\n  "))
    print()
    verdict = ("all four outcomes as described" if result.ok
               else "UNEXPECTED outcome(s): " + ", ".join(s.name for s in result.scenarios
                                                          if not s.ok))
    print(f"{verdict}; wall time {result.wall_s:.2f} s")
    if ns.json:
        path = Path(ns.json)
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n",
                        encoding="utf-8")
        print(f"results written to {path}")
    return 0 if result.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
