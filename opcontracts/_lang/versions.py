"""Versions of torch_npu, CANN, MindSpeed, torch and the chip, and ``when`` conditions over them.

Why detection never imports torch_npu: without the CANN toolkit ``import torch_npu`` fails
(``libhccl.so`` missing), and once torch_npu is installed even ``import torch`` can fail through
its backend entry point.  So versions come from places that are safe to read:

========== ===========================================================================
torch_npu  ``set_versions`` > ``OPCONTRACTS_TORCH_NPU_VERSION`` > a ``torch_npu`` module
           already in ``sys.modules`` (the emulation's stand-in says so with
           ``__opcontracts_emulation__``) > package metadata (``torch-npu`` / ``torch_npu``)
cann       ``set_versions`` > ``OPCONTRACTS_CANN_VERSION`` > the emulation's stack (the stand-in
           ``torch_npu``'s ``__opcontracts_stack__``: the CANN its kernels behave as) > the ops
           package's
           ``<arch>-linux/ascend_ops_install.info`` (CANN >= 8.5 ships the kernels as a
           separate ops package whose version can differ from the toolkit's; the kernels are
           what contracts speak about; the toolkit's version is shown beside it) > the
           toolkit's ``<arch>-linux/ascend_toolkit_install.info`` (``version=``) or
           ``version.cfg`` (``toolkit_running_version=[inner:8.0.RC3]``), under
           ``ASCEND_TOOLKIT_HOME``, ``ASCEND_HOME_PATH``,
           ``/usr/local/Ascend/ascend-toolkit/latest`` or ``/usr/local/Ascend/cann``
mindspeed  ``set_versions`` > ``OPCONTRACTS_MINDSPEED_VERSION`` > ``sys.modules['mindspeed']``
           > package metadata (``mindspeed``)
torch      ``torch.__version__`` when imported, else package metadata
soc        ``set_versions`` > ``OPCONTRACTS_SOC`` > ``torch_npu.npu.get_device_name()`` when
           torch_npu is already loaded (it reads the name without the device's lazy init;
           ``get_soc_version()`` runs that init and is never called; detection never imports
           torch_npu to ask; the emulation reports its SoC through its npu device only)
========== ===========================================================================

CANN names its releases ``8.0.RC3``, ``8.0.RC2.alpha003``, ``8.1.RC1``: ``normalize_version``
turns them into PEP 440 (``8.0rc3``, ``8.0rc2.dev3``) so ``8.0.RC3 < 8.0.0``, as in reality.
Specifiers are evaluated by plain version ordering, not by ``SpecifierSet.contains``: PEP 440
says ``<8.0.0`` excludes ``8.0rc3`` (a pre-release of 8.0.0), which is the opposite of what a
contract written against CANN's numbering means.

Detection runs once and is cached; ``current()`` then costs two ``sys.modules`` lookups (to
notice a torch_npu or mindspeed stand-in installed later).  Environment variables are read at
detection time: after changing them in-process, call ``opcontracts.set_versions()`` (no
arguments re-detects).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterable
from contextlib import ContextDecorator
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    from ..spec import When

__all__ = [
    "Env", "FIELDS", "current", "refresh", "applies", "explain", "describe", "rows", "set_versions",
    "normalize_version", "parse_version", "satisfies", "soc_matches", "versions",
]

FIELDS: tuple[str, ...] = ("torch_npu", "cann", "mindspeed", "torch", "soc")
"""The names a ``when`` table may use, in display order."""

ENV_VARS: dict[str, str] = {
    "torch_npu": "OPCONTRACTS_TORCH_NPU_VERSION",
    "cann": "OPCONTRACTS_CANN_VERSION",
    "mindspeed": "OPCONTRACTS_MINDSPEED_VERSION",
    "soc": "OPCONTRACTS_SOC",
}

CANN_ROOT_VARS: tuple[str, ...] = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_DEFAULT_ROOTS: list[str] = ["/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann"]
"""Searched after the environment variables; a list so tests can point it elsewhere."""

UNKNOWN = "unknown"


@dataclass(frozen=True)
class Env:
    """The detected environment.  Versions are the raw strings as found (``8.0.RC3``);
    ``None`` means unknown.  ``origins`` says where each came from, ``emulated`` which
    packages are opcontracts' CPU stand-ins rather than the real thing."""

    torch_npu: str | None = None
    cann: str | None = None
    mindspeed: str | None = None
    torch: str | None = None
    soc: str | None = None
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    emulated: tuple[str, ...] = ()

    def origin(self, name: str) -> str:
        """Where ``name``'s value came from (``"unknown"`` when nothing was found)."""
        return dict(self.origins).get(name, UNKNOWN)


