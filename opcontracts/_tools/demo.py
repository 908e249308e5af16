"""``opcontracts demo``: reproduce the first-step NaN of the incident, catch it, fix it.

The incident (README): an MoE model trained on Ascend NPUs (8 cards, FSDP) ran step 1's forward
pass fine and got NaN gradients in backward, because MindSpeed's fused unpermute kernel takes
bf16 ``probs`` only and the router handed it fp32 (``moe_router_dtype=fp32``).  The fix was
``probs = probs.to(torch.bfloat16)``.

The demo runs one training step (forward + backward) of a small MoE transformer
(``demo_model.py``, loaded as user code) four ways, on the CPU emulation of the NPU kernels:

* ``reference``: the unfused MoE in plain PyTorch, the "GPU golden path";
* ``unguarded``: MindSpeed's fused permute/unpermute, ``opcontracts.mode("off")``: the loss is
  finite (and equals the reference), the gradients are NaN, as in the incident;
* ``strict``: the same, ``opcontracts.mode("strict")``: the unpermute call raises
  ``ContractViolation`` naming ``probs`` before the kernel runs;
* ``fix``: the same, ``opcontracts.mode("fix")``: probs are cast to bf16 at the call; loss and
  gradients match the reference within bf16 tolerance, and the gradients reach the router's
  fp32 probs (the cast is autograd-tracked).

The fused calls take exactly the path of a user's job: the model file does
``from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute`` after
``import opcontracts.patch``; the shipped contracts decide; the demo only sets the mode.
``--nan-check`` also runs the NaN sentinel (``opcontracts.nan``) on the unguarded and fix runs.

``--ranks N [--fsdp 1|2]`` runs the same four steps as the incident's job did: N processes
(``_tools.demo_dist.launch``; under ``torchrun`` the processes are already there and nothing is
spawned), gloo on the CPU, the model held as Megatron holds it (``Float16Module``) and sharded
per block with FSDP1 (default: flat parameters, the incident's ``_fsdp_wrapped_module`` paths)
or FSDP2 (``fully_shard``: DTensor parameters), each rank on its own data shard, the sentinel
on.  Each rank judges its own outcome against its own reference step, with gradient numbers
summed over the ranks' shards; rank 0 prints once: the table with the ranks' merged outcome,
the sentinel's first event on each rank with the module path as FSDP names it and as the model
does (``_observers.modpath.clean``), the golden compare's first divergence in the unguarded step
(``opcontracts.compare``, contracts off: it names the op even where the garbage is finite and
the sentinel sees nothing yet), and the violations of every rank
(``opcontracts.report(gather=True)``).

The exit status is 0 only when all four outcomes are the described ones (on every rank), so CI
can run it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
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
from typing import IO, Any

from .._engine.records import aligned
from ..nan import nan_step

__all__ = ["DemoResult", "DistResult", "Scenario", "format_dist", "format_table", "run",
           "run_demo", "run_rank"]

PROFILE = "incident"
PROFILE_WHY = ("the forward kernels accept fp32 probs (torch_npu 2.13 docs) while the unpermute "
               "backward kernel is bf16-only (MindSpeed's JIT-built op): the forward pass "
               "matches the reference and the gradients do not, as in the incident")

MODEL_FILE = "moe_block.py"                  # what call sites and tracebacks show
MODEL_MODULE = "_opcontracts_demo_moe_block"  # its sys.modules name while the demo runs
MODEL_SOURCE = Path(__file__).with_name("demo_model.py")

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
RANK_STRIDE = 1_000_003  # rank r's data comes from seed + 1 + r * RANK_STRIDE (rank 0: the
#                          single-process batch)
MAX_RANKS = 64


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
    compare: dict[str, Any] | None = None  # the golden compare's result (--ranks: unguarded)
    probs_grads: list[str] = field(default_factory=list)  # per router call: what reached its
    #                                  fp32 probs in backward ("finite", "non-finite", "none")
    ok: bool = False
    verdict: str = ""
    sentinel: str = ""                # what the sentinel said, for the table (with --nan-check)
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


@dataclass
class DistResult:
    """``--ranks N``: every rank's four scenarios and what they say together.  Gradient numbers
    (norm, distance to the reference) are whole-model numbers, summed over the ranks' shards;
    losses are each rank's own (its data shard)."""

    ok: bool                           # every scenario as described on every rank
    rank: int                          # the rank that holds this result
    ranks: int
    fsdp: int
    backend: str
    profile: str
    seed: int
    tolerance: dict[str, float]
    scenarios: list[Scenario]          # rank 0's (its loss; the gradient numbers are global)
    per_rank: list[list[Scenario]]     # [rank][scenario]
    ranks_ok: dict[str, list[int]]     # scenario -> the ranks where it came out as described
    nan: dict[str, dict[str, Any]]     # scenario -> the sentinel's findings over the ranks
    #                                    (``_ranks.gather.merge_nan``: first, firsts, seen_by, clean)
    report: dict[str, Any]             # every rank's violations, merged (report(gather=True))
    compare: dict[str, Any] | None     # the golden compare on the unguarded run, over the
    #                                    ranks: first divergence (with its rank), firsts, checked
    wall_s: float                      # rank 0's: environment, four steps, gathering

    def to_dict(self) -> dict[str, Any]:
        return _plain(asdict(self))


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _unplain(v: Any) -> Any:
    """A number from ``_plain`` data ("nan", "inf" back to floats)."""
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return v


