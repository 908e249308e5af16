"""Reading msprobe dumps: the files, the API names, the recorded arguments.

msprobe (PyPI ``mindstudio-probe``) writes ``DUMP/step{N}/rank{R}/dump.json`` (with
``stack.json`` and ``construct.json`` beside it).  ``dump.json`` is
``{"task", "level", "framework", "dump_data_dir", "data": {API: {...}}}``; a forward entry holds
``input_args`` (a list), ``input_kwargs`` (a dict) and ``output``; a backward entry ``input``
and ``output`` (gradients).  Each tensor is ``{"type": "torch.Tensor", "dtype":
"torch.bfloat16", "shape": [...], ...statistics...}`` (``data_name`` too in tensor mode: the
``.pt`` file, never read here), a Python scalar ``{"type": "int", "value": 3}``, a list of such
entries for a tensor list, ``null`` for None.

API names are ``<prefix>.<api>.<n>.<forward|backward>``: ``NPU`` for torch_npu's ops
(``torch_npu.X`` and ``torch.ops.npu.X``), ``MindSpeed`` for ``mindspeed.ops``' fused ops,
``Torch`` / ``Tensor`` / ``Functional`` / ``VF`` / ``Aten`` / ``Distributed`` for PyTorch's
own, and, for an API registered with ``register_custom_api(module, name, prefix)``, the prefix
given (by default the module's ``__name__``).  Level ``L0`` adds module entries
(``Module.<path>.<Class>.forward.<n>``).  ``stack.json`` is ``{"0": [[API, ...], [frame, ...]],
...}`` in msprobe 8.x and later, ``{API: [frame, ...]}`` before; a frame is ``"File PATH, line
N, in FUNC, \\n CODE"``, innermost first.

Files are read one entry at a time (``json_stream``): a dump.json of gigabytes is never in
memory at once, and only the call sites of the APIs asked for are kept from ``stack.json``.
A tensor whose record cannot be read (no dtype, a negative or infinite size, more elements than
a tensor can have) is ``Unreadable``, with why: its rules cannot be judged, the rest of the dump
is.  The tensor files of a tensor-mode dump (``.pt``, ``.npy``) are never opened, let alone
unpickled.

This module reads and names; judging is ``check_dump``'s.  Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import OpContractsError
from .json_stream import ObjectStream, StreamError

if TYPE_CHECKING:
    from ..spec import Contract

__all__ = ["DumpError", "TensorMeta", "Opaque", "Unreadable", "ApiCall", "RankDump", "ApiIndex",
           "parse_api_name", "find_rank_dumps", "read_rank_dump", "user_frame", "where"]

TORCH_FAMILIES = frozenset({"Torch", "Tensor", "Functional", "VF", "Aten", "Distributed",
                            "NPUDistributed", "Module", "Cell", "Jit"})
"""msprobe's prefixes for PyTorch's own APIs and modules: counted, never checked"""

_STEP = re.compile(r"^step(\d+)$")
_RANK = re.compile(r"^rank(\d*)$")
_FRAME = re.compile(r"^File (?P<file>.*), line (?P<line>\d+), in (?P<func>[^,]*)")
# frames that are the framework's, not the job's own code (the dump comes from another machine:
# its paths are read as text)
_LIBRARY = re.compile(r"[/\\](site-packages|dist-packages|lib[/\\]python\d(\.\d+)?)[/\\]"
                      r"|^<|[/\\](msprobe|torch|torch_npu|opcontracts)[/\\]")


class DumpError(OpContractsError, ValueError):
    """A path that is not an msprobe dump (or a file of one that cannot be read); the message
    names the file and what is wrong with it, on one line."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


@dataclass(frozen=True)
class TensorMeta:
    """A recorded tensor: msprobe's dtype name (``torch.bfloat16``) and shape."""

    dtype: str
    shape: tuple[int, ...]
    type: str = "torch.Tensor"


@dataclass(frozen=True)
class Opaque:
    """A recorded value the checker cannot use (a process group, a device, a dtype ...)."""

    type: str


@dataclass(frozen=True)
class Unreadable(Opaque):
    """A recorded tensor whose record lacks what a rule reads (no dtype, a size that is not
    one): the rules on it cannot be judged, ``why`` says why."""

    why: str = ""