# --------------------------------------------------------------------------- versions
_CANN_RE = re.compile(
    r"^(?P<rel>\d+(?:\.\d+)*)"
    r"(?:[.\-_]?(?P<pre>rc|alpha|beta|a|b)[.\-_]?(?P<pren>\d+))?"
    r"(?:[.\-_]?(?P<build>alpha|beta|[a-z])[.\-_]?(?P<buildn>\d+))?$",
    re.IGNORECASE,
)


def normalize_version(text: str) -> str | None:
    """The PEP 440 spelling of a torch_npu / CANN / MindSpeed version, or ``None``.

    ``8.0.RC3`` -> ``8.0rc3``; ``8.0.RC2.alpha003`` -> ``8.0rc2.dev3`` (an early build of RC2,
    so it sorts before ``8.0rc2``); ``8.0.0.alpha001`` -> ``8.0.0a1``; ``CANN-1.83`` -> ``1.83``;
    ``2.5.1.post1.dev20250519`` and ``2.13.0+cpu`` are already PEP 440 and kept.
    """
    s = text.strip()
    for prefix in ("CANN-", "cann-", "v", "V"):
        if s.startswith(prefix) and s[len(prefix):][:1].isdigit():
            s = s[len(prefix):]
    if not s:
        return None
    try:
        return str(Version(s))
    except InvalidVersion:
        pass
    m = _CANN_RE.match(s)
    if m is None:
        return None
    out = m["rel"]
    if m["pre"]:
        pre = m["pre"].lower()
        out += {"alpha": "a", "beta": "b"}.get(pre, pre) + str(int(m["pren"]))
    if m["build"]:
        # a build tag after a pre-release (RC2.alpha003, RC1.B010) marks an earlier build of it
        out += f".dev{int(m['buildn'])}"
    try:
        return str(Version(out))
    except InvalidVersion:  # pragma: no cover - the regex only builds valid versions
        return None


@lru_cache(maxsize=256)
def parse_version(text: str | None) -> Version | None:
    """``Version`` of a raw version string (local part dropped: ``2.13.0+cpu`` is 2.13.0),
    or ``None`` when it is missing or cannot be read."""
    if not text:
        return None
    norm = normalize_version(text)
    if norm is None:
        return None
    return Version(Version(norm).public)


@lru_cache(maxsize=256)
def _specifiers(spec: str) -> tuple[tuple[str, str], ...]:
    try:
        return tuple((s.operator, s.version) for s in SpecifierSet(spec))
    except InvalidSpecifier:
        raise ValueError(f"not a version specifier: {spec!r}") from None


def _one(v: Version, op: str, target: str) -> bool:
    if op == "===":
        return str(v) == target
    if target.endswith(".*") and op in ("==", "!="):
        t = parse_version(target[:-2])
        if t is None:
            raise ValueError(f"cannot read version {target!r}")
        n = len(t.release)
        same = (v.release + (0,) * n)[:n] == t.release
        return same if op == "==" else not same
    t = parse_version(target)
    if t is None:
        raise ValueError(f"cannot read version {target!r}")
    if op == "~=":
        prefix = t.release[:-1]
        return v >= t and v.release[:len(prefix)] == prefix
    return {
        "==": v == t, "!=": v != t, "<": v < t, "<=": v <= t, ">": v > t, ">=": v >= t,
    }[op]


