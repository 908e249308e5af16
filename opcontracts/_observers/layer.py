"""One layer over the patch's guards that observers plug into.

The NaN sentinel (``opcontracts.nan``), the shadow compare (``opcontracts.compare``), the
recorder (``opcontracts.record``) and ``opcontracts run``'s call statistics all watch the same
guarded calls.  They share this one layer instead of wrapping the guards three times: while at
least one observer is attached, every object ``opcontracts.patch`` installed (the
``patch.patched()`` records, and names bound to the guards by ``from x import f`` since) is
wrapped once more, and the wrapper hands each call to the attached observers.  When the last
observer detaches, the guards are put back ``is``-identically.

Why a layer and not a hook in the guard: the guard's hot path must stay what it is when nothing
watches.  Off, nothing of this module runs (no wrapper is installed); on, a wrapper costs one
Python call and a tuple read before anything an observer does.

Two kinds of observer:

* *counters* (``Counter``): called with the op name only, before the call, in a tight loop;
  the call statistics are one (``count``, ~0.3 us per call);
* *observers* (``Observer``): get a ``Call`` (op, guard, arguments, direction, depth, call
  site, ``nn.Module`` path, and for a call made during backward the forward call whose
  backward is running) before the call (``begin``, returning per-call state or None to skip
  the call) and the outputs after it (``end``).  Those with ``grads = True`` also see the
  gradients of the call, through the layer's backward machinery below.

How backward is watched (for observers with ``grads``, per guarded call made with grad enabled
whose inputs require grad):

* an op whose backward is ONE autograd node wired straight to its inputs (a fused kernel: a
  torch_npu op's C++ node, a MindSpeed ``autograd.Function``) gets one post-hook on that node,
  shared by every call: the node's own ``grad_inputs`` are exactly the gradients this op sends
  to its inputs, and its ``grad_outputs`` the gradients flowing in (``Observer.grad_inputs``,
  ``Observer.grad_output``), nothing is added to the graph.  Which ops are such is learned per
  guard at its first watched call (below) and checked at every call (``_direct_edges``: the
  node's every edge is one of the inputs', in order);
* any other op (a composite Python op: several nodes, or its output node not wired straight to
  its inputs), and every op at its first watched call: the tensor inputs that require grad
  pass through one identity ``autograd.Function`` (a *probe*, ``_GradProbe``) before the op:
  its backward receives exactly the gradients this op sends to those inputs (not the sum over
  every consumer of the tensor, which is what a ``register_hook`` on the input would see), and
  the node dies with the graph, so nothing accumulates on parameters from step to step; the
  outputs' nodes get one pre-hook, shared by every call (the gradients flowing in, just before
  the node runs);
* either way the outputs' nodes get an entry in their ``metadata`` naming the call: a
  ``*_grad`` op called while the node runs finds there which forward call it belongs to
  (``Call.context``, through ``torch._C._current_autograd_node``).

Why learned and not always probed: the probe is an ``autograd.Function`` per call (its
``apply``, a view per input, a Python backward): most of what watching gradients cost on the
demo's step (``benchmarks/bench_accelerator.py``).  The one case the learning cannot cover is
an op whose graph changes from call to call (a Python op that takes another branch): the call
that finds its node no longer wired to its inputs has its outputs' gradients watched but not
its inputs' (counted in ``unwatched()``), and the op is probed from then on.

Under ``torch.compile`` the layer steps aside (the guard alone runs, no graph break).  Modules
imported after an observer attached are covered through the patch's import hook; objects
captured before (a guard stored on an instance) are not.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn

from .._attach import packets
from .._engine.callsite import CallSite, SiteToken, site_of, site_token, warn_at_caller
from .._engine.sweep import holding

__all__ = [
    "Call",
    "Counter",
    "Direction",
    "Observer",
    "arg_name",
    "attach",
    "attached",
    "busy",
    "detach",
    "in_backward",
    "module_name",
    "outputs",
    "param_names",
    "tensors",
    "unwatched",
]

Direction = Literal["forward", "backward"]


# --------------------------------------------------------------------------- tensor helpers
def tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Any, torch.Tensor]]:
    """(key, tensor) for the tensor arguments, one level into lists (``Tensor[]``); a key is
    ``(position or keyword, index in the list or None)``.  A list, built in one loop (no
    generator: every watched call makes one)."""
    found: list[tuple[Any, torch.Tensor]] = []
    for keyed in (enumerate(args), kwargs.items()):
        for k, a in keyed:
            if isinstance(a, torch.Tensor):
                found.append(((k, None), a))
            elif isinstance(a, (list, tuple)):
                for j, x in enumerate(a):
                    if isinstance(x, torch.Tensor):
                        found.append(((k, j), x))
    return found


def outputs(out: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for the tensor outputs: ``output``, ``output[1]``, ``output[0][2]``."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(out, (list, tuple)):
        for i, x in enumerate(out):
            if isinstance(x, torch.Tensor):
                found.append((f"{prefix}[{i}]", x))
            elif isinstance(x, (list, tuple)):
                found.extend(outputs(x, f"{prefix}[{i}]"))
    return found


def in_backward() -> bool:
    """Whether this thread is running an autograd backward pass right now."""
    return bool(torch._C._current_graph_task_id() != -1)


_names_cache: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def param_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The parameter names of a guard (its checker's, else its signature's); cached weakly, so
    an unpatched guard is still freed."""
    try:
        return _names_cache[fn]
    except (KeyError, TypeError):
        pass
    from .._engine.enforce import compiled_of

    names: tuple[str, ...] = ()
    try:
        cc = compiled_of(fn)
        if cc is not None:
            names = tuple(p.name for p in cc.params)
    except Exception:  # naming is best effort: an event must never fail on it
        pass
    if not names:
        try:
            names = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = ()
    try:
        _names_cache[fn] = names
    except TypeError:  # not weak-referenceable: not cached
        pass
    return names