class _CannotRun(Exception):
    """The demo cannot run here (a real torch_npu, bad options): exit status 2."""


# --------------------------------------------------------------------------- environment
def _real_torch_npu() -> str | None:
    """Why a real torch_npu is present (never importing it), or None."""
    from ..emulation._standins import is_standin

    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return None if is_standin(mod) else f"torch_npu is loaded from {getattr(mod, '__file__', '?')}"
    from .. import emulation

    if emulation.installed():
        return None
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        spec = None
    return None if spec is None else f"torch_npu is importable from {spec.origin or spec.name}"


def _refusal(reason: str) -> str:
    return (f"a real torch_npu is present ({reason}). The demo reproduces the incident on the "
            "CPU emulation of the NPU kernels, which never shadows a real torch_npu. On this "
            "machine, guard your own job instead: opcontracts run --mode strict train.py")


def _load_model() -> types.ModuleType:
    """Execute ``demo_model.py`` as user code, under the file name ``moe_block.py``.

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
        raise _CannotRun(_refusal(reason))
    from .. import emulation

    was_installed = emulation.installed()
    previous = emulation.current_profile()
    patch_mod = sys.modules.get("opcontracts.patch")
    was_patched = patch_mod is not None and patch_mod.is_applied()
    # MindSpeed's DeepSeek-V3 line (2.0.0_core_r0.8.0), where the incident happened: its unpermute
    # has no dtype check, so the fp32 probs reach the bf16-only kernel silently (MindSpeed master
    # TORCH_CHECKs bf16 and would have raised at the call)
    emulation.install(PROFILE, mindspeed_line="core_r0.8.0")
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
    grads: dict[str, Any]   # name -> fp32 gradient tensor (this rank's shards under FSDP)
    probs_grads: list[str]  # per router call: what reached its fp32 probs in backward


@dataclass(frozen=True)
class _Setting:
    """Where the step runs: one process (``SINGLE``) or one rank of an FSDP job
    (``_fsdp_setting``): how the model is held, where its gradients are, how numbers from the
    gradients become whole-model numbers."""

    wrap: Callable[[Any, types.ModuleType], Any]   # (model in fp32, model module) -> the module
    #                                                to call, in bf16
    grads: Callable[[Any], dict[str, Any]]         # the module -> name: fp32 gradient
    sum: Callable[[Sequence[float]], list[float]]  # over the ranks
    max: Callable[[Sequence[float]], list[float]]


def _grads_single(model: Any) -> dict[str, Any]:
    import torch

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.detach().float() if g is not None
                       else torch.zeros(p.shape, dtype=torch.float32))
    return grads


def _same(values: Sequence[float]) -> list[float]:
    return list(values)


def _wrap_single(model: Any, _mod: types.ModuleType) -> Any:
    import torch

    return model.to(torch.bfloat16)


SINGLE = _Setting(wrap=_wrap_single, grads=_grads_single, sum=_same, max=_same)


def _fsdp_setting(fsdp: int) -> _Setting:
    """One rank of the job: the model as Megatron holds it (``Float16Module``, bf16), sharded
    per block with FSDP ``fsdp``."""
    from . import demo_dist

    def wrap(model: Any, mod: types.ModuleType) -> Any:
        return demo_dist.shard(mod.Float16Module(model), mod.Block, fsdp)

    return _Setting(wrap=wrap, grads=demo_dist.local_grads, sum=demo_dist.all_sum,
                    max=demo_dist.all_max)


def _batch(seed: int, rank: int = 0) -> tuple[Any, Any]:
    """The step's token ids and targets; each rank its own shard (rank 0's is the
    single-process batch)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1 + RANK_STRIDE * rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, targets