def satisfies(version: str | Version, spec: str) -> bool:
    """Whether ``version`` meets ``spec`` (``">=8.0.0"``, ``"<2.13,>=2.7.1"``), comparing
    normalised versions by plain ordering, pre-releases included: ``8.0.RC3`` meets ``<8.0.0``.
    ``spec`` may hold alternatives joined by ``||`` (``">=2.13 || ==2.7.1.post11"``): any one
    of them suffices.  Post releases order after their release (``2.7.1.post11 > 2.7.1``)."""
    v = version if isinstance(version, Version) else parse_version(version)
    if v is None:
        raise ValueError(f"cannot read version {version!r}")
    return any(all(_one(v, op, target) for op, target in _specifiers(alt.strip()))
               for alt in spec.split("||"))


def soc_matches(soc: str, names: Iterable[str]) -> bool:
    """Whether the chip ``soc`` is one of ``names``: case-insensitive, exact or by prefix, so
    ``Ascend910B`` matches ``Ascend910B1`` .. ``Ascend910B4`` (and ``Ascend910`` matches every
    910 variant, 910B and 910_93 included)."""
    s = soc.strip().casefold()
    return any(s.startswith(n.strip().casefold()) for n in names if n.strip())


# --------------------------------------------------------------------------- when
def _conditions(when: When | dict[str, Any]) -> list[tuple[str, Any]]:
    """The set conditions of a ``When`` model or of a raw ``when`` table from a file (the patch
    reads shipped files without building pydantic models)."""
    if isinstance(when, dict):
        out: list[tuple[str, Any]] = []
        for name in FIELDS:
            v = when.get(name)
            if v is not None:
                if name == "soc":
                    out.append((name, (v,) if isinstance(v, str) else tuple(v)))
                else:  # a list of alternatives, as When stores it: "a || b"
                    out.append((name, " || ".join(map(str, v)) if isinstance(v, (list, tuple))
                                else str(v)))
        return out
    return [(name, getattr(when, name)) for name in FIELDS if getattr(when, name) is not None]


def applies(when: When | dict[str, Any] | None, env: Env) -> bool | None:
    """``True`` when every condition of ``when`` holds in ``env``, ``False`` when one fails,
    ``None`` when none fails but one needs a version (or chip) that is unknown.

    A failed condition wins over an unknown one: a contract for ``torch_npu >=2.13`` does not
    apply under torch_npu 2.7.1 whatever CANN is.
    """
    if when is None:
        return True
    unknown = False
    for name, cond in _conditions(when):
        have = getattr(env, name)
        if name == "soc":
            if not have:
                unknown = True
            elif not soc_matches(have, cond):
                return False
            continue
        v = parse_version(have)
        if v is None:
            unknown = True
        elif not satisfies(v, cond):
            return False
    return None if unknown else True


def _cond_text(name: str, cond: Any) -> str:
    if name == "soc":
        return "soc " + " or ".join(cond)
    return f"{name} {cond}"