def arg_name(fn: Callable[..., Any], key: tuple[Any, int | None]) -> str:
    """The argument a ``tensors`` key stands for: ``probs``, ``x[1]``, ``args[5]``."""
    pos, j = key
    if isinstance(pos, int):
        names = param_names(fn)
        base = names[pos] if pos < len(names) else f"args[{pos}]"
    else:
        base = str(pos)
    return base if j is None else f"{base}[{j}]"


# --------------------------------------------------------------------------- module paths
class _ModuleTracker:
    """Which ``nn.Module`` a call runs in, read off the caller's frames: every module called
    as ``module(...)`` has a frame of ``nn.Module._call_impl`` on the stack while it runs, so
    the innermost such frame is the leaf and the outermost the root; the path is the leaf's
    qualified name under the root.

    Why frames and not global module hooks: a global ``register_module_forward_pre_hook``
    takes every module call of the job (not only those around a guarded call) off torch's
    fast path (``_call_impl``'s ``inner``), ~3 us each; the frames are walked only at a guarded
    call an observer keeps.

    Why the root is remembered per leaf: the leaf is a few frames above the guarded call, the
    root at the bottom of the stack (a training loop, a pipeline schedule, the wrappers: tens
    of frames, each made a frame object by the walk).  So the whole stack is walked the first
    time a leaf is seen while tracking runs, and afterwards only up to the leaf: a module's
    path is the one under the outermost module it was first seen running in (a layer called
    again from an activation-checkpointing recompute keeps the path it had in forward).
    ``start``/``stop`` forget what was learned."""

    def __init__(self) -> None:
        self._names: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = (
            weakref.WeakKeyDictionary())
        self.running = False
        self._code: Any = getattr(nn.Module._call_impl, "__code__", None)
        self._wrapped: Any = getattr(getattr(nn.Module, "_wrapped_call_impl", None), "__code__",
                                     None)
        # id(leaf) -> (weak leaf, weak root); an entry leaves with its leaf
        self._roots: dict[int, tuple[weakref.ref[nn.Module], weakref.ref[nn.Module]]] = {}

    def start(self) -> None:
        self._roots.clear()
        self.running = True

    def stop(self) -> None:
        self.running = False
        self._roots.clear()

    def snapshot(self, frame: Any = None) -> tuple[nn.Module, nn.Module] | None:
        """(root, leaf) of the modules running at ``frame`` (the caller's, by default), or
        None outside any module (or when no observer wants module paths)."""
        if not self.running:
            return None
        f = frame if frame is not None else sys._getframe(1)
        code = self._code
        while f is not None and f.f_code is not code:
            f = f.f_back
        if f is None:
            return None
        leaf = self._module_of(f)
        if leaf is None:
            return None
        roots = self._roots
        known = roots.get(id(leaf))
        if known is not None and known[0]() is leaf:
            root = known[1]()
            if root is not None:
                return root, leaf
        outer = f  # first seen: the outermost module frame is the root
        f = f.f_back
        while f is not None:
            if f.f_code is code:
                outer = f
            f = f.f_back
        root = self._module_of(outer)
        if root is None:
            return None
        key = id(leaf)

        def forget(_ref: object, k: int = key) -> None:
            roots.pop(k, None)

        roots[key] = (weakref.ref(leaf, forget), weakref.ref(root))
        return root, leaf

    def _module_of(self, frame: Any) -> nn.Module | None:
        """The module a ``_call_impl`` frame runs (its ``self``), read from the frame of
        ``_wrapped_call_impl`` (``Module.__call__``) that called it when there is one: its
        locals are three (``f_locals`` builds a dict of them), ``_call_impl``'s eight."""
        up = frame.f_back
        try:
            m = (up if up is not None and up.f_code is self._wrapped else frame).f_locals["self"]
        except (KeyError, AttributeError):  # pragma: no cover - not torch's _call_impl
            return None
        return m if isinstance(m, nn.Module) else None

    def name(self, snap: tuple[nn.Module, nn.Module] | None) -> tuple[str | None, str | None]:
        if snap is None:
            return None, None
        root, leaf = snap
        names = self._names.get(root)
        if names is None or id(leaf) not in names:
            names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
            self._names[root] = names
        name = names.get(id(leaf))
        if name is None:  # not registered under the root (called functionally)
            name = f"{type(root).__name__} > {type(leaf).__name__}"
        return name, type(leaf).__name__