def _watch_probs(model: Any, router: type[Any]) -> tuple[list[str], list[Any]]:
    """Per router call, what gradient reaches the fp32 probs it returns (filled in backward):
    fix mode's cast must be autograd-tracked, or the router learns nothing."""
    import torch

    seen: list[str] = []

    def on_output(_m: Any, _args: Any, out: Any) -> None:
        probs = out[0]
        if not (isinstance(probs, torch.Tensor) and probs.requires_grad):
            return
        i = len(seen)
        seen.append("none")

        def on_grad(g: Any) -> None:
            seen[i] = "finite" if bool(torch.isfinite(g).all()) else "non-finite"

        probs.register_hook(on_grad)

    handles = [m.register_forward_hook(on_output) for m in model.modules()
               if isinstance(m, router)]
    return seen, handles


def _train_step(model_mod: types.ModuleType, seed: int, batch: tuple[Any, Any], fused: bool,
                setting: _Setting = SINGLE) -> _Step:
    """Build the model from the seed (bf16 weights), run forward + backward once."""
    import torch

    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left alone
        torch.manual_seed(seed)
        inner = model_mod.MoEModel(vocab=VOCAB)
    inner.set_fused(fused)
    model = setting.wrap(inner, model_mod)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probs_grads, handles = _watch_probs(model, model_mod.Router)

    # the step's function, known to an always-on sentinel (``nan_step``): a step that turns
    # non-finite is skipped at opt.step() and replayed under the watch
    @nan_step
    def train_step(ids: Any, targets: Any) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        return loss

    try:
        loss = train_step(*batch)
    finally:
        for h in handles:
            h.remove()
    # a replay runs the routers again: the first call of each is the step's
    return _Step(float(loss.detach()), setting.grads(model), probs_grads[:len(handles)])


def _max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for name, g in a.items():
        d = float((g - b[name]).abs().max()) if g.numel() else 0.0
        if math.isnan(d):
            return math.nan
        worst = max(worst, d)
    return worst


def _measure(sc: Scenario, step: _Step | None, base: _Step | None, setting: _Setting) -> None:
    """Gradient numbers of ``step`` against ``base`` over the whole model: this rank's sums,
    added up over the ranks (always called, also when the step raised, so that every rank
    takes part in the same collectives)."""
    import torch

    if step is None or base is None:
        local = [0.0, 0.0, 0.0, 0.0, 0.0]
        mad = 0.0
    else:
        sq = sum(float((g * g).sum()) for g in step.grads.values())
        ref_sq = sum(float((g * g).sum()) for g in base.grads.values())
        diff_sq = sum(float(((g - base.grads[n]) ** 2).sum()) for n, g in step.grads.items())
        mad = _max_abs_diff(step.grads, base.grads)
        nonfinite = sum(not bool(torch.isfinite(g).all()) for g in step.grads.values())
        local = [sq, diff_sq, ref_sq, float(math.isnan(mad)), float(nonfinite)]
    sq, diff_sq, ref_sq, nan_diff, bad = setting.sum(local)
    (worst,) = setting.max([0.0 if math.isnan(mad) else mad])
    if step is None:
        return
    sc.loss = step.loss
    sc.grad_norm = math.sqrt(sq)
    sc.nonfinite = not math.isfinite(step.loss) or bad > 0
    sc.max_abs_diff = math.nan if nan_diff else worst
    num, den = math.sqrt(diff_sq), math.sqrt(ref_sq)
    sc.rel_err = num / den if den else (0.0 if num == 0 else math.inf)
    sc.probs_grads = list(step.probs_grads)


def _fmt(v: float | None, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec) if math.isfinite(v) else str(v)


# --------------------------------------------------------------------------- the demo
def _scenarios() -> list[Scenario]:
    return [
        Scenario("reference", None, "pure-PyTorch MoE, no fused ops (the GPU golden path)"),
        Scenario("unguarded", "off", "MindSpeed's fused ops, opcontracts.mode('off')"),
        Scenario("strict", "strict", "fused ops, opcontracts.mode('strict')"),
        Scenario("fix", "fix", "fused ops, opcontracts.mode('fix')"),
    ]


def _intro(seed: int, where: str) -> list[str]:
    paras = [
        "opcontracts demo: the first-step NaN of the incident (MoE training on NPUs: fp32 "
        "router probs handed to MindSpeed's bf16-only fused unpermute)",
        f"emulation: profile '{PROFILE}' of the CPU emulation of the NPU kernels: {PROFILE_WHY}",
        f"model: {MODEL_FILE} (opcontracts/_tools/{MODEL_SOURCE.name}, run as user code): 3 blocks of "
        f"attention + MoE (4 experts, top-2), bf16 weights, fp32 router; batch {BATCH}x{SEQ} "
        f"tokens, seed {seed}; its MindSpeed fused permute/unpermute calls are guarded by "
        "`import opcontracts.patch` and the shipped contracts",
    ]
    if where:
        paras.append(where)
    return [textwrap.fill(p, width=100, subsequent_indent="  ") for p in paras]


