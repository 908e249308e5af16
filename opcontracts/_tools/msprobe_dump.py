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

This module reads and names; judging is ``check_dump``'s.  Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import OpContractsError

if TYPE_CHECKING:
    from ..spec import Contract

__all__ = ["DumpError", "TensorMeta", "Opaque", "ApiCall", "RankDump", "ApiIndex",
           "parse_api_name", "find_rank_dumps", "read_rank_dump", "user_frame"]

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
    folder names do not say) and the user frame of each API from ``stack.json``."""

    path: Path
    step: int | None
    rank: int | None
    task: str
    calls: list[ApiCall]
    frames: dict[str, str]


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


def _value(v: Any) -> Any:
    """A recorded argument as the checker sees it: TensorMeta, a Python value, a list, None, or
    Opaque."""
    if v is None:
        return None
    if isinstance(v, list):
        return [_value(x) for x in v]
    if not isinstance(v, dict):
        return Opaque(type(v).__name__)
    if "dtype" in v and "shape" in v and isinstance(v.get("shape"), list):
        try:
            shape = tuple(int(s) for s in v["shape"])
        except (TypeError, ValueError):
            return Opaque(str(v.get("type", "tensor")))
        return TensorMeta(str(v["dtype"]), shape, str(v.get("type", "torch.Tensor")))
    kind = v.get("type")
    if kind in ("int", "float", "bool", "str") and "value" in v:
        return v["value"]
    if kind == "torch.Size" and isinstance(v.get("value"), list):
        return tuple(v["value"])
    return Opaque(str(kind))


def _load_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DumpError(path, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise DumpError(path, "not a text file (an msprobe dump.json is JSON)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DumpError(path, f"not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
                        ) from None


def _calls(path: Path, data: dict[str, Any]) -> list[ApiCall]:
    out = []
    for name, entry in data.items():
        if not isinstance(entry, dict):
            raise DumpError(path, f"data[{name!r}]: expected an object, got {type(entry).__name__}")
        prefix, api, direction = parse_api_name(str(name))
        if direction == "forward" and "input_args" not in entry and "input_kwargs" not in entry:
            out.append(ApiCall(name, prefix, api, direction, inputs=False))
        elif direction == "forward":
            args = entry.get("input_args", [])
            kwargs = entry.get("input_kwargs", {})
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise DumpError(path, f"data[{name!r}]: input_args must be a list and "
                                "input_kwargs an object")
            out.append(ApiCall(name, prefix, api, direction, tuple(_value(a) for a in args),
                               {str(k): _value(v) for k, v in kwargs.items()}))
        else:
            out.append(ApiCall(name, prefix, api, direction))
    return out


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


def _frames(path: Path) -> dict[str, str]:
    """API -> its user frame, from ``stack.json`` beside ``path`` (empty when there is none)."""
    stack = path.with_name("stack.json")
    if not stack.is_file():
        return {}
    data = _load_json(stack)
    if not isinstance(data, dict):
        raise DumpError(stack, "not an msprobe stack.json (expected an object)")
    out: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
            apis, frames = value  # msprobe 8.x: {"0": [[API, ...], [frame, ...]]}
        else:
            apis, frames = [key], value  # older: {API: [frame, ...]}
        if not isinstance(frames, list):
            continue
        where = user_frame(frames)
        if where is not None:
            for api in apis:
                out[str(api)] = where
    return out


def _number(name: str, pattern: re.Pattern[str]) -> int | None:
    m = pattern.match(name)
    return int(m.group(1)) if m and m.group(1) else None


def read_rank_dump(path: Path) -> RankDump:
    """One ``dump.json``; ``DumpError`` when it is not msprobe's."""
    data = _load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("data"), dict):
        got = "an object without a 'data' object" if isinstance(data, dict) else \
            f"a JSON {type(data).__name__}"
        raise DumpError(path, f"not an msprobe dump.json (expected an object with 'task' and "
                        f"a 'data' object of API entries, got {got})")
    step = _number(path.parent.parent.name, _STEP)
    rank = _number(path.parent.name, _RANK)
    return RankDump(path, step, rank, str(data.get("task", "?")), _calls(path, data["data"]),
                    _frames(path))


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
        key = (call.prefix, call.api)
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