_modules = _ModuleTracker()


def module_name(where: tuple[nn.Module, nn.Module] | None) -> tuple[str | None, str | None]:
    """(qualified module path, class name) of a ``Call.where`` snapshot."""
    return _modules.name(where)


# --------------------------------------------------------------------------- one call
class Call:
    """One guarded call as the observers see it.  ``args``/``kwargs`` are the call's own (never
    modify them) and are dropped when the call returns, so nothing kept for backward holds a
    tensor of the job.

    ``site`` and ``where`` are taken from the caller's frames while the call runs (on first
    use, and by the layer for every call an observer keeps), in their cheap form: the caller's
    code object and line (``_engine.callsite.site_token``), the (root, leaf) modules; the text
    of the site is made only when it is read, i.e. when a finding is reported."""

    __slots__ = ("op", "fn", "args", "kwargs", "direction", "depth", "context", "grad_keys",
                 "reused", "probe_node", "hooked", "_frame", "_token", "_where", "_placed",
                 "inputs", "outputs", "__weakref__")

    def __init__(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], direction: Direction, depth: int, frame: Any) -> None:
        self.op = op
        self.fn = fn
        self.args: tuple[Any, ...] | None = args
        self.kwargs: dict[str, Any] | None = kwargs
        self.direction = direction
        self.depth = depth
        self.context: Call | None = None  # for a call made in backward: the forward call
        self.grad_keys: list[Any] = []     # the inputs the probe watches (``tensors`` keys)
        # outputs the op itself consumes (a Python op reusing an output): the gradient reaching
        # them includes the op's own flow, so it is not what flows in from outside (None: not
        # known, the op's graph was too large to walk)
        self.reused: set[int] | None = set()
        self.probe_node: Any = None  # the input probe's node, while the outputs are hooked
        # the gradients come from the op's one node's post-hook: every ``grad_output`` of the
        # call right before its ``grad_inputs``, from the same hook (else: ``grad_output`` from
        # the output nodes' pre-hook, ``grad_inputs`` from the probe, later)
        self.hooked = False
        self._frame = frame
        self._token: SiteToken | None = None
        self._where: tuple[nn.Module, nn.Module] | None = None
        self._placed = False  # token and where taken (from the frames, while the call ran)
        # ``tensors(args, kwargs)``, listed once for the observers and the layer's gradient
        # watching; dropped with the arguments when the call returns
        self.inputs: list[tuple[Any, torch.Tensor]] = tensors(args, kwargs)
        # ``outputs(out)``, listed once when the kernel returned (before ``Observer.end``) for
        # the observers and the layer's hooks; dropped when the call returns
        self.outputs: list[tuple[str, torch.Tensor]] = []

    def _place(self) -> None:
        """Take the call site and the module snapshot off the frames (once, during the call)."""
        if not self._placed and self._frame is not None:
            self._placed = True
            self._token = site_token(self._frame)
            self._where = _modules.snapshot(self._frame)

    @property
    def site(self) -> CallSite | None:
        """The user's line that made the call."""
        self._place()
        return site_of(self._token)

    @property
    def where(self) -> tuple[nn.Module, nn.Module] | None:
        """(root, leaf) ``nn.Module`` the call ran in (``module_name`` names it), or None."""
        self._place()
        return self._where

    def place(self) -> tuple[CallSite | None, tuple[nn.Module, nn.Module] | None, str | None]:
        """Where to report this call: (call site, module snapshot, forward op) — for a
        ``*_grad`` op run by a backward node, the forward call's site and module, and its op."""
        ctx = self.context
        if ctx is not None:
            return ctx.site, ctx.where, ctx.op
        return self.site, self.where, None