def _run_all(scenarios: list[Scenario], model_mod: types.ModuleType, seed: int,
             batch: tuple[Any, Any], nan_check: bool, setting: _Setting,
             say: Callable[[str], None], compare: bool = False,
             sentinel: str | None = None) -> None:
    ref: Scenario | None = None
    ref_step: _Step | None = None
    for i, sc in enumerate(scenarios, 1):
        say(f"[{i}/4] {sc.name}: {sc.description} ...")
        step = _run_scenario(sc, model_mod, seed, batch, ref_step, nan_check, setting, compare,
                             sentinel)
        if sc.name == "reference":
            ref, ref_step = sc, step
        _judge(sc, ref)
        if sc.error:
            say("    " + sc.error.replace("\n", "\n    "))
        for line in sc.fixes:
            say(f"    fixed: {line}")


def run_demo(seed: int = 0, nan_check: bool = False,
             out: Callable[[str], None] | None = None, sentinel: str | None = None
             ) -> DemoResult:
    """Run the four scenarios in this process; ``out`` receives the progress lines (default:
    stdout).

    ``wall_s`` counts from here, after ``import torch``: the emulation's install, the patch,
    the four steps and the cleanup."""
    import torch  # noqa: F401 - imported before the clock starts

    say = out or (lambda s: print(s, flush=True))
    t0 = time.perf_counter()
    for line in _intro(seed, ""):
        say(line)
    say("")
    scenarios = _scenarios()
    with _environment() as model_mod:
        _run_all(scenarios, model_mod, seed, _batch(seed), nan_check, SINGLE, say,
                 sentinel=sentinel)
    wall = time.perf_counter() - t0
    ok = all(sc.ok for sc in scenarios)
    return DemoResult(ok, PROFILE, PROFILE_WHY, seed, _tolerance(), scenarios, wall)


def _tolerance() -> dict[str, float]:
    return {"loss_rtol": LOSS_RTOL, "norm_rtol": NORM_RTOL, "grad_rtol": GRAD_RTOL, "far": FAR}