def explain(when: When | None, env: Env) -> str:
    """Why ``when`` does or does not apply in ``env``: the failed conditions if any, else the
    unknown ones, else the ones met (``"needs cann <8.0.0, found 8.0.0"``,
    ``"cann unknown (needed for cann >=8.0.0; set OPCONTRACTS_CANN_VERSION)"``)."""
    if when is None:
        return "no version conditions"
    failed, unknown, met = [], [], []
    for name, cond in _conditions(when):
        have = getattr(env, name)
        text = _cond_text(name, cond)
        if name == "soc":
            if not have:
                unknown.append(f"soc unknown (needed for {text}; set OPCONTRACTS_SOC)")
            elif soc_matches(have, cond):
                met.append(f"soc {have} is {' or '.join(cond)}")
            else:
                failed.append(f"needs {text}, found {have}")
            continue
        v = parse_version(have)
        shown = have if v is None or str(v) == have else f"{have} (= {v})"
        if v is None:
            var = ENV_VARS.get(name)
            what = "unknown" if not have else f"{have!r} is not a version"
            unknown.append(f"{name} {what} (needed for {text}" + (f"; set {var})" if var else ")"))
        elif satisfies(v, cond):
            # of alternatives ("a || b"), name the one that holds: the list can be long
            alt = next((a.strip() for a in cond.split("||") if satisfies(v, a.strip())), cond)
            met.append(f"{name} {shown} meets {alt}")
        else:
            failed.append(f"needs {text}, found {shown}")
    return "; ".join(failed or unknown or met) or "no version conditions"


# --------------------------------------------------------------------------- detection
_lock = threading.RLock()
_overrides: dict[str, str] = {}
_cache: tuple[Any, Any, Any, Env] | None = None


def _dist_version(*names: str) -> tuple[str, str] | None:
    for n in names:
        try:
            return metadata.version(n), f"package metadata ({n})"
        except metadata.PackageNotFoundError:
            continue
        except Exception:  # pragma: no cover - a broken dist-info must not break detection
            continue
    return None


def _module_version(modname: str, mod: Any, dists: tuple[str, ...]
                    ) -> tuple[str | None, str, bool] | None:
    """(version, origin, is_emulation) from a module already imported, else from metadata."""
    if mod is not None:
        emu = getattr(mod, "__opcontracts_emulation__", None)
        ver = getattr(mod, "__version__", None)
        ver = str(ver) if ver else None
        if emu:
            what = f" ({emu})" if isinstance(emu, str) else ""
            return ver, f"opcontracts emulation stand-in{what}: sys.modules[{modname!r}]", True
        if ver:
            return ver, f"{modname}.__version__ (already imported)", False
    found = _dist_version(*dists)
    if found is not None:
        return found[0], found[1], False
    return None


def _read_key(path: Path, keys: tuple[str, ...]) -> str | None:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()[:200]
    except OSError:
        return None
    values: dict[str, str] = {}
    for line in lines:
        k, sep, v = line.partition("=")
        if sep:
            values[k.strip().lower()] = v.strip()
    for key in keys:
        found = values.get(key, "").strip("[]")
        if found:
            # version.cfg: [7.5.0.1.129:8.0.RC3] -> the CANN version after the colon
            return found.rpartition(":")[2].strip() or None
    return None


def _cann_roots() -> list[tuple[Path, str]]:
    roots = []
    for var in CANN_ROOT_VARS:
        val = os.environ.get(var)
        if val:
            roots.append((Path(val), f"${var}"))
    roots += [(Path(p), p) for p in CANN_DEFAULT_ROOTS]
    return roots


def _install_info(root: Path, name: str) -> tuple[str, Path] | None:
    """(version, file) from ``root/<arch>-linux/<name>`` or ``root/<name>``."""
    try:
        if not root.is_dir():
            return None
        infos = sorted(root.glob(f"*-linux/{name}"))
        infos.append(root / name)
    except OSError:
        return None
    for info in infos:
        if info.is_file():
            v = _read_key(info, ("version",))
            if v:
                return v, info
    return None


def detect_cann_toolkit() -> tuple[str, str] | None:
    """(version, file it was read from) of the CANN toolkit, or ``None``."""
    for root, label in _cann_roots():
        found = _install_info(root, "ascend_toolkit_install.info")
        if found is not None:
            return found[0], f"{found[1]} (via {label})"
        cfg = root / "version.cfg"
        if cfg.is_file():
            v = _read_key(cfg, ("toolkit_running_version", "runtime_running_version"))
            if v:
                return v, f"{cfg} (via {label})"
    return None