class Observer:
    """What an observer implements (every method is optional).  ``grads``: wants the gradients
    (the layer probes the call's inputs and hooks its outputs); ``modules``: wants ``Call.where``
    (the layer runs global ``nn.Module`` hooks while such an observer is attached); ``reuse``:
    wants ``Call.reused``."""

    grads: bool = False
    modules: bool = False
    reuse: bool = False  # wants ``Call.reused`` (a walk of the op's graph per call with grad)
    # wants ``Call.context`` for a call made in backward even when it skipped (``begin``
    # returned None for) the forward call whose backward runs it: the layer then hooks the
    # outputs of every call made with grad (two node hooks, no probe), so that a sampling
    # observer can tell "the forward call was not drawn" from "no guarded forward call"
    contexts: bool = False

    def begin(self, call: Call) -> Any:
        """Before the kernel runs: per-call state, or None to ignore this call."""
        return None

    def end(self, call: Call, state: Any, out: Any) -> None:
        """After the kernel returned ``out`` (not called when it raised); ``call.outputs`` has
        its tensors, named (``outputs(out)``)."""

    def grad_output(self, call: Call, state: Any, label: str, position: int,
                    grad: torch.Tensor) -> None:
        """A gradient flowing into output ``position`` (of ``outputs(out)``), before the op's
        backward node runs; ``label`` is ``output`` or ``output[i]``."""

    def grad_inputs(self, call: Call, state: Any, grads: tuple[Any, ...]) -> None:
        """The gradients the op sent to its inputs, aligned with ``call.grad_keys``."""

    def node_grads(self, call: Call, state: Any,
                 incoming: list[tuple[str, int, torch.Tensor]], grads: tuple[Any, ...]) -> None:
        """A one-node op's backward, after its node ran (``Call.hooked``): the gradients that
        flowed in (label, output position, gradient) and those sent to the inputs; by default
        ``grad_output`` for each, then ``grad_inputs``.  One call per node, so that an observer
        can check the op's whole backward in one pass."""
        for label, pos, g in incoming:
            self.grad_output(call, state, label, pos, g)
        self.grad_inputs(call, state, grads)


