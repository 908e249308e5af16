"""The README and docs/ say what is true: every link to a page or file of the repository exists,
and every ```console block's commands print what the block shows.

A console block holds commands (lines starting with ``$ ``, run from the repository root;
``opcontracts`` is the CLI, run as ``python -m opcontracts``) each followed by the exact lines
it prints (stdout and stderr together, trailing spaces ignored); a line ``...`` alone stands for
any number of lines, and a line ending in `` ...`` for any line that begins with the text before
it (what varies from one machine to another: a path, a version, a loss).  Only commands of a few
seconds whose output is the same on every machine belong there (```bash / ```text for the
rest)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```(\w*)\s*$")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _links() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for m in _LINK.finditer(page.read_text(encoding="utf-8")):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # https://..., mailto:, an anchor in the same page
            out.append((_rel(page), target))
    return out


def _console_blocks() -> list[tuple[str, list[str]]]:
    """(``file:line``, the block's lines) of every ```console block."""
    blocks = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = _FENCE.match(lines[i])
            if m is None:
                i += 1
                continue
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if m.group(1) == "console":
                blocks.append((f"{_rel(page)}:{i + 1}", lines[i + 1:j]))
            i = j + 1
    return blocks


def _commands(block: list[str]) -> list[tuple[str, list[str]]]:
    """The block as (command, expected output lines)."""
    out: list[tuple[str, list[str]]] = []
    for line in block:
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif not out:
            raise ValueError(f"output before the first command: {line!r}")
        else:
            out[-1][1].append(line.rstrip())
    return out


def _line(expected: str, got: str) -> bool:
    if expected.endswith(" ...") and expected.strip() != "...":
        return got.startswith(expected[:-3])
    return expected == got


def matches(expected: list[str], got: list[str]) -> bool:
    """Whether ``got`` is ``expected``, each ``...`` line standing for any number of lines and
    each line ending in `` ...`` for one line that begins with the text before it."""
    memo: dict[tuple[int, int], bool] = {}

    def at(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(expected):
                r = j == len(got)
            elif expected[i] == "...":
                r = at(i + 1, j) or (j < len(got) and at(i, j + 1))
            else:
                r = j < len(got) and _line(expected[i], got[j]) and at(i + 1, j + 1)
            memo[(i, j)] = r
        return memo[(i, j)]

    return at(0, 0)


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)
    if argv[0] == "opcontracts":
        return [sys.executable, "-m", "opcontracts", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return argv


def test_matcher() -> None:
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert matches(["a", "...", "d"], ["a", "d"])
    assert not matches(["a", "...", "d"], ["a", "b", "c"])
    assert not matches(["a", "b"], ["a", "b", "c"])
    assert matches(["..."], [])
    assert matches(["loss ...", "b"], ["loss 0.25", "b"])
    assert matches(["loss ..."], ["loss ..."])
    assert not matches(["loss ..."], ["grad 0.25"])
    assert not matches(["loss ..."], ["loss 1", "loss 2"])  # one line, not several
    assert not matches(["a ... b"], ["a x b"])  # only at the end of a line


def test_pages_exist() -> None:
    assert (ROOT / "docs" / "architecture.md").is_file()
    assert len(PAGES) > 2


@pytest.mark.parametrize(("page", "target"), _links(), ids=lambda v: str(v))
def test_link_exists(page: str, target: str) -> None:
    path = (ROOT / page).parent / target.split("#", 1)[0]
    assert path.exists(), f"{page} links to {target}, which does not exist"


def test_readme_gives_the_ci_test_command() -> None:
    """CI runs "the exact test command the README gives"."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "\npython -m pytest -q\n" in readme
    assert "\npython -m pytest -q\n" in ci


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


@pytest.mark.parametrize(("where", "block"), _console_blocks(), ids=lambda v: v if isinstance(v, str) else "")
def test_console_block(where: str, block: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPCONTRACTS_")}
    env["COLUMNS"] = "100"  # argparse's help width
    for command, expected in _commands(block):
        proc = subprocess.run(_argv(command), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=120)
        got = [ln.rstrip() for ln in proc.stdout.splitlines()]
        assert matches(expected, got), (
            f"{where}: `{command}` printed (exit {proc.returncode}):\n" + "\n".join(got))