def detect_cann_ops() -> tuple[str, str] | None:
    """(version, file) of the CANN ops package (the kernels: a package of its own from CANN
    8.5, ``ascend_ops_install.info``), or ``None``."""
    for root, label in _cann_roots():
        found = _install_info(root, "ascend_ops_install.info")
        if found is not None:
            return found[0], f"{found[1]} (via {label})"
    return None


def detect_cann() -> tuple[str, str] | None:
    """(version, where) of CANN as the kernels see it: the ops package's version when one is
    installed (the toolkit's beside it in ``where`` when they differ), else the toolkit's."""
    ops, toolkit = detect_cann_ops(), detect_cann_toolkit()
    if ops is None:
        return toolkit
    where = f"ops package: {ops[1]}"
    if toolkit is not None:
        same = "the same" if toolkit[0] == ops[0] else toolkit[0]
        where += f"; toolkit {same}: {toolkit[1]}"
    return ops[0], where


def detect_soc() -> tuple[str, str, bool] | None:
    """(name, origin, is_emulation) of the chip from a torch_npu already imported:
    ``torch_npu.npu.get_device_name()``, which reads the name without the device's lazy init
    (torch_npu 2.7.1 ... 2.14.0, ``torch_npu/npu/__init__.py``).  Never imports torch_npu or
    ``torch_npu.npu``, never calls ``get_soc_version()`` (it initialises the device)."""
    mod = sys.modules.get("torch_npu")
    get = getattr(getattr(mod, "npu", None), "get_device_name", None)
    if get is None:
        return None
    try:
        name = get()
    except Exception:  # noqa: BLE001 - no device visible, a driver error: the chip stays unknown
        return None
    if not isinstance(name, str) or not name.strip():
        return None
    if getattr(mod, "__opcontracts_emulation__", None):
        return name.strip(), "opcontracts emulation: torch_npu.npu.get_device_name()", True
    return name.strip(), "torch_npu.npu.get_device_name()", False


_EMULATED_ORIGIN = "opcontracts emulation"


def _emulated(name: str) -> tuple[str, str] | None:
    """(value, origin) of ``name`` (``cann``) as the emulation states it: the stand-in
    ``torch_npu``'s ``__opcontracts_stack__``, the stack the emulated kernels behave as.  On the
    emulation the kernels that run are the emulated ones, so their stack is the CANN that counts,
    before any toolkit files on the machine."""
    mod = sys.modules.get("torch_npu")
    if mod is None or not getattr(mod, "__opcontracts_emulation__", None):
        return None
    stack = getattr(mod, "__opcontracts_stack__", None)
    if not isinstance(stack, dict) or not stack.get(name):
        return None
    value = stack[name]
    profile = stack.get("profile")
    what = f" (profile {profile!r})" if profile else ""
    return str(value), f"{_EMULATED_ORIGIN}{what}: the stack its kernels behave as"


