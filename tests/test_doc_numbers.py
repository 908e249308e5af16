"""The numbers the README and docs/ state about the package come from the package.

How many ops and contracts are shipped, how many torch_npu releases the digest holds, what
``opcontracts list --coverage`` finds on the newest one, the real-code corpus: each is a FACT
computed here, and every sentence that states one is a SPOT, a regular expression whose named
groups are the facts it states (``ops``, or ``ops__2`` for a second mention in one pattern).
When the package changes (a contract added, a release digested), rewrite them all:

    python tests/test_doc_numbers.py           # what would change
    python tests/test_doc_numbers.py --write   # change it

A sentence reworded so that its pattern no longer matches fails here with the pattern to
update.  Command samples are ```console blocks (``tests/test_docs.py`` runs them); timings in
the docs are measurements, dated by their page, never held here.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:  # test_realcode, run as a script or by pytest
    sys.path.insert(0, str(ROOT / "tests"))


# --------------------------------------------------------------------------- the facts
@functools.cache
def _shipped() -> tuple[int, set[str]]:
    from opcontracts._engine.registry import shipped_contracts_dir
    from opcontracts.spec import load_contracts

    contracts = load_contracts(shipped_contracts_dir())
    return len(contracts), {c.op for c in contracts}


@functools.cache
def _coverage() -> dict[str, int]:
    from opcontracts._engine.registry import shipped_contracts_dir
    from opcontracts.spec import load_contracts
    from opcontracts.wheel import coverage, digest

    d = digest.load()
    cov = coverage.coverage(d.release(d.versions[-1]), load_contracts(shipped_contracts_dir()))
    documented = [o for o in cov.ops if o in cov.documented]
    return {"ops": len(cov.ops), "guarded": len(cov.covered), "documented": len(documented),
            "documented_guarded": sum(1 for o in documented if o in cov.covered)}


@functools.cache
def _corpus() -> tuple[int, int, int]:
    """(production call sites, bug reports, bugs caught): a bug case is caught unless it says
    why not (``missed``), which test_realcode holds case by case."""
    from test_realcode import load_corpus

    cases = load_corpus()
    bugs = [c for c in cases if c.kind == "bug"]
    return (sum(1 for c in cases if c.kind == "call"), len(bugs),
            sum(1 for c in bugs if c.missed is None))


def _digest_versions() -> list[str]:
    from opcontracts.wheel import digest

    return list(digest.load().versions)


def _pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.0f}%" if b else "0%"


FACTS: dict[str, Callable[[], str]] = {
    "contracts": lambda: str(_shipped()[0]),
    "ops": lambda: str(len(_shipped()[1])),
    "torch_npu_ops": lambda: str(sum(1 for o in _shipped()[1] if "." not in o)),
    "other_ops": lambda: str(sum(1 for o in _shipped()[1]
                                 if o.startswith(("fla_npu.", "atb.")))),
    "mindspeed_ops": lambda: str(sum(1 for o in _shipped()[1] if o.startswith("mindspeed."))),
    "releases": lambda: str(len(_digest_versions())),
    "newest": lambda: _digest_versions()[-1],
    "cov_ops": lambda: str(_coverage()["ops"]),
    "cov_guarded": lambda: str(_coverage()["guarded"]),
    "cov_share": lambda: _pct(_coverage()["guarded"], _coverage()["ops"]),
    "cov_documented": lambda: str(_coverage()["documented"]),
    "cov_documented_guarded": lambda: str(_coverage()["documented_guarded"]),
    "corpus_calls": lambda: str(_corpus()[0]),
    "corpus_bugs": lambda: str(_corpus()[1]),
    "corpus_caught": lambda: str(_corpus()[2]),
    "corpus_share": lambda: _pct(_corpus()[2], _corpus()[1]),
}


def fact(name: str) -> str:
    return FACTS[name.split("__", 1)[0]]()


# --------------------------------------------------------------------------- where they are stated
@dataclass(frozen=True)
class Spot:
    file: str
    pattern: str
    times: int = 1
    """how many times the pattern matches in the file"""

    @property
    def regex(self) -> re.Pattern[str]:
        """The pattern, each space in it standing for any run of white space (a sentence may
        wrap)."""
        return re.compile(self.pattern.replace(" ", r"\s+"))


N = r"\d+"
VERSION = r"\d+\.\d+\.\d+(?:\.post\d+)?"
SPOTS = [
    Spot("README.md", rf"Shipped contracts for (?P<ops>{N}) ops\*\*: (?P<contracts>{N}) "
                      rf"contracts, for (?P<torch_npu_ops>{N}) torch_npu ops, "
                      rf"(?P<mindspeed_ops>{N}) MindSpeed paths and (?P<other_ops>{N}) of "
                      rf"fla_npu's and ATB's"),
    Spot("README.md", rf"checked against the (?P<releases>{N}) torch_npu releases on PyPI"),
    Spot("README.md", rf"judged by (?P<corpus_calls>{N}) production call sites and "
                      rf"(?P<corpus_bugs>{N}) bug reports[^:]*: 0 false alarms, "
                      rf"(?P<corpus_caught>{N}) bugs caught"),
    Spot("docs/shipped-ops.md",
         rf"(?P<ops>{N}) ops \((?P<contracts>{N}) contracts\): (?P<torch_npu_ops>{N}) torch_npu "
         rf"ops, (?P<mindspeed_ops>{N}) MindSpeed paths and (?P<other_ops>{N}) of fla_npu's and "
         rf"ATB's"),
    Spot("docs/shipped-ops.md",
         rf"torch_npu (?P<newest>{VERSION}) has (?P<cov_ops>{N}) public `torch\.ops\.npu` ops, "
         rf"(?P<cov_documented>{N}) of them documented; (?P<cov_guarded>{N}) have a contract "
         rf"for it \((?P<cov_share>{N}%), (?P<cov_documented_guarded>{N}) of the "
         rf"(?P<cov_documented__2>{N}) documented\)"),
    Spot("docs/shipped-ops.md", rf"verifies clean against the (?P<releases>{N}) torch_npu"),
    Spot("docs/wheels.md", rf"all (?P<releases>{N}) releases on PyPI"),
    Spot("docs/real-stack.md", rf"\((?P<releases>{N}) releases' schemas\)"),
    Spot("docs/real-code.md", rf"\| \*\*total\*\* \| \| \*\*(?P<corpus_calls>{N})\*\* \| "
                              rf"\*\*(?P<corpus_bugs>{N})\*\* \|"),
    Spot("docs/real-code.md", rf"real-code corpus: (?P<corpus_calls>{N}) call sites, 0 false "
                              rf"alarms; (?P<corpus_caught>{N}) of (?P<corpus_bugs>{N}) reported "
                              rf"bugs caught \((?P<corpus_share>{N}%)\)"),
    Spot("docs/real-code.md", rf"\| reported bugs caught \| [^|]+\| \*\*(?P<corpus_caught>{N}) "
                              rf"of (?P<corpus_bugs>{N}) \((?P<corpus_share>{N}%)\)\*\* \|"),
]


@dataclass(frozen=True)
class Wrong:
    file: str
    line: int
    fact: str
    stated: str
    true: str


def wrong(spot: Spot, text: str) -> list[Wrong]:
    """The numbers ``text`` states at ``spot`` that are not the facts; AssertionError when the
    pattern does not match ``spot.times`` times."""
    found = list(spot.regex.finditer(text))
    assert len(found) == spot.times, (
        f"{spot.file}: the pattern of a stated number matches {len(found)} time(s), not "
        f"{spot.times}: a sentence was reworded or removed? Update SPOTS in "
        f"tests/test_doc_numbers.py to match it (or drop the entry):\n  {spot.pattern}")
    out = []
    for m in found:
        for name, value in m.groupdict().items():
            if value != fact(name):
                out.append(Wrong(spot.file, text.count("\n", 0, m.start(name)) + 1,
                                 name.split("__", 1)[0], value, fact(name)))
    return out


def rewrite(spot: Spot, text: str) -> str:
    """``text`` with every number at ``spot`` set to its fact."""
    def put(m: re.Match[str]) -> str:
        s, base = m.group(0), m.start(0)
        for name in sorted(m.groupdict(), key=m.start, reverse=True):
            a, b = m.start(name) - base, m.end(name) - base
            s = s[:a] + fact(name) + s[b:]
        return s

    return spot.regex.sub(put, text)


# --------------------------------------------------------------------------- the tests
def _text(file: str) -> str:
    return (ROOT / file).read_text(encoding="utf-8")


def test_every_fact_is_stated_somewhere() -> None:
    used = {n.split("__", 1)[0] for s in SPOTS for n in s.regex.groupindex}
    assert used == set(FACTS), set(FACTS) ^ used


def test_the_facts_are_what_the_commands_print() -> None:
    """``opcontracts list`` counts the same ops and contracts; ``list --coverage`` the same
    figure (its first two lines, rendered by the command's own code)."""
    from opcontracts._engine.registry import shipped_contracts_dir
    from opcontracts.spec import load_contracts
    from opcontracts.wheel import coverage, digest

    d = digest.load()
    shown = coverage.render(coverage.coverage(d.release(fact("newest")),
                                              load_contracts(shipped_contracts_dir())))
    assert (f"torch_npu {fact('newest')}: {fact('cov_ops')} torch.ops.npu ops" in shown
            and f", {fact('cov_documented')} documented\n" in shown), shown
    assert (f"with a contract for this release: {fact('cov_guarded')} ({fact('cov_share')}; "
            f"{fact('cov_documented_guarded')} of the {fact('cov_documented')} documented)"
            in shown), shown
    from opcontracts._engine import registry

    assert len(registry.shipped_index()) == int(fact("contracts"))
    assert len({e.op for e in registry.shipped_index()}) == int(fact("ops"))


def test_each_stated_number_is_the_package_s() -> None:
    problems = [w for s in SPOTS for w in wrong(s, _text(s.file))]
    assert not problems, (
        "numbers in the docs that are not the package's; `python tests/test_doc_numbers.py "
        "--write` rewrites them:\n" + "\n".join(
            f"  {w.file}:{w.line}: {w.fact} is {w.true}, the page says {w.stated}"
            for w in problems))


def test_a_changed_number_is_caught_and_rewritten() -> None:
    spot = SPOTS[0]
    text = _text(spot.file)
    m = spot.regex.search(text)
    assert m is not None
    stale = str(int(fact("ops")) - 8)
    edited = text[:m.start("ops")] + stale + text[m.end("ops"):]
    got = wrong(spot, edited)
    assert [(w.fact, w.stated, w.true) for w in got] == [("ops", stale, fact("ops"))]
    assert rewrite(spot, edited) == text
    reworded = edited.replace("Shipped contracts for", "Contracts shipped for")
    try:
        wrong(spot, reworded)
    except AssertionError as exc:
        assert "reworded or removed" in str(exc)
    else:
        raise AssertionError("a reworded sentence went unnoticed")


# --------------------------------------------------------------------------- the generator
def main(argv: list[str]) -> int:
    write = "--write" in argv
    changed = 0
    for file in dict.fromkeys(s.file for s in SPOTS):
        text = _text(file)
        new = text
        for spot in (s for s in SPOTS if s.file == file):
            try:
                found = wrong(spot, new)
            except AssertionError as exc:
                print(exc)
                return 1
            for w in found:
                print(f"{w.file}:{w.line}: {w.fact}: {w.stated} -> {w.true}")
                changed += 1
            new = rewrite(spot, new)
        if write and new != text:
            (ROOT / file).write_text(new, encoding="utf-8")
    if not changed:
        print("the docs state the package's numbers")
    elif not write:
        print("(--write rewrites them)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