@dataclass(frozen=True)
class ApiCall:
    """One entry of ``dump.json``."""

    name: str
    """msprobe's API name, ``MindSpeed.npu_moe_token_unpermute.0.forward``"""
    prefix: str
    """``NPU``, ``MindSpeed``, ``Torch`` ... or a custom API's prefix"""
    api: str
    """the API without prefix and count: ``npu_moe_token_unpermute``"""
    direction: str
    """``forward`` or ``backward`` (``""`` for entries of another form)"""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: bool = True
    """whether msprobe recorded the inputs (``data_mode`` without ``input`` leaves them out:
    such an entry holds outputs only and cannot be judged)"""


@dataclass
class RankDump:
    """One ``dump.json`` with where it sits (``step``/``rank`` from its folders, None when the
    folder names do not say) and the user frame of the APIs asked for from ``stack.json``.
    Its calls are read when asked for (``calls()``), one entry at a time: a dump of gigabytes
    is never in memory at once."""

    path: Path
    step: int | None
    rank: int | None
    frames: dict[str, str]
    keep: Callable[[str, str], bool] | None = None
    """``keep(prefix, api)``: whether a forward entry's inputs are read (the others are named
    and counted only)"""

    def calls(self) -> Iterator[ApiCall]:
        """The entries of ``data``, in the file's order; ``DumpError`` naming the file and the
        entry when one is not msprobe's."""
        yield from _read_calls(self.path, self.keep)