def _detect() -> Env:
    values: dict[str, str | None] = dict.fromkeys(FIELDS)
    origins: dict[str, str] = {}
    emulated: list[str] = []

    def put(name: str, value: str | None, origin: str) -> None:
        values[name] = value
        origins[name] = origin

    for name in FIELDS:
        if name in _overrides:
            ov = _overrides[name]
            put(name, None if ov.lower() == UNKNOWN else ov, "set_versions()")
            continue
        var = ENV_VARS.get(name)
        raw = os.environ.get(var, "").strip() if var else ""
        if raw:
            if raw.lower() == UNKNOWN:
                put(name, None, f"${var}")
            elif name != "soc" and normalize_version(raw) is None:
                # unreadable: unknown (every candidate applies, merged strictest), and said so
                put(name, None, f"${var} ({raw!r} is not a version: read as unknown)")
                from .envwarn import warn_setting

                warn_setting(str(var), f"{raw!r} is not a version (try '2.13.0' or '8.0.RC3'); "
                             "read as unknown, so every candidate contract applies, merged into "
                             "the strictest reading")
            else:
                put(name, raw, f"${var}")
            continue
        if name in ("torch_npu", "mindspeed"):
            dists = ("torch-npu", "torch_npu") if name == "torch_npu" else ("mindspeed",)
            found = _module_version(name, sys.modules.get(name), dists)
            if found is not None:
                put(name, found[0], found[1])
                if found[2]:
                    emulated.append(name)
        elif name == "cann":
            cann = _emulated("cann") or detect_cann()
            if cann is not None:
                put(name, cann[0], cann[1])
                if cann[1].startswith(_EMULATED_ORIGIN):
                    emulated.append(name)
        elif name == "torch":
            found = _module_version("torch", sys.modules.get("torch"), ("torch",))
            if found is not None:
                put(name, found[0], found[1])
        elif name == "soc":
            soc = detect_soc()
            if soc is not None:
                put(name, soc[0], soc[1])
                if soc[2]:
                    emulated.append(name)
    return Env(**values, origins=tuple(origins.items()), emulated=tuple(emulated))


def _fingerprint() -> tuple[Any, Any, Any]:
    m = sys.modules
    torch_npu = m.get("torch_npu")
    return torch_npu, m.get("mindspeed"), getattr(torch_npu, "npu", None)


def _invalidate_registry() -> None:
    # The registry imports this module, never the reverse: reach it only if it is loaded.
    reg = sys.modules.get("opcontracts._engine.registry")
    if reg is not None:
        reg.invalidate()


def current() -> Env:
    """The environment, detected on first use and cached.

    Re-detected (and the registry's resolutions dropped) when a different ``torch_npu`` or
    ``mindspeed`` module appears in ``sys.modules``, e.g. after ``emulation.install()``, or a
    different ``torch_npu.npu`` (the emulated device installed after ``import torch_npu``).
    """
    global _cache
    c = _cache
    if c is not None:
        m = sys.modules
        torch_npu = m.get("torch_npu")
        if torch_npu is c[0] and m.get("mindspeed") is c[1] \
                and getattr(torch_npu, "npu", None) is c[2]:  # the device module (the SoC)
            return c[3]
    with _lock:
        fp = _fingerprint()
        env = _detect()
        changed = c is not None and c[3] != env
        _cache = (*fp, env)
    if changed:
        _invalidate_registry()
    return env


def refresh() -> Env:
    """Forget the cached detection (re-reading environment variables and files) and drop the
    registry's resolutions."""
    global _cache
    with _lock:
        _cache = None
    _invalidate_registry()
    return current()


_KEEP: Any = object()


def _given(torch_npu: Any, cann: Any, mindspeed: Any, soc: Any, where: str) -> dict[str, str | None]:
    """The pins named (``_KEEP`` left out), validated: ``where`` names the call in errors."""
    given = {k: v for k, v in {"torch_npu": torch_npu, "cann": cann, "mindspeed": mindspeed,
                               "soc": soc}.items() if v is not _KEEP}
    for k, v in given.items():  # validate everything before changing anything
        if v is None:
            continue
        if not isinstance(v, str):
            raise TypeError(f"{where}({k}=...): expected a string or None, got {v!r}")
        text = v.strip()
        if not text or (k != "soc" and text.lower() != UNKNOWN
                        and normalize_version(text) is None):
            raise ValueError(f"{where}({k}={v!r}): not a version "
                             "(try '2.13.0', '8.0.RC3' or 'unknown')")
    return given


def _pin(given: dict[str, str | None]) -> dict[str, str | None]:
    with _lock:
        prev: dict[str, str | None] = {k: _overrides.get(k) for k in FIELDS if k in ENV_VARS}
        for k, v in given.items():
            if v is None:
                _overrides.pop(k, None)
            else:
                _overrides[k] = v.strip()
    refresh()
    return prev


