"""Reading torch_npu wheels as zip files: a ``.whl``, a folder of them, or an unpacked tree.

Nothing here imports torch_npu (it cannot be imported without CANN) or torch: the five files
the wheel tools need are read as bytes, with the version from the wheel's ``METADATA`` (or
``torch_npu/version.py`` in an unpacked tree without a ``dist-info``).
"""

from __future__ import annotations

import ast
import hashlib
import re
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["WheelFiles", "WheelReadError", "PATHS", "read_wheels", "read_one", "file_id",
           "parse_source"]

PATHS: dict[str, str] = {
    "schema": "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
    "docs": "torch_npu/_op_plugin_docs.py",
    "meta": "torch_npu/op_plugin/meta/_meta_registrations.py",
    "bindings": "torch_npu/utils/custom_ops.py",
    "autograd": "torch_npu/include/torch_npu/csrc/aten/Functions.h",
}
"""The files read from each wheel, by role (the same paths in every release 2.5.1 .. 2.14.0)."""


class WheelReadError(ValueError):
    """A path that is not a torch_npu wheel, a folder of them or an unpacked tree."""


@dataclass(frozen=True)
class WheelFiles:
    """The files of one torch_npu release that the wheel tools read."""

    version: str
    origin: str
    files: dict[str, bytes] = field(repr=False)
    """role (``schema``, ``docs``, ``meta``, ``bindings``, ``autograd``) -> contents; a missing
    file is absent"""
    torch: str | None = None
    """the torch release the wheel pins (``Requires-Dist: torch==2.14.0.*`` -> ``2.14.0``)"""

    def text(self, role: str) -> str | None:
        data = self.files.get(role)
        return None if data is None else data.decode("utf-8", errors="replace")


def file_id(data: bytes) -> str:
    """A short content address: versions whose file has the same id ship it byte-identical."""
    return hashlib.sha256(data).hexdigest()[:12]


_VERSION_RE = re.compile(r"^Version:\s*(\S+)", re.MULTILINE)
_TORCH_RE = re.compile(r"^Requires-Dist:\s*torch\s*==\s*([0-9][0-9a-zA-Z.]*?)(?:\.\*)?\s*$",
                       re.MULTILINE)
_PYVER_RE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def _from_metadata(text: str, origin: str) -> tuple[str, str | None]:
    from packaging.version import InvalidVersion, Version

    m = _VERSION_RE.search(text)
    if m is None:
        raise WheelReadError(f"{origin}: METADATA has no 'Version:' line")
    try:
        Version(m.group(1))
    except InvalidVersion:
        raise WheelReadError(f"{origin}: METADATA's 'Version: {m.group(1)}' is not a version "
                             "(PEP 440)") from None
    t = _TORCH_RE.search(text)
    return m.group(1), (t.group(1) if t else None)


def _read_zip(path: Path) -> WheelFiles:
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise WheelReadError(f"{path}: not a readable wheel (zip file): {exc}") from None
    with zf:
        names = set(zf.namelist())
        metas = sorted(n for n in names if re.fullmatch(r"torch_npu-[^/]+\.dist-info/METADATA", n))
        if not metas:
            raise WheelReadError(f"{path}: no torch_npu-*.dist-info/METADATA inside: "
                                 "not a torch_npu wheel")
        try:
            version, torch = _from_metadata(zf.read(metas[0]).decode("utf-8", "replace"),
                                            str(path))
            files = {role: zf.read(p) for role, p in PATHS.items() if p in names}
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError) as exc:
            raise WheelReadError(f"{path}: a member cannot be read (a damaged download? "
                                 f"fetch it again): {exc}") from None
    return WheelFiles(version, str(path), files, torch)


def _read_tree(root: Path) -> WheelFiles:
    metas = sorted(root.glob("torch_npu-*.dist-info/METADATA"))
    if metas:
        version, torch = _from_metadata(metas[0].read_text("utf-8", "replace"), str(metas[0]))
    else:
        vfile = root / "torch_npu" / "version.py"
        m = _PYVER_RE.search(vfile.read_text("utf-8", "replace")) if vfile.is_file() else None
        if m is None:
            raise WheelReadError(f"{root}: an unpacked torch_npu tree needs a "
                                 "torch_npu-*.dist-info/METADATA or torch_npu/version.py")
        version, torch = m.group(1), None
    try:
        files = {role: (root / p).read_bytes() for role, p in PATHS.items()
                 if (root / p).is_file()}
    except OSError as exc:
        raise WheelReadError(f"{root}: cannot read {exc.filename}: {exc.strerror}") from None
    return WheelFiles(version, str(root), files, torch)


def read_one(path: str | Path) -> WheelFiles:
    """One release: a ``.whl`` file or an unpacked tree (the folder holding ``torch_npu/``)."""
    p = Path(path)
    if p.is_file():
        return _read_zip(p)
    if p.is_dir() and (p / "torch_npu").is_dir():
        return _read_tree(p)
    raise WheelReadError(f"{p}: not a .whl file or an unpacked tree (no torch_npu/ folder)")


def _expand(path: Path) -> Iterator[Path]:
    if path.is_dir() and not (path / "torch_npu").is_dir():
        found = sorted(path.glob("torch_npu-*.whl"))
        if not found:
            raise WheelReadError(f"{path}: no torch_npu-*.whl in this folder (download them with "
                                 "`pip download --no-deps --only-binary=:all: --python-version "
                                 "3.11 --platform manylinux_2_28_x86_64 --platform "
                                 f"manylinux2014_x86_64 -d {path} torch-npu==VERSION`)")
        yield from found
    elif path.exists():
        yield path
    else:
        raise WheelReadError(f"{path}: no such file or folder")


def read_wheels(paths: Iterable[str | Path]) -> list[WheelFiles]:
    """Every release under ``paths`` (wheels, folders of wheels, unpacked trees), sorted by
    version; a version given twice is read once (the first path wins)."""
    from packaging.version import Version

    out: dict[str, WheelFiles] = {}
    for raw in paths:
        for p in _expand(Path(raw)):
            w = read_one(p)
            out.setdefault(w.version, w)
    return sorted(out.values(), key=lambda w: Version(w.version))


def parse_source(source: str) -> ast.Module:
    """``ast.parse`` without the warnings the wheels' files raise (their docstrings hold
    invalid escapes such as ``\\_``, a DeprecationWarning or SyntaxWarning per occurrence)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.parse(source)