def parse_api_name(name: str) -> tuple[str, str, str]:
    """``(prefix, api, direction)`` of an msprobe API name: ``NPU.npu_rms_norm.0.forward`` ->
    ``("NPU", "npu_rms_norm", "forward")``; a custom API with a dotted prefix keeps it
    (``mypkg.ops.fused.1.forward`` -> ``("mypkg.ops", "fused", "forward")``); a name of another
    form (a module entry) gives its first segment and ``direction == ""``."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[-1] in ("forward", "backward") and parts[-2].isdigit():
        if parts[0] in TORCH_FAMILIES or parts[0] in ("NPU", "MindSpeed"):
            return parts[0], ".".join(parts[1:-2]), parts[-1]
        return ".".join(parts[:-3]), parts[-3], parts[-1]
    return parts[0], ".".join(parts[1:]), ""


MAX_ELEMENTS = 2**63 - 1
"""the most elements a tensor can have (torch counts them in an int64)"""


def _short(v: Any) -> str:
    text = json.dumps(v, allow_nan=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _tensor(v: dict[str, Any]) -> TensorMeta | Unreadable:
    """A recorded tensor, or why it cannot be read: no dtype or shape, a size that is not one
    (negative, ``Infinity``, not an integer), more elements than a tensor can have."""
    kind = str(v.get("type", "torch.Tensor"))
    dtype, shape = v.get("dtype"), v.get("shape")
    if dtype is None:
        return Unreadable(kind, "no dtype recorded")
    if not isinstance(dtype, str):
        return Unreadable(kind, f"dtype {_short(dtype)} is not a dtype name")
    if shape is None:
        return Unreadable(kind, "no shape recorded")
    if not isinstance(shape, list):
        return Unreadable(kind, f"shape {_short(shape)} is not a list of sizes")
    numel = 1
    for s in shape:
        if type(s) is not int:  # noqa: E721 - bool is no size, nor is 4.0 or Infinity
            return Unreadable(kind, f"shape {_short(shape)}: {_short(s)} is not a size")
        if s < 0:
            return Unreadable(kind, f"shape {_short(shape)}: negative size {s}")
        numel *= s
    if numel > MAX_ELEMENTS:
        return Unreadable(kind, f"shape {_short(shape)}: more elements than a tensor can have "
                          "(2**63 - 1)")
    return TensorMeta(dtype, tuple(shape), kind)


MAX_DEPTH = 16
"""lists inside lists a recorded argument may have (a tensor list is one)"""


def _value(v: Any, depth: int = 0) -> Any:
    """A recorded argument as the checker sees it: TensorMeta, a Python value, a list, None,
    Opaque, or Unreadable (a tensor whose record lacks what a rule reads, lists nested deeper
    than ``MAX_DEPTH``)."""
    if v is None:
        return None
    if isinstance(v, list):
        if depth >= MAX_DEPTH:
            return Unreadable("list", f"lists nested more than {MAX_DEPTH} deep")
        return [_value(x, depth + 1) for x in v]
    if not isinstance(v, dict):
        return Opaque(type(v).__name__)
    kind = v.get("type")
    if "dtype" in v or "shape" in v or (isinstance(kind, str) and kind.endswith(
            ("Tensor", "Parameter"))):
        return _tensor(v)
    if kind in ("int", "float", "bool", "str") and "value" in v:
        return v["value"]
    if kind == "torch.Size" and isinstance(v.get("value"), list):
        return tuple(v["value"])
    return Opaque(str(kind))


def _call(path: Path, name: str, entry: Any, keep: Callable[[str, str], bool] | None) -> ApiCall:
    if not isinstance(entry, dict):
        raise DumpError(path, f"data[{name!r}]: expected an object, got {_json_type(entry)}")
    prefix, api, direction = parse_api_name(name)
    if direction != "forward" or (keep is not None and not keep(prefix, api)):
        return ApiCall(name, prefix, api, direction)
    if "input_args" not in entry and "input_kwargs" not in entry:
        return ApiCall(name, prefix, api, direction, inputs=False)
    args = entry.get("input_args", [])
    kwargs = entry.get("input_kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise DumpError(path, f"data[{name!r}]: input_args must be a list and "
                        "input_kwargs an object")
    return ApiCall(name, prefix, api, direction, tuple(_value(a) for a in args),
                   {str(k): _value(v) for k, v in kwargs.items()})


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null",
            bool: "a boolean"}.get(type(v), "a number")


def user_frame(frames: list[Any]) -> str | None:
    """The first frame of a stack (innermost first) in the job's own code, as
    ``FILE:LINE in FUNC``: not the framework's (installed packages, the standard library,
    torch, torch_npu, msprobe, opcontracts)."""
    first = None
    for f in frames:
        m = _FRAME.match(str(f))
        if m is None:
            continue
        text = f"{m['file']}:{m['line']} in {m['func'].strip()}"
        first = first or text
        if not _LIBRARY.search(m["file"]):
            return text
    return first


def _open(path: Path) -> IO[str]:
    try:
        return open(path, encoding="utf-8")  # noqa: SIM115 - the caller's with closes it
    except OSError as exc:
        raise DumpError(path, f"cannot read: {exc.strerror or exc}") from None


@contextmanager
def _stream(path: Path) -> Iterator[ObjectStream]:
    """The file as an ``ObjectStream``; every reading problem a ``DumpError`` naming it."""
    with _open(path) as f:
        try:
            if f.read(1) not in ("\ufeff", ""):  # a byte-order mark is no content
                f.seek(0)
            yield ObjectStream(f)
        except StreamError as exc:
            raise DumpError(path, str(exc)) from None
        except UnicodeDecodeError:
            raise DumpError(path, "not a text file (an msprobe dump is JSON)") from None
        except OSError as exc:
            raise DumpError(path, f"cannot read: {exc.strerror or exc}") from None


def _read_calls(path: Path, keep: Callable[[str, str], bool] | None) -> Iterator[ApiCall]:
    found = False
    with _stream(path) as s:
        if s.peek() != "{":
            raise DumpError(path, "not an msprobe dump.json (expected an object with 'task' "
                            f"and a 'data' object of API entries, got {s.kind()})")
        for key in s.members():
            if key != "data" or found:
                s.value(key)
                continue
            found = True
            if s.peek() != "{":
                raise DumpError(path, "not an msprobe dump.json ('data' is "
                                f"{s.kind()}, expected an object of API entries)")
            for name in s.members("data"):
                what = f"data[{name!r}]"
                yield _call(path, name, s.value(what), keep)
        s.end()
    if not found:
        raise DumpError(path, "not an msprobe dump.json (expected an object with 'task' and "
                        "a 'data' object of API entries, got an object without a 'data' "
                        "object)")


def _frames(path: Path, wanted: Callable[[str], bool] | None = None) -> dict[str, str]:
    """API -> its user frame, from ``stack.json`` beside ``path`` (empty when there is none),
    for the APIs ``wanted`` (every one by default); read one member at a time."""
    stack = path.with_name("stack.json")
    if not stack.is_file():
        return {}
    out: dict[str, str] = {}
    with _stream(stack) as s:
        if s.peek() != "{":
            raise DumpError(stack, f"not an msprobe stack.json (expected an object, got "
                            f"{s.kind()})")
        for key in s.members():
            value = s.value(repr(key))
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
                apis, frames = value  # msprobe 8.x: {"0": [[API, ...], [frame, ...]]}
            else:
                apis, frames = [key], value  # older: {API: [frame, ...]}
            apis = [str(a) for a in apis if wanted is None or wanted(str(a))]
            if not apis or not isinstance(frames, list):
                continue
            where = user_frame(frames)
            if where is not None:
                for api in apis:
                    out[api] = where
        s.end()
    return out


def _number(name: str, pattern: re.Pattern[str]) -> int | None:
    m = pattern.match(name)
    return int(m.group(1)) if m and m.group(1) else None


def where(path: Path) -> tuple[int | None, int | None]:
    """``(step, rank)`` of a ``dump.json`` from its folders' names (None where they do not
    say)."""
    return _number(path.parent.parent.name, _STEP), _number(path.parent.name, _RANK)


def read_rank_dump(path: Path, keep: Callable[[str, str], bool] | None = None) -> RankDump:
    """One ``dump.json``: where it sits and its call sites (``stack.json``, for the APIs
    ``keep(prefix, api)`` accepts); its entries are read by ``RankDump.calls()``, whose
    ``DumpError`` names the file and entry that are not msprobe's."""
    step, rank = where(path)
    if not path.is_file():
        raise DumpError(path, "no such file")

    def wanted(api: str) -> bool:
        return keep is None or keep(*parse_api_name(api)[:2])

    return RankDump(path, step, rank, _frames(path, wanted), keep)