def _run_scenario(sc: Scenario, model_mod: types.ModuleType, seed: int, batch: tuple[Any, Any],
                  ref: _Step | None, nan_check: bool, setting: _Setting = SINGLE,
                  compare: bool = False, sentinel_kind: str | None = None) -> _Step | None:
    """One training step in ``sc``'s mode; fills ``sc`` with what came out.  ``compare``: the
    unguarded step also runs under the golden compare (``opcontracts.compare``: every guarded
    call against its plain-PyTorch reference, contracts off)."""
    from .._lang import modes
    from ..errors import ContractFixWarning, ContractViolation

    start = time.perf_counter()
    sentinel = shadow = None
    if nan_check and sc.name in ("unguarded", "fix"):
        from ..nan import NanSentinel

        # ``always-on`` (a job's ranks, by default): what a production run leaves on, the step
        # checked at opt.step() (one read), a bad step skipped and replayed under the watch;
        # ``watch`` (one process, by default): every guarded call checked
        kind = sentinel_kind or ("watch" if setting is SINGLE else "always-on")
        sentinel = NanSentinel(always_on=kind == "always-on", on_nan="record").enable()
    if compare and sc.name == "unguarded":
        from ..compare import ShadowCompare

        shadow = ShadowCompare().enable()
    step: _Step | None = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ContractFixWarning)
            mode = modes.mode(sc.mode) if sc.mode is not None else contextlib.nullcontext()
            with mode:
                step = _train_step(model_mod, seed, batch, sc.name != "reference", setting)
        fixes = [str(w.message).splitlines()[0] for w in caught
                 if issubclass(w.category, ContractFixWarning)]
        sc.fixes = [f"{m} (x{fixes.count(m)})" if fixes.count(m) > 1 else m
                    for m in dict.fromkeys(fixes)]
        for w in caught:  # anything else is the user's to see
            if not issubclass(w.category, ContractFixWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except ContractViolation as exc:
        sc.raised, sc.error = type(exc).__name__, str(exc)
        sc.violation = {"op": exc.op, "arg": exc.arg, "rule": exc.rule}
    finally:
        if sentinel is not None:
            result = sentinel.disable()
            sc.nan_check = {**result.to_dict(), "summary": result.summary()}
        if shadow is not None:
            found = shadow.disable()
            sc.compare = {**found.to_dict(), "summary": found.summary()}
    _measure(sc, step, ref if ref is not None else step, setting)  # the reference: itself
    sc.seconds = time.perf_counter() - start
    return step


def _judge(sc: Scenario, ref: Scenario | None) -> None:
    """Is the outcome the described one?  Sets ``ok``, a one-line ``verdict`` and, with the
    sentinel on, what it said (``sentinel``)."""
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
    assert ref is not None and ref.loss is not None and ref.grad_norm is not None
    if sc.loss is None or sc.rel_err is None or sc.grad_norm is None:
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
                sc.sentinel = (f"sentinel: {first['op']}, {first['direction']}, "
                               f"{first['module']}")
            else:
                sc.sentinel = "the NaN sentinel did not name the unpermute backward"
        return
    # fix
    reached = bool(sc.probs_grads) and all(g == "finite" for g in sc.probs_grads)
    norm_close = abs(sc.grad_norm - ref.grad_norm) <= NORM_RTOL * ref.grad_norm
    sc.ok = bool(sc.nonfinite is False and loss_close and norm_close
                 and sc.rel_err <= GRAD_RTOL and reached)
    if sc.ok:
        sc.verdict = "matches the reference (bf16 tolerance), grads reach the fp32 probs"
    elif not reached:
        sc.verdict = ("the gradients did not reach the router's fp32 probs: "
                      + ", ".join(sc.probs_grads or ["no router call"]))
    else:
        sc.verdict = "expected finite values within bf16 tolerance of the reference"
    if nan is not None:
        sc.ok = sc.ok and first is None
        sc.sentinel = "sentinel: silent" if first is None else "the NaN sentinel reported a NaN"


# --------------------------------------------------------------------------- --ranks N
def run_rank(seed: int = 0, fsdp: int = 1, out: Callable[[str], None] | None = None,
             sentinel: str | None = None) -> DistResult:
    """This process's part of ``opcontracts demo --ranks N``: the four scenarios on this rank's
    data shard, the model sharded with FSDP ``fsdp``, the NaN sentinel on.

    Every rank of the job must call it (it is full of collectives: FSDP's, the gradient sums,
    the gathers).  It joins the job's process group, or makes one from the launcher's
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).  Every rank gets
    the merged result (``report`` is the merged one on rank 0 only); rank 0 prints the progress
    lines (``out``, default stdout), the others print nothing."""
    import torch  # noqa: F401 - imported before the clock starts

    from .._engine import records
    from .._ranks.gather import gather_report
    from . import demo_dist

    if fsdp not in (1, 2):
        raise _CannotRun(f"--fsdp must be 1 or 2, not {fsdp}")
    t0 = time.perf_counter()
    with demo_dist.process_group() as (rank, world):
        say = (out or (lambda s: print(s, flush=True))) if rank == 0 else (lambda s: None)
        where = (f"job: {world} rank(s), gloo on the CPU, each rank on its own data shard; the "
                 f"model held as Megatron holds it (Float16Module) and sharded per block with "
                 + ("FSDP1 (FullyShardedDataParallel, auto-wrap policy on Block: flat "
                    "parameters)" if fsdp == 1 else "FSDP2 (fully_shard per block: DTensor "
                    "parameters)") + "; the NaN sentinel on, and the golden compare on the "
                 "unguarded step")
        for line in _intro(seed, where):
            say(line)
        say("")
        scenarios = _scenarios()
        with _environment() as model_mod:
            _run_all(scenarios, model_mod, seed, _batch(seed, rank), True, _fsdp_setting(fsdp),
                     say, compare=True, sentinel=sentinel)
        merged = gather_report(records.report())  # a collective: every rank calls it
        payloads = demo_dist.all_gather(
            {"rank": rank, "scenarios": [_plain(asdict(sc)) for sc in scenarios]})
        wall = time.perf_counter() - t0
    per_rank = [[_scenario_from(d) for d in p["scenarios"]]
                for p in sorted(payloads, key=lambda p: int(p["rank"]))]
    ranks_ok = {sc.name: [r for r, scs in enumerate(per_rank) if scs[i].ok]
                for i, sc in enumerate(scenarios)}
    ok = all(len(v) == world for v in ranks_ok.values())
    return DistResult(ok, rank, world, fsdp, "gloo", PROFILE, seed, _tolerance(), scenarios,
                      per_rank, ranks_ok, _first_events(per_rank), merged.to_dict(),
                      _golden_compare(per_rank), wall)


_NUMBERS = ("loss", "grad_norm", "max_abs_diff", "rel_err")


def _scenario_from(d: dict[str, Any]) -> Scenario:
    return Scenario(**{k: (_unplain(v) if k in _NUMBERS else v) for k, v in d.items()})


def _first_events(per_rank: list[list[Scenario]]) -> dict[str, dict[str, Any]]:
    """Per sentinel run, its findings over the ranks, merged as ``opcontracts report merge``
    merges ``run --nan-check`` files (``_ranks.gather.merge_nan``): ``first`` (with its ``rank``),
    ``firsts`` (each distinct first culprit with the ranks whose first it was), ``seen_by``,
    ``clean``, ``calls``."""
    from .._engine.records import Report
    from .._ranks.gather import ReportFile, merge_nan

    out: dict[str, dict[str, Any]] = {}
    for i, sc in enumerate(per_rank[0]):
        if sc.nan_check is None:
            continue
        files = [ReportFile(f"rank {r}", r, Report([]), scs[i].nan_check, None)
                 for r, scs in enumerate(per_rank)]
        merged = merge_nan(files)
        if merged is not None:
            # the always-on sentinel: per rank, the first non-finite step and how its culprit
            # was looked for (replay: reproduced or not)
            merged["always_on"] = {
                str(p["rank"]): p["always_on"]["findings"][0]
                for p in merged["per_rank"] if p.get("always_on", {}).get("findings")}
            merged.pop("per_rank", None)  # each rank's section is under per_rank already
            out[sc.name] = merged
    return out


def _golden_compare(per_rank: list[list[Scenario]]) -> dict[str, Any] | None:
    """The golden compare's findings on the unguarded run over the ranks, merged as ``run
    --compare`` merges them under torchrun (``compare.merge_sections``): counts summed,
    ``first`` (the lowest rank's first divergence, with its ``rank``), ``per_rank`` (each
    rank's first), each with ``module_clean``; ``summary`` in the compare's words from the rank
    of ``first``.  None when it did not run."""
    from .._observers.modpath import clean
    from ..compare import merge_sections

    found: list[tuple[int | None, dict[str, Any]]] = [
        (r, sc.compare) for r, scs in enumerate(per_rank) for sc in scs if sc.compare is not None]
    if not found:
        return None
    merged = merge_sections(found)
    for e in [merged["first"], *merged["per_rank"].values()]:
        if e is not None:
            e["module_clean"] = clean(e.get("module"))
    rank = merged["first"]["rank"] if merged["first"] is not None else found[0][0]
    merged["summary"] = next(c["summary"] for r, c in found if r == rank)
    return merged


def _as_rank(seed: int, fsdp: int, json_path: str | None, sentinel: str | None = None) -> int:
    """Run this rank's part; rank 0 prints the merged result and writes ``--json``; the exit
    status.  What each process started by ``--ranks N`` runs (module level: the launcher
    spawns, and the new interpreter imports it by name), and what a torchrun'd one calls."""
    try:
        result = run_rank(seed=seed, fsdp=fsdp, sentinel=sentinel)
    except _CannotRun as exc:  # every rank sees the same environment: every rank stops here
        if _rank_of_env() == 0:
            print(f"opcontracts demo: {exc}", file=sys.stderr)
        return 2
    if result.rank == 0:
        print()
        print(format_dist(result))
        if json_path:
            _write_json(json_path, result.to_dict())
    return 0 if result.ok else 1


def _rank_of_env() -> int:
    import os

    r = os.environ.get("RANK", "0")
    return int(r) if r.isdigit() else 0


def _launch(ranks: int, fsdp: int, seed: int, json_path: str | None,
            sentinel: str | None = None) -> int:
    """Start ``ranks`` processes that each run ``_as_rank``; rank 0's exit status."""
    from . import demo_dist

    reason = _real_torch_npu()
    if reason is not None:
        raise _CannotRun(_refusal(reason))
    print(f"opcontracts demo: starting {ranks} process(es) (torch's elastic launcher, gloo, CPU; "
          f"FSDP{fsdp}) ...", flush=True)
    t0 = time.perf_counter()
    try:
        codes = demo_dist.launch(ranks, _as_rank, seed, fsdp, json_path, sentinel)
    except demo_dist.LaunchError as exc:
        print(f"opcontracts demo: {exc}", file=sys.stderr)
        return 1
    print(f"launcher: {ranks} process(es) started, ran and exited in "
          f"{time.perf_counter() - t0:.2f} s", flush=True)
    return int(codes.get(0, 1))


# --------------------------------------------------------------------------- output
def _numbers_cells(sc: Scenario) -> tuple[str, str, str, str, str]:
    nonf = "-" if sc.nonfinite is None else ("yes" if sc.nonfinite else "no")
    if sc.raised:
        return "-", "-", nonf, "-", "-"
    return (_fmt(sc.loss, ".6f"), _fmt(sc.grad_norm, ".4f"), nonf, _fmt(sc.max_abs_diff, ".3g"),
            _fmt(sc.rel_err, ".2g"))


def format_table(result: DemoResult) -> str:
    rows = [("scenario", "mode", "loss", "grad norm", "non-finite", "max |grad - ref|",
             "rel. err", "outcome")]
    for sc in result.scenarios:
        loss, norm, nonf, diff, rel = _numbers_cells(sc)
        outcome = ("ok: " if sc.ok else "UNEXPECTED: ") + sc.verdict
        if sc.sentinel:
            outcome += "; " + sc.sentinel
        rows.append((sc.name, sc.mode or "-", loss, norm, nonf, diff, rel, outcome))
    return "\n".join(aligned(rows))


def _ranks_text(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if ranks else "none"


def format_dist(result: DistResult) -> str:
    """What rank 0 prints at the end of ``--ranks N``: the table (losses: the mean over the
    ranks; gradient numbers: the whole model's), the sentinel's first event on each rank, the
    golden compare's first divergence, the violations of every rank, the verdict."""
    n = result.ranks
    everyone = list(range(n))
    rows: list[tuple[str, ...]] = [
        ("scenario", "mode", f"loss (mean of {n})", "grad norm", "non-finite", "max |grad - ref|",
         "rel. err", "ranks ok", "outcome")]
    for i, sc in enumerate(result.scenarios):
        _loss, norm, nonf, diff, rel = _numbers_cells(sc)
        losses = [s[i].loss for s in result.per_rank]
        loss = ("-" if sc.raised or any(v is None for v in losses)
                else _fmt(sum(v for v in losses if v is not None) / n, ".6f"))
        good = result.ranks_ok[sc.name]
        bad = [r for r in everyone if r not in good]
        ranks = "all" if not bad else f"{_ranks_text(good)} (not {_ranks_text(bad)})"
        if bad:
            outcome = f"UNEXPECTED on rank {_ranks_text(bad)}: {result.per_rank[bad[0]][i].verdict}"
        else:
            outcome = "ok: " + sc.verdict
        rows.append((sc.name, sc.mode or "-", loss, norm, nonf, diff, rel, ranks, outcome))
    lines = aligned(rows)
    for name, nan in result.nan.items():
        lines.append("")
        lines.extend(_nan_text(name, nan, n))
    if result.compare is not None:
        lines.append("")
        lines.extend(_compare_text(result.compare))
    lines.append("")
    lines.append(_violations_text(result.report))
    lines.append("")
    bad_names = [name for name, good in result.ranks_ok.items() if len(good) < n]
    verdict = (f"all four outcomes as described on every rank ({n} rank(s), FSDP{result.fsdp})"
               if result.ok else "UNEXPECTED outcome(s): " + ", ".join(bad_names))
    lines.append(f"{verdict}; wall time {result.wall_s:.2f} s on rank {result.rank}")
    return "\n".join(lines)


def _nan_text(name: str, nan: dict[str, Any], n: int) -> list[str]:
    """The sentinel's findings of one run over the ranks: the first culprit in full (its module
    path as the job names it, and without the wrappers), the ranks that saw it, and each rank's
    first culprit with both paths side by side."""
    first = nan["first"]
    if first is None:
        return [f"NaN sentinel, {name} run: silent on every rank "
                f"({nan['calls']} guarded call(s) checked)"]
    seen = nan["seen_by"]
    missing = [r for r in range(n) if r not in seen]
    lines = [f"NaN sentinel, {name} run: first culprit on rank {first['rank']}, seen by rank "
             f"{_ranks_text(seen)}" + (f" (not rank {_ranks_text(missing)})" if missing
                                       else " (every rank)")]
    from .._ranks.gather import (
        _event_message,  # the sentinel's own wording, as report merge prints it
    )

    lines.extend("  " + ln for ln in _event_message(first).splitlines())
    for r, f in sorted(nan.get("always_on", {}).items()):
        how = {"replay": "replayed under the watch: the NaN "
               + ("reproduced" if f.get("reproduced") else "did not reproduce"),
               "recurrence": "the watch armed for a recurrence"}.get(f.get("how"), "")
        lines.append(f"  always-on, rank {r}: step {f['step']} non-finite at optimizer.step(), "
                     f"skipped; {how}")
    rows = [("ranks", "op", "direction", "module path in the job", "without wrappers")]
    for g in nan["firsts"]:
        e = g["event"]
        op = e["op"] + (f" (backward of {e['backward_of']})" if e.get("backward_of") else "")
        rows.append((_ranks_text(g["ranks"]), op, e["direction"], e.get("module") or "-",
                     e.get("module_clean") or "-"))
    lines.append("  the first culprit of each rank:")
    lines.extend("    " + ln for ln in aligned(rows))
    if nan["clean"]:
        lines.append(f"  silent on rank {_ranks_text(nan['clean'])}")
    return lines


def _compare_text(cmp: dict[str, Any]) -> list[str]:
    """The golden compare on the unguarded run: its first divergence in full (the compare's
    own wording, from the rank it came from) and each rank's first divergence, both paths."""
    first = cmp["first"]
    if first is None:
        return [f"golden compare, unguarded run: no divergence on any rank ({cmp['checked']} "
                "call(s) compared)"]
    lines = [f"golden compare (opcontracts.compare, contracts off), unguarded run: first "
             f"divergence on rank {first['rank']} ({cmp['checked']} call(s) compared on "
             f"rank {_ranks_text(cmp['ranks'])})"]
    body = str(cmp["summary"]).splitlines()[1:]  # the first divergence, as the compare says it
    cut = next((i for i, ln in enumerate(body) if ln.startswith("  then ")), len(body))
    lines.extend("  " + ln for ln in body[:cut])
    groups: dict[tuple[Any, ...], list[str]] = {}
    for r, e in cmp["per_rank"].items():
        op = e["op"] + (f" (backward of {e['backward_of']})" if e.get("backward_of") else "")
        groups.setdefault((op, e["direction"], e.get("module") or "-",
                           e.get("module_clean") or "-"), []).append(r)
    rows = [("ranks", "op", "direction", "module path in the job", "without wrappers")]
    rows += [(",".join(ranks), *key) for key, ranks in groups.items()]
    lines.append("  the first divergence of each rank:")
    lines.extend("    " + ln for ln in aligned(rows))
    silent = [r for r in cmp["ranks"] if str(r) not in cmp["per_rank"]]
    if silent:
        lines.append(f"  no divergence on rank {_ranks_text(silent)}")
    return lines


def _violations_text(report: dict[str, Any]) -> str:
    from .._engine.records import Report, table_lines

    rep = Report.from_dict(report)
    if not rep.records:
        return "contract violations, every rank: none"
    recs = sorted(rep.records, key=lambda r: (r.op, r.call_site, r.arg or "", r.mode))
    head = (f"contract violations, every rank (opcontracts.report(gather=True)): {rep.total} at "
            f"{len(recs)} site(s)")
    return "\n".join([head, *("  " + ln for ln in table_lines(recs))])


def _write_json(path: str, data: dict[str, Any], out: IO[str] | None = None) -> None:
    """``--json``: to ``out`` (the real stdout; the demo's text went to stderr) or a file."""
    from .._jsonout import to_stdout, write_json

    write_json(path, data, stdout=out)
    if not to_stdout(path):
        print(f"results written to {path}")


# --------------------------------------------------------------------------- command line
def run(ns: argparse.Namespace) -> int:
    """Run the demo from the arguments ``opcontracts demo`` parsed (the parser is the CLI's); the exit status (0: as described, 1: not, 2:
    cannot run here).  Under a launcher (``torchrun``: ``RANK`` and ``WORLD_SIZE`` set) this
    process is one rank of the job and runs its part in place; with ``--ranks N`` it starts
    the N processes itself; otherwise it runs the single-process demo.  With ``--json`` (or
    ``--json -``) the JSON alone goes to stdout, the text to stderr."""
    from .._jsonout import to_stdout

    if not to_stdout(getattr(ns, "json", None)):
        return _run(ns, None)
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return _run(ns, out)


def _run(ns: argparse.Namespace, out: IO[str] | None) -> int:
    from .demo_dist import fsdp2_missing, under_launcher

    ranks: int | None = getattr(ns, "ranks", None)
    fsdp: int | None = getattr(ns, "fsdp", None)
    sentinel: str | None = getattr(ns, "sentinel", None)
    world = under_launcher()
    try:
        if fsdp == 2 and (why := fsdp2_missing()) is not None:
            raise _CannotRun(why)
        if world is not None:
            if ranks is not None and ranks != world:
                raise _CannotRun(f"--ranks {ranks}, but this process is one rank of a job of "
                                 f"{world} (WORLD_SIZE): leave --ranks out under torchrun, or "
                                 "make them agree")
            return _as_rank(ns.seed, fsdp or 1, ns.json, sentinel)
        if ranks is not None:
            if not 1 <= ranks <= MAX_RANKS:
                raise _CannotRun(f"--ranks must be between 1 and {MAX_RANKS}, not {ranks}")
            return _launch(ranks, fsdp or 1, ns.seed, ns.json, sentinel)
        if fsdp is not None:
            raise _CannotRun("--fsdp shards the model over several ranks: give --ranks N too "
                             "(or start the demo under torchrun)")
        result = run_demo(seed=ns.seed, nan_check=ns.nan_check or sentinel is not None,
                          sentinel=sentinel)
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
        _write_json(ns.json, result.to_dict(), out)
    return 0 if result.ok else 1
