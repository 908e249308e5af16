"""What opcontracts guards of one torch_npu release: ``opcontracts list --coverage SOURCE``.

The figure users ask for ("what does it guard?"): of the release's ``torch.ops.npu`` ops (the
schema file's ``custom`` section), which have a contract that speaks for this release, which
have a contract only for other releases, which are documented (``_op_plugin_docs.py``) but have
none, and which are not documented at all.  Internal ops (a leading ``_``: workspace queries,
infer-output helpers) are counted apart.

A contract covers an op when its ``op`` is the op's name or one of its targets is
``torch.ops.npu.<op>`` or ``torch_npu.<op>``; it speaks for the release when its ``when`` holds
(or may hold: CANN, SoC unknown) for that torch_npu version.

``SOURCE`` is a torch_npu wheel, an unpacked tree, a digest file (``FILE.json.gz[@VERSION]``)
or a version of the shipped digest (``2.14.0``); see ``digest.resolve_release``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..spec import Contract
    from .digest import Release

__all__ = ["Coverage", "coverage", "render"]


@dataclass
class Coverage:
    version: str
    ops: list[str]                                       # public torch.ops.npu ops
    internal: list[str]                                  # a leading underscore
    documented: set[str]
    covered: dict[str, list[str]] = field(default_factory=dict)        # op -> contract ops
    other_versions: dict[str, list[str]] = field(default_factory=dict)  # contracts, not here

    @property
    def uncovered_documented(self) -> list[str]:
        return [o for o in self.ops if o not in self.covered and o in self.documented]

    @property
    def uncovered_undocumented(self) -> list[str]:
        return [o for o in self.ops if o not in self.covered and o not in self.documented]

    def to_json(self) -> dict[str, Any]:
        return {
            "torch_npu": self.version,
            "ops": len(self.ops), "internal_ops": len(self.internal),
            "documented": len([o for o in self.ops if o in self.documented]),
            "covered": {o: self.covered[o] for o in self.ops if o in self.covered},
            "covered_for_other_versions_only": {o: v for o, v in self.other_versions.items()
                                                if o not in self.covered},
            "documented_uncovered": self.uncovered_documented,
            "undocumented_uncovered": self.uncovered_undocumented,
        }


def _ops_of(c: Contract) -> set[str]:
    out = {c.op}
    for t in c.targets:
        for prefix in ("torch.ops.npu.", "torch_npu."):
            if t.startswith(prefix) and "." not in t[len(prefix):]:
                out.add(t[len(prefix):])
    return out


def coverage(release: Release, contracts: Iterable[Contract]) -> Coverage:
    """Which of ``release``'s ops ``contracts`` cover (see the module docstring)."""
    from .._lang.versions import Env, applies

    names = sorted(release.schemas)
    cov = Coverage(release.version, [n for n in names if not n.startswith("_")],
                   [n for n in names if n.startswith("_")], set(release.docs))
    env = Env(torch_npu=release.version)
    public = set(cov.ops)
    for c in contracts:
        here = applies(c.when, env) is not False
        for op in _ops_of(c) & public:
            into = cov.covered if here else cov.other_versions
            into.setdefault(op, [])
            if c.op not in into[op]:
                into[op].append(c.op)
    return cov


def _columns(names: Sequence[str], width: int = 96) -> list[str]:
    lines, cur = [], "  "
    for n in names:
        if len(cur) + len(n) + 2 > width and cur.strip():
            lines.append(cur.rstrip())
            cur = "  "
        cur += n + "  "
    if cur.strip():
        lines.append(cur.rstrip())
    return lines


def render(cov: Coverage, *, verbose: bool = False) -> str:
    """The coverage as text: the figure first, then the lists."""
    n = len(cov.ops)
    doc = sum(1 for o in cov.ops if o in cov.documented)
    covered = [o for o in cov.ops if o in cov.covered]
    cov_doc = sum(1 for o in covered if o in cov.documented)
    pct = (100.0 * len(covered) / n) if n else 0.0
    lines = [
        f"torch_npu {cov.version}: {n} torch.ops.npu ops ({len(cov.internal)} internal ones "
        f"with a leading '_' not counted), {doc} documented",
        f"  with a contract for this release: {len(covered)} ({pct:.0f}%; {cov_doc} of the "
        f"{doc} documented)",
        f"  documented, no contract:          {len(cov.uncovered_documented)}",
        f"  undocumented, no contract:        {len(cov.uncovered_undocumented)}",
    ]
    other = [o for o in cov.other_versions if o not in cov.covered]
    if other:
        lines.append(f"  a contract only for other releases: {len(other)} ({', '.join(other)})")
    lines += ["", f"guarded ({len(covered)}; a contract under another name in brackets):"]
    lines += _columns([o + (f" [{', '.join(n for n in cov.covered[o] if n != o)}]"
                            if any(n != o for n in cov.covered[o]) else "") for o in covered])
    lines += ["", f"documented, no contract ({len(cov.uncovered_documented)}):"]
    lines += _columns(cov.uncovered_documented)
    if verbose:
        lines += ["", f"undocumented, no contract ({len(cov.uncovered_undocumented)}):"]
        lines += _columns(cov.uncovered_undocumented)
    else:
        lines += ["", "(-v lists the undocumented ops too; `opcontracts wheel draft` drafts "
                  "contracts for the documented ones)"]
    return "\n".join(lines)