class Counter:
    """A counter observer: ``count(op)`` before every call, nothing else (the fast path)."""

    def count(self, op: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _GradProbe(torch.autograd.Function):
    """Identity on the op's inputs that require grad; its backward sees the gradients this
    one op sends to them."""

    @staticmethod
    def forward(ctx: Any, check: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.check = check
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.check(grads)
        return (None, *grads)


_PROBE_NODE: Any = getattr(_GradProbe, "_backward_cls")  # noqa: B009  # its nodes' class


# --------------------------------------------------------------------------- dispatch
# Node metadata keys (``grad_fn.metadata``: a dict the autograd node owns, freed with the graph):
# the forward call whose backward the node runs (read by a guarded call made while the node
# runs, through ``torch._C._current_autograd_node``), and the calls whose observers want the
# gradients flowing into the node (read by the node's one shared pre-hook).
_CTX = "opcontracts.call"
_GRADS = "opcontracts.grads"   # calls probed: their observers get the gradients flowing in
_POST = "opcontracts.post"     # calls of a one-node op: gradients in and sent, after the node
_current_node: Callable[[], Any] = torch._C._current_autograd_node
_graph_task: Callable[[], int] = torch._C._current_graph_task_id


def _context() -> Call | None:
    """The forward call whose backward node is running now (None outside such a node)."""
    node = _current_node()
    if node is None:
        return None
    got = node.metadata.get(_CTX)
    return got if isinstance(got, Call) else None


def _mark(call: Call, nodes: Iterable[Any]) -> None:
    """Tell ``nodes`` (the outputs' autograd nodes) that they run ``call``'s backward; the
    innermost call wins when a wrapper and the op it calls share a node."""
    for node in nodes:
        md = node.metadata
        prev = md.get(_CTX)
        if prev is None or prev.depth < call.depth:
            md[_CTX] = call


def _output_nodes(out: Any) -> Iterator[Any]:
    """The autograd nodes of the outputs that require grad (a node once per tensor)."""
    for _name, t in outputs(out):
        if t.requires_grad and t.grad_fn is not None:
            yield t.grad_fn


_LABELS = tuple(f"output[{nr}]" for nr in range(16))  # made once, not per gradient


def _label(nr: int, several: bool) -> str:
    """How a gradient flowing into output ``nr`` of a node is named: ``output`` when the call
    has one output there, else ``output[nr]``."""
    if not several:
        return "output"
    return _LABELS[nr] if nr < 16 else f"output[{nr}]"


def _node_prehook(grad_outputs: tuple[Any, ...]) -> None:
    """The one pre-hook every watched node shares (no closure per call): the gradients flowing
    into the node go to the observers of each call registered on it (``_GRADS``)."""
    node = _current_node()
    if node is None:  # pragma: no cover - torch runs pre-hooks inside the node
        return
    for call, grad_obs, idx in node.metadata.get(_GRADS, ()):
        for pos, nr in idx:
            g = grad_outputs[nr] if nr < len(grad_outputs) else None
            if g is not None:
                label = _label(nr, len(idx) > 1)
                for o, s in grad_obs:
                    o.grad_output(call, s, label, pos, g)


def _node_posthook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
    """The one post-hook every one-node op's node shares (no closure per call, and no cycle
    through the node): after the node ran, the gradients that flowed into it and those it
    sends to each call's inputs go to that call's observers (``_POST``)."""
    node = _current_node()
    if node is None:  # pragma: no cover - torch runs post-hooks inside the node
        return
    n_out, n_in = len(grad_outputs), len(grad_inputs)
    for call, grad_obs, idx, edges in node.metadata.get(_POST, ()):
        several = len(idx) > 1
        incoming = []
        for pos, nr in idx:
            g = grad_outputs[nr] if nr < n_out else None
            if g is not None:
                incoming.append((_label(nr, several), pos, g))
        grads = tuple([grad_inputs[i] if i < n_in else None for i in edges])
        for o, s in grad_obs:
            o.node_grads(call, s, incoming, grads)


def _direct_edges(node: Any, expected: list[tuple[Any, int, Any]]) -> list[int] | None:
    """Where each expected edge is in ``node.next_functions``, in order, when the node is
    wired straight to them: every edge of the node is the next expected one (an input's
    ``(grad_fn, output_nr)``, or for a leaf ``(None, 0, tensor)``: its ``AccumulateGrad``).
    None otherwise (an edge into the op's own graph, an input the node does not reach).

    The probe of a guarded op called inside this one (a wrapper calling a guarded kernel
    with its own arguments) is seen through: it is an identity, its edge ``i`` is its input
    ``i``'s."""
    got: list[int] = []
    p, n = 0, len(expected)
    nxt: Any
    for i, (nxt, nr) in enumerate(node.next_functions):
        want = expected[p][0] if p < n else None
        while nxt is not None and nxt is not want and type(nxt) is _PROBE_NODE:
            nxt, nr = nxt.next_functions[nr]
        if nxt is None:
            continue
        if p < n:
            fn, want_nr, t = expected[p]
            if (nxt is fn and nr == want_nr) if fn is not None else \
                    getattr(nxt, "variable", None) is t:
                got.append(i)
                p += 1
                continue
        return None
    return got if p == n else None


class _Dispatch:
    """The attached observers and what one wrapped call does with them.

    Why the hot path is cheap (each watched call pays only for what an attached observer
    asked for, pluggy-style: the observers are a tuple read once, and per call the layer does
    no work for an observer that returned None from ``begin``):

    * the call site is the caller's code object and line (one dict lookup per frame above the
      wrapper, ``site_token``); the text is made when a finding is reported;
    * the module path is read off the frames (``_ModuleTracker``), no global module hooks;
    * a call made in backward finds its forward call in the running node's metadata
      (``torch._C._current_autograd_node``), so the outputs' nodes get no hook for it: a
      sampling observer's undrawn calls cost one metadata entry per output node;
    * a call whose gradients are watched gets one probe node for its inputs and, per output
      node, one pre-hook shared by every call (the calls are in the node's metadata).
    """

    def __init__(self) -> None:
        self.counters: tuple[Counter, ...] = ()
        self.observers: tuple[Observer, ...] = ()
        self.contexts = False  # an attached observer wants ``Call.context`` for every call
        self.tls = threading.local()
        # per guard, whether its backward is one node wired to its inputs (``_direct_edges``):
        # id(guard) -> (guard, verdict); absent: not known yet (the next call is probed)
        self.one_node: dict[int, tuple[Callable[..., Any], bool]] = {}
        self.unwatched = 0  # calls whose inputs' gradients could not be watched

    def depth(self) -> int:
        return getattr(self.tls, "depth", 0)  # type: ignore[no-any-return]

    def busy(self) -> bool:
        return getattr(self.tls, "busy", False)  # type: ignore[no-any-return]

    def context(self) -> Call | None:
        return _context()

    def call(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        for c in self.counters:
            c.count(op)
        observers = self.observers
        tls = self.tls
        if not observers or getattr(tls, "busy", False):
            return fn(*args, **kwargs)
        backward = _graph_task() != -1
        depth = getattr(tls, "depth", 0)
        call = Call(op, fn, args, kwargs, "backward" if backward else "forward", depth,
                    sys._getframe(2))
        if backward:
            call.context = _context()
        states = []
        kept = False
        grad_obs: list[tuple[Observer, Any]] = []
        for o in observers:
            st = o.begin(call)
            states.append(st)
            if st is not None:
                kept = True
                if o.grads:
                    grad_obs.append((o, st))
        grad = torch.is_grad_enabled()
        direct: list[torch.Tensor] | None = None  # one-node op: the inputs its node must reach
        if kept:
            call._place()  # site and module while the frames exist (judged after the call)
            keys: list[Any] = []
            inputs: list[torch.Tensor] = []
            if grad_obs and grad:
                for k, t in call.inputs:
                    if t.requires_grad:
                        keys.append(k)
                        inputs.append(t)
            if inputs:
                call.grad_keys = keys
                known = self.one_node.get(id(fn))
                if known is not None and known[0] is fn and known[1]:
                    direct = inputs
                else:
                    args, kwargs = self._probe(call, grad_obs, inputs, args, kwargs)
            else:
                grad_obs = []
        tls.depth = depth + 1
        try:
            out = fn(*args, **kwargs)
        finally:
            tls.depth = depth
        try:
            if kept:
                call.outputs = outputs(out)
                for o, st in zip(observers, states):
                    if st is not None:
                        o.end(call, st, out)
            if grad_obs:
                self._hook_outputs(call, grad_obs, direct)
            elif grad and self.contexts:
                _mark(call, _output_nodes(out))  # only which call a backward node runs
        finally:
            call.args = call.kwargs = None
            call.inputs = call.outputs = []
            call._frame = None
        return out

    def _probe(self, call: Call, grad_obs: list[tuple[Observer, Any]],
               inputs: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        keys = call.grad_keys

        def check(grads: tuple[Any, ...]) -> None:  # lives as long as the graph does
            for o, s in grad_obs:
                o.grad_inputs(call, s, grads)

        views = _GradProbe.apply(check, *inputs)
        call.probe_node = views[0].grad_fn if views else None
        new_args = list(args)
        new_kwargs = dict(kwargs)
        for (pos, j), v in zip(keys, views):
            target: Any = new_args if isinstance(pos, int) else new_kwargs
            if j is None:
                target[pos] = v
            else:
                seq = list(target[pos])
                seq[j] = v
                target[pos] = type(target[pos])(seq) if isinstance(target[pos], tuple) else seq
        return tuple(new_args), new_kwargs

    def _hook_outputs(self, call: Call, grad_obs: list[tuple[Observer, Any]],
                      direct: list[torch.Tensor] | None) -> None:
        """The outputs' autograd nodes learn that they run this call's backward (``_CTX``) and
        hand the call's gradients to its observers: a one-node op's node through the shared
        post-hook (``_POST``), a probed call's nodes through the shared pre-hook (``_GRADS``:
        the gradients flowing in; the probe has those sent to the inputs).  A probed call also
        teaches whether its op is a one-node op (``one_node``)."""
        nodes: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for pos, (_name, t) in enumerate(call.outputs):
            if t.requires_grad:
                node = t.grad_fn
                if node is not None:
                    nodes.setdefault(id(node), (node, []))[1].append((pos, t.output_nr))
        probe, call.probe_node = call.probe_node, None  # no cycle through the probe's context
        fn = call.fn
        if direct is not None:
            edges = None
            one: Any = None
            if len(nodes) == 1:
                one, idx = next(iter(nodes.values()))
                edges = _direct_edges(one, [(t.grad_fn, t.output_nr, t) for t in direct])
            if edges is not None:
                call.reused = set()  # one node: nothing of the op consumes its own outputs
                call.hooked = True
                _mark(call, (one,))
                md = one.metadata
                post = md.get(_POST)
                if post is None:
                    md[_POST] = post = []
                    one.register_hook(_node_posthook)
                post.append((call, grad_obs, idx, edges))
                return
            # the op's graph is not one node this time: its inputs' gradients are not watched
            # for this call (it ran unprobed); probed from now on
            self.one_node[id(fn)] = (fn, False)
            self.unwatched += 1
            call.reused = None
        elif id(fn) not in self.one_node or self.one_node[id(fn)][0] is not fn:
            n_in = len(call.grad_keys)
            learned = len(nodes) == 1 and probe is not None and _direct_edges(
                next(iter(nodes.values()))[0], [(probe, i, None) for i in range(n_in)]) is not None
            self.one_node[id(fn)] = (fn, learned)
        if direct is None and any(o.reuse for o, _ in grad_obs):
            call.reused = _consumed_inside(nodes, probe)
        _mark(call, (n for n, _ in nodes.values()))
        for node, idx in nodes.values():
            md = node.metadata
            entries = md.get(_GRADS)
            if entries is None:
                md[_GRADS] = entries = []
                node.register_prehook(_node_prehook)
            entries.append((call, grad_obs, idx))


def _consumed_inside(nodes: dict[int, tuple[Any, list[tuple[int, int]]]], stop: Any,
                     budget: int = 2000) -> set[int] | None:
    """Output positions whose autograd node another node of the op's own graph feeds into:
    walks from the outputs' nodes down to the input probe (a fused kernel is one node: one
    step).  None when the walk exceeds ``budget`` nodes (not known)."""
    seen: set[int] = set()
    stack = [n for n, _ in nodes.values()]
    consumed: set[int] = set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > budget:
            return None
        for nxt, _ in getattr(n, "next_functions", ()):
            if nxt is None or nxt is stop:
                continue
            if id(nxt) in nodes:
                consumed.update(pos for pos, _ in nodes[id(nxt)][1])
            stack.append(nxt)
    return consumed


_dispatch = _Dispatch()


def unwatched() -> int:
    """Calls whose inputs' gradients were not watched: a learned one-node op whose node was not
    wired straight to its inputs at that call (``_Dispatch``; the op is probed afterwards)."""
    return _dispatch.unwatched


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Inside, guarded calls on this thread go straight to the guard: an observer's own work
    (a reference that happens to call a guarded op) is not observed."""
    tls = _dispatch.tls
    prev = getattr(tls, "busy", False)
    tls.busy = True
    try:
        yield
    finally:
        tls.busy = prev


# --------------------------------------------------------------------------- the layer
_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling",
                                            torch.compiler.is_compiling)


class _Layer:
    """The second wrapper over the patch's guards, and exactly how to take it off again."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any, Any]] = []  # owner, attr, old raw, new raw
        self.wrappers: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}  # id(guard)
        self.wrapper_ids: dict[int, Callable[..., Any]] = {}  # id(wrapper) -> guard
        self.hooked: Any = None
        self.owned: set[int] = set()  # ids of wrappers registered with the patcher
        self.owned_by: Any = None

    def wrapper_for(self, guard: Callable[..., Any], op: str) -> Callable[..., Any]:
        hit = self.wrappers.get(id(guard))
        if hit is not None and hit[0] is guard:
            return hit[1]
        compiling = _is_compiling
        dispatch = _dispatch

        def watched(*args: Any, **kwargs: Any) -> Any:
            # the whole cost of the layer before an observer runs: two attribute reads
            if not (dispatch.observers or dispatch.counters) or compiling():
                return guard(*args, **kwargs)
            return dispatch.call(op, guard, args, kwargs)

        functools.update_wrapper(watched, guard)  # name, doc, signature, overloads, markers
        watched.__opcontracts_observed__ = True  # type: ignore[attr-defined]
        watched.__opcontracts_nan__ = True  # type: ignore[attr-defined]  # the marker's old name
        self.wrappers[id(guard)] = (guard, watched)
        self.wrapper_ids[id(watched)] = guard
        return watched

    def _unwrap(self, raw: Any) -> tuple[Any, Callable[[Any], Any]]:
        """The callable inside ``raw`` and how to rebuild ``raw`` around another one."""
        if isinstance(raw, staticmethod):
            return raw.__func__, staticmethod
        if isinstance(raw, classmethod):
            return raw.__func__, classmethod
        return raw, lambda f: f

    def sync(self, full: bool, who: str = "opcontracts") -> None:
        """Wrap the guards of every patch record not wrapped yet; with ``full``, also names
        bound to guards in any loaded module (``from x import f`` after the patch)."""
        patch = sys.modules.get("opcontracts.patch")
        if patch is None or not patch.is_applied():
            if full:
                warn_at_caller(f"{who}: opcontracts.patch is not applied, so no op is "
                               "watched; import opcontracts.patch first", RuntimeWarning)
            return
        self._hook_patcher(patch)
        guards: dict[int, tuple[Any, str]] = {}
        for rec in patch.patched():
            owner, attr = rec.owner, rec.attr
            raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr,
                                                                                   None)
            if isinstance(raw, packets.GuardedPacket):
                # guarded in place: the wrapper goes in front of the packet's guard, the
                # packet stays where it is bound
                inner = raw.__dict__.get("_oc_guard")
                if inner is None or id(inner) in self.wrapper_ids:
                    continue
                wrapper = self.wrapper_for(inner, rec.op)
                packets.set_guard(raw, wrapper)
                self.saved.append((raw, "_oc_guard", inner, wrapper))
                continue
            fn, rebuild = self._unwrap(raw)
            if fn is None or id(fn) in self.wrapper_ids:
                continue
            if not getattr(fn, "__opcontracts_patched__", False):
                continue  # not ours any more (restored, or replaced by someone else)
            wrapper = self.wrapper_for(fn, rec.op)
            new = rebuild(wrapper)
            setattr(owner, attr, new)
            self.saved.append((owner, attr, raw, new))
            guards[id(fn)] = (fn, rec.op)
            self._own(patch, wrapper)
        if full:
            for g, _w in self.wrappers.values():
                guards.setdefault(id(g), (g, getattr(g, "__opcontracts_op__", "?")))
            self._rebind(guards)

    def _own(self, patch: ModuleType, wrapper: Callable[..., Any]) -> None:
        """Tell the patch that ``wrapper`` stands where its guard stood: ``patch.apply()`` while
        the layer is on must see the target as guarded (not re-record or drop it), so that
        ``unpatch()`` still restores the original afterwards."""
        patcher = patch._patcher
        with patcher.lock:
            patcher.guard_ids.add(id(wrapper))
        self.owned.add(id(wrapper))
        self.owned_by = patcher

    def _disown(self) -> None:
        patcher = self.owned_by
        if patcher is not None:
            with patcher.lock:
                patcher.guard_ids.difference_update(self.owned)
        self.owned.clear()
        self.owned_by = None

    def _rebind(self, guards: dict[int, tuple[Any, str]]) -> None:
        # only the modules that hold a guard are walked by name (``_engine.sweep``: one pass
        # in C per module, the patch's own alias sweep)
        for _name, mod, d in holding([g for g, _ in guards.values()], skip_prefix=__name__):
            for key, value in list(d.items()):
                hit = guards.get(id(value))
                if hit is None or hit[0] is not value:
                    continue
                new = self.wrapper_for(value, hit[1])
                d[key] = new
                self.saved.append((mod, key, value, new))

    def restore(self) -> None:
        """Undo every change (newest first) where it is still ours, and turn wrappers that
        were copied elsewhere (``from x import f`` while on) back into their guards."""
        for owner, attr, old, new in reversed(self.saved):
            cur = owner.__dict__.get(attr) if isinstance(owner, (type, ModuleType)) else \
                getattr(owner, attr, None)
            if cur is new:
                setattr(owner, attr, old)
        self.saved.clear()
        for _name, _mod, d in holding([w for _, w in self.wrappers.values()]):
            for key, value in list(d.items()):
                guard = self.wrapper_ids.get(id(value))
                if guard is not None and self.wrappers.get(id(guard), (None, None))[1] is value:
                    d[key] = guard
        self._unhook_patcher()
        self._disown()
        self.wrappers.clear()
        self.wrapper_ids.clear()
        _dispatch.one_node.clear()

    def _hook_patcher(self, patch: ModuleType) -> None:
        """Wrap what the patch guards when a module is imported (the patch's own import hook
        calls ``on_import`` after patching it, before the importer's ``from x import f``)."""
        patcher = patch._patcher
        if self.hooked is patcher:
            return
        original = patcher.on_import

        def on_import(name: str) -> None:
            original(name)
            with _lock:
                if _attached:
                    self.sync(full=False)

        patcher.on_import = on_import
        self.hooked = patcher

    def _unhook_patcher(self) -> None:
        patcher = self.hooked
        if patcher is not None:
            patcher.__dict__.pop("on_import", None)
        self.hooked = None


_layer = _Layer()
_lock = threading.RLock()
_attached: list[Observer | Counter] = []


def _publish() -> None:
    """Hand the dispatcher the attached observers as tuples (replaced whole: readers need no
    lock) and run the module hooks exactly while an observer needs them."""
    _dispatch.counters = tuple(o for o in _attached if isinstance(o, Counter))
    _dispatch.observers = tuple(o for o in _attached if isinstance(o, Observer))
    _dispatch.contexts = any(o.contexts for o in _dispatch.observers)
    wants_modules = any(getattr(o, "modules", False) for o in _dispatch.observers)
    if wants_modules and not _modules.running:
        _modules.start()
    elif not wants_modules and _modules.running:
        _modules.stop()


def attach(observer: Observer | Counter, *, who: str = "opcontracts") -> None:
    """Start handing guarded calls to ``observer`` (installing the layer if it is the first);
    again for an attached one re-syncs with the patch (picks up guards that appeared since).
    ``who`` names the caller in the warning given when the patch is not applied."""
    with _lock:
        if not any(o is observer for o in _attached):
            _attached.append(observer)
            _publish()
        _layer.sync(full=True, who=who)


def detach(observer: Observer | Counter) -> None:
    """Stop handing calls to ``observer``; the last one to leave takes the layer off (the
    guards are the patch's own objects again)."""
    with _lock:
        for i, o in enumerate(_attached):
            if o is observer:
                del _attached[i]
                break
        else:
            return
        if not _attached:
            _layer.restore()
        _publish()


def attached() -> list[Observer | Counter]:
    """The observers attached now."""
    with _lock:
        return list(_attached)


# --------------------------------------------------------------------------- targets without a contract
class WatchError(RuntimeError):
    """A target without a contract cannot be watched here (see ``watch``)."""


_empty_ok: bool | None = None


def _empty_contract_compiles() -> bool:
    """Whether this build's checker compiles a contract without rules (a pass-through guard);
    tested once, since a guard that fails to build would break the watched call."""
    global _empty_ok
    if _empty_ok is None:
        from .._engine.compile import Param, compile_contract
        from ..spec import Contract

        try:
            cc = compile_contract(Contract("opcontracts.watch-selftest", {}), [Param("x")])
            _empty_ok = bool(cc.fast(1)) if cc.fast is not None else True
        except Exception:
            _empty_ok = False
    return _empty_ok


def watch(targets: dict[str, str], *, source: str) -> list[str]:
    """Guard ``{op: "module.function"}`` targets that have no contract, with an empty contract
    (no rules: the guard only calls through), so that observers see their calls.  The patch
    does the finding, the import hook for modules imported later and the alias rebinding, as
    for any contract; ops that have a contract already are left as they are.  Returns the ops
    newly watched.  The empty contracts stay registered until the process ends (they check
    nothing)."""
    from .._engine import registry
    from ..spec import Contract

    new = []
    for op, path in targets.items():
        try:
            has = bool(registry.candidates(op)) or registry.resolve(op) is not None
        except registry.UnknownOpError:
            has = False
        if not has:
            new.append(Contract(op, {}, targets=(path,),
                                source=f"{source}: watched without a contract (no rules)"))
    if not new:
        return []
    if not _empty_contract_compiles():
        raise WatchError(
            "watching a target without a contract needs a guard that checks nothing, and this "
            "build's checker cannot compile a contract without rules; give the op a contract "
            f"instead ({', '.join(c.op for c in new)})")
    import opcontracts.patch as patch

    patch.apply(new)
    return [c.op for c in new]