def find_rank_dumps(path: str | Path) -> list[Path]:
    """The ``dump.json`` files PATH stands for: a dump folder (``step*/rank*/dump.json``, or
    ``step*/proc*/`` from a job without ranks), one step folder (``rank*/dump.json``), one rank
    folder, or a ``dump.json`` itself; sorted by step then rank.  ``DumpError`` when there is
    none."""
    p = Path(path)
    if not p.exists():
        raise DumpError(p, "no such file or folder")
    if p.is_file():
        return [p]
    if (p / "dump.json").is_file():
        return [p / "dump.json"]

    def key(f: Path) -> tuple[int, int, str]:
        step = _number(f.parent.parent.name, _STEP)
        rank = _number(f.parent.name, _RANK)
        return (-1 if step is None else step, -1 if rank is None else rank, str(f))

    found = sorted(_walk(p), key=key)
    if not found:
        raise DumpError(p, "no msprobe dump here (expected step*/rank*/dump.json, "
                        "rank*/dump.json, proc*/dump.json or a dump.json)")
    return found


def _walk(p: Path) -> Iterator[Path]:
    # rank{R}: under a process group; proc{PID}: msprobe's folder when no rank is known
    for folder in ("rank*", "proc*"):
        yield from p.glob(f"step*/{folder}/dump.json")
        yield from p.glob(f"{folder}/dump.json")


class ApiIndex:
    """msprobe's API names -> the contract ops they are.  ``NPU.X`` is the op guarding
    ``torch_npu.X`` or ``torch.ops.npu.X``; ``MindSpeed.X`` the one guarding
    ``mindspeed.ops.<module>.X`` (msprobe wraps the functions its list names in those
    modules); any other prefix ``P.X`` (``register_custom_api(module, "X")`` names it with the
    module's ``__name__`` unless given a prefix) the one guarding ``P.X``, or the op named
    ``P.X``; PyTorch's own APIs (``TORCH_FAMILIES``) none."""

    def __init__(self, contracts: Iterable[Contract]) -> None:
        self._by_target: dict[str, str] = {}
        self._mindspeed: dict[str, str] = {}
        self._ops: set[str] = set()
        for c in contracts:
            self._ops.add(c.op)
            for t in c.targets:
                self._by_target.setdefault(t, c.op)
                parts = t.split(".")
                if len(parts) == 4 and parts[:2] == ["mindspeed", "ops"]:
                    self._mindspeed.setdefault(parts[3], c.op)
        self._memo: dict[tuple[str, str], str | None] = {}

    def op_for(self, call: ApiCall) -> str | None:
        """The contract op of ``call``'s API, or None."""
        return self.op_of(call.prefix, call.api)

    def op_of(self, prefix: str, api: str) -> str | None:
        """The contract op of the API ``prefix``.``api``, or None."""
        key = (prefix, api)
        if key not in self._memo:
            self._memo[key] = self._op_for(*key)
        return self._memo[key]

    def _op_for(self, prefix: str, api: str) -> str | None:
        if prefix in TORCH_FAMILIES:
            return None
        if prefix == "NPU":
            return self._by_target.get(f"torch_npu.{api}") or \
                self._by_target.get(f"torch.ops.npu.{api}")
        if prefix == "MindSpeed":
            return self._mindspeed.get(api)
        full = f"{prefix}.{api}"
        return self._by_target.get(full) or (full if full in self._ops else None)