def set_versions(*, torch_npu: str | None = _KEEP, cann: str | None = _KEEP,
                 mindspeed: str | None = _KEEP, soc: str | None = _KEEP) -> dict[str, str | None]:
    """Declare versions in code, over environment variables and detection.

    ``set_versions(cann="8.0.RC3")`` pins CANN; ``None`` removes a pin (back to detection);
    ``"unknown"`` forces unknown (every candidate contract applies, merged into the strictest).
    Arguments left out keep their pin.  Returns the previous pins of all four names, so
    ``prev = set_versions(...); ...; set_versions(**prev)`` restores them (``versions(...)``
    does that for a block or a function).  Without arguments it only re-detects (after
    changing ``os.environ`` in-process).

    Resolutions of contracts are recomputed on their next use, and every guard that follows
    the registry (the patch's, ``enforce("op")``) resolves again on its next call.
    """
    return _pin(_given(torch_npu, cann, mindspeed, soc, "set_versions"))


class versions(ContextDecorator):  # noqa: N801 - reads like opcontracts.mode
    """Pin versions for a block or a function and put the previous pins back after it:
    ``with opcontracts.versions(torch_npu="2.7.1", cann="8.0.RC3"): ...`` or
    ``@opcontracts.versions(soc="Ascend950PR")``.

    The arguments are ``set_versions``'s (validated here, so a bad version fails where it is
    written, not at the first call); on exit all four pins are what they were on entry, also
    after an exception.  Versions are the process's, not a thread's (guards resolve against
    one registry): entries nest, innermost first out, and a block in one thread pins them for
    every thread while it runs."""

    def __init__(self, *, torch_npu: str | None = _KEEP, cann: str | None = _KEEP,
                 mindspeed: str | None = _KEEP, soc: str | None = _KEEP) -> None:
        self._pins = _given(torch_npu, cann, mindspeed, soc, "opcontracts.versions")
        self._prev: list[dict[str, str | None]] = []  # per entry: one object may be re-entered

    def __enter__(self) -> versions:
        self._prev.append(_pin(self._pins))
        return self

    def __exit__(self, *exc: object) -> None:
        _pin(self._prev.pop())

    def _recreate_cm(self) -> versions:
        # a fresh instance per decorated call: concurrent calls never share the pins to restore
        new = type(self).__new__(type(self))
        new._pins, new._prev = self._pins, []
        return new

    def __repr__(self) -> str:
        pins = ", ".join(f"{k}={v!r}" for k, v in self._pins.items())
        return f"opcontracts.versions({pins})"


def rows(env: Env) -> list[tuple[str, str, str]]:
    """``(name, value, where it came from)`` per field, for display: the value with its PEP 440
    reading when that differs (``8.0.RC3 (= 8.0rc3)``), ``unknown`` with the variable to set."""
    out = []
    for name in FIELDS:
        v = getattr(env, name)
        origin = env.origin(name)
        if v is None:
            value = UNKNOWN
            var = ENV_VARS.get(name)
            if origin != UNKNOWN:
                origin = f"set to unknown by {origin}"
            elif name == "cann":
                origin = "no CANN toolkit found (" + ", ".join(
                    [f"${v}" for v in CANN_ROOT_VARS] + CANN_DEFAULT_ROOTS) + f"); set {var}"
            else:
                origin = "nothing found" + (f"; set {var}" if var else "")
        else:
            norm = parse_version(v) if name != "soc" else None
            value = v if norm is None or str(norm) == v else f"{v} (= {norm})"
        if name in env.emulated:
            origin += " [emulation, not the real package]"
        out.append((name, value, origin))
    return out


def describe(env: Env) -> dict[str, str]:
    """``{name: "value  [origin]"}`` for display (see ``rows``)."""
    return {name: f"{value}  [{origin}]" for name, value, origin in rows(env)}
