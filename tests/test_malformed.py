"""Bad input never kills a job: a seeded generator of malformed contract files.

Every generated file is malformed by construction (a wrong type or value in one field or in
several, bad shape and version strings, junk bytes, truncated text, deep nesting, huge
expressions).  Each must give ``ContractFileError`` naming the file (never another exception,
never the loader's safety net), and the same files through ``OPCONTRACTS_CONTRACTS`` must
leave ``import opcontracts.patch`` alive with one warning per file.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from opcontracts import ContractFileError, load_contracts

SEED = 13
BASE_ARG = 'dtype = "bf16"\nshape = "N K"\n'

# TOML values of every kind, to be put where they do not belong
DATE, TIME, DATETIME = "1979-05-27", "07:32:00", "1979-05-27T07:32:00Z"
TABLE, EMPTY_LIST = "{x = 1}", "[]"

# field -> values that are wrong for it (each alone makes a file malformed)
ARG_BAD: dict[str, list[str]] = {
    "dtype": ["5", "2.5", "true", DATE, TIME, '"bf17"', EMPTY_LIST, '["bf16", 3]', TABLE,
              '[["bf16"]]', '"torch.bfloat17"', "nan"],
    "shape": ["5", "true", DATE, '"N (K"', '"N//0"', '"0*D"', '"N**2"', EMPTY_LIST, '["N", 5]',
              TABLE, '"... N ..."', '"N ..."', '"_N"', '"N None"', '"N/2"', '"2-5"', '"f(N)"',
              '["N K", "A B"]', '"N*(K-K+0)*0"', '"1e3"', '"N K ²"'],
    "rank": ["2.5", '"two"', "true", "-1", EMPTY_LIST, '[1, "a"]', TABLE, DATE, "[-1]", "inf"],
    "same_dtype_as": ["5", "true", '"zz"', EMPTY_LIST, TABLE, '"x"'],
    "same_dtype_except": ["true", "5", '"bf16"', "{bf16 = 5}", '{bf17 = ["fp32"]}',
                          '{bf16 = ["fp33"]}', "{bf16 = [[1]]}"],
    "same_shape_as": ["5", '"zz"', "true", TABLE],
    "optional": ["1", '"yes"', "2.5", DATE, EMPTY_LIST, "0"],
    "fix": ['"always"', "5", "true", '["cast"]'],
    "contiguous": ["1", '"yes"', TABLE],
    "list": ['"yes"', "1", "[true]"],
    "max_len": ["-1", "0", '"3"', "2.5", "true", "4"],
    "ge": ["2.5", "true", '"N N"', '"_"', '"..."', "[1]", DATE, TABLE, '"N//0"', "nan"],
    "le": ["2.5", "false", '"N N"', '"N**2"', "[1]", TIME],
    "lt": ["inf", '"_"', "[[1]]", DATETIME],
    "allowed": [f"[{DATE}]", "[[1]]", "[{x = 1}]", EMPTY_LIST, DATE, TABLE],
    "values": ["5", '"yes"', '{permutation = "yes"}', "{lt = 2.5}", "{colour = 1}",
               "{sum = true}", '{last = "N N"}', "{finite = 1}"],
    "dims": ["5", "{N = 5}", "{N = {le = -1}}", "{N = {}}", "{N = {le = true}}",
             "{Q = {le = 4}}", "{N = {ge = 8, le = 4}}", "{N = {lt = 0}}", "{N = {lte = 4}}"],
    "numel_lt": ["-3", "0", '"5"', "2.5", "true"],
    "int_list": ['"yes"', "1"],
    "source": ["5", "true", "[1]", DATE, TABLE],
    "hint": ["5", "[1]"],
    "doc": ["5", TIME],
    "doc_conflict": ["false", "[1]"],
    "colour": ['"red"', "1"],   # unknown fields
    "shpe": ['"N"'],
}
CONTRACT_BAD: dict[str, list[str]] = {
    "op": ["5", "true", '""', '"   "', EMPTY_LIST, DATE],
    "targets": ["3", "true", '["not a path"]', "[5]", '"nodot"', TABLE, DATE, '["a..b"]'],
    "source": ["5", "[1]", TABLE],
    "doc": ["5", "[1]"],
    "when": ["5", '"x"', '{cann = "newest"}', "{colour = 1}", "{soc = 5}", '{torch = ">=a.b"}',
             "{torch_npu = true}", f"{{cann = {DATE}}}", '{mindspeed = "=>1"}', "{soc = [5]}"],
    "signature": ["5", '"ab"', '["a", "a"]', '["from"]', "[5]", EMPTY_LIST, '["a", "_oc_x"]',
                  '["a", "b c"]'],
    "same_device": ["1", '"yes"'],
    "colour": ["1"],
}
VERSION_JUNK = ["newest", ">>1", "=>8", "~1", ">=a.b", "abc", "inf", "True", "8", "latest!",
                ">= 8.0.0 or 9", "8.0.RC3 +"]
ARG_NAMES_BAD = ["from", "lambda", "None", "class", "_oc_x", '"a b"', '"1x"', '"x-y"']


def _file(arg_lines: str = BASE_ARG, top: str = "", arg: str = "a") -> str:
    return f'[[contract]]\nop = "x"\n{top}[contract.args.{arg}]\n{arg_lines}'


def _huge(rng: random.Random) -> str:
    n = rng.choice([40, 200, 1500, 5000])
    op = rng.choice(["+", "*", " + ", "-"])
    return op.join(rng.choice(["N", "K", "2", "H"]) for _ in range(n))


def _junk(rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:  # random bytes with at least one byte that is not UTF-8
        data = bytearray(rng.randbytes(rng.randrange(1, 300)))
        data.insert(rng.randrange(len(data) + 1), 0xFF)
        return bytes(data)
    if kind == 1:  # printable noise after a key: never a TOML value
        noise = "".join(rng.choice("=[]{}\"'#., \tabcXYZ019") for _ in range(rng.randrange(1, 80)))
        return f'[[contract]]\nop = "x"\nkey = ={noise}\n'.encode()
    if kind == 2:  # a control character inside a string
        return f'[[contract]]\nop = "x{chr(rng.randrange(0, 9))}"\n'.encode()
    if kind == 3:  # a good file cut right after an opening quote
        good = _file()
        quotes = [i for i, ch in enumerate(good) if ch == '"']
        return good[: quotes[rng.randrange(0, len(quotes), 2)] + 1].encode()
    return b"[[contract]\n" + rng.randbytes(rng.randrange(0, 50)).replace(b"]", b"")


def _deep(rng: random.Random) -> str:
    depth = rng.choice([20, 100, 400, 1000, 3000, 10000])
    if rng.random() < 0.5:
        field = rng.choice(["dtype", "shape", "rank", "allowed", "doc", "ge", "dims", "values"])
        return _file(BASE_ARG + f"{field} = " + "[" * depth + "1" + "]" * depth + "\n")
    field = rng.choice(["values", "dims", "same_dtype_except", "shape"])
    return _file(BASE_ARG + f"{field} = " + "{a = " * depth + "1" + "}" * depth + "\n")


def generate(seed: int = SEED) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of malformed contract files, deterministic for a seed."""
    rng = random.Random(seed)
    n = 0

    def name(kind: str) -> str:
        nonlocal n
        n += 1
        return f"{n:04d}_{kind}.toml"

    # every wrong value of every field, alone
    for field, values in ARG_BAD.items():
        for v in values:
            base = BASE_ARG if field not in ("dtype", "shape") else \
                "\n".join(line for line in BASE_ARG.splitlines() if not line.startswith(field)) + "\n"
            yield name(f"arg_{field}"), _file(base + f"{field} = {v}\n").encode()
    for field, values in CONTRACT_BAD.items():
        for v in values:
            if field == "op":
                text = f"[[contract]]\nop = {v}\n[contract.args.a]\n{BASE_ARG}"
            else:
                text = _file(top=f"{field} = {v}\n")
            yield name(f"contract_{field}"), text.encode()
    for bad in ARG_NAMES_BAD:
        yield name("argname"), _file(arg=bad).encode()
    for text in ("contract = 5\n", 'contract = "x"\n', "contract = [5]\n", "x = 1\n",
                 '[[contracts]]\nop = "x"\n', "[[contract]]\n", '[[contract]]\nop = "x"\n',
                 '[[contract]]\nop = "x"\nargs = 5\n', '[[contract]]\nop = "x"\nargs = []\n',
                 '[[contract]]\nop = "x"\nargs = {a = 5}\n', "[contract]\nop = 1\n"):
        yield name("toplevel"), text.encode()
    # bad version strings, random combinations of several wrong fields, junk, nesting, size
    for _ in range(60):
        key = rng.choice(["torch_npu", "cann", "mindspeed", "torch"])
        junk = rng.choice(VERSION_JUNK)
        yield name("version"), _file(top=f'when = {{{key} = "{junk}"}}\n').encode()
    for _ in range(150):
        fields = rng.sample(sorted(ARG_BAD), rng.randrange(2, 5))
        lines = "".join(f"{f} = {rng.choice(ARG_BAD[f])}\n" for f in fields)
        top = ""
        if rng.random() < 0.5:
            f = rng.choice(sorted(set(CONTRACT_BAD) - {"op"}))
            top = f"{f} = {rng.choice(CONTRACT_BAD[f])}\n"
        # no duplicate keys among dtype/shape: the base lines go when the field is drawn
        base = "".join(line + "\n" for line in BASE_ARG.splitlines()
                       if line.split(" = ")[0] not in fields)
        good = rng.random() < 0.5  # a good contract next to the bad one in the same file
        extra = '[[contract]]\nop = "fine"\n[contract.args.t]\ndtype = "bf16"\n' if good else ""
        yield name("combo"), (_file(base + lines, top) + extra).encode()
    for _ in range(80):
        yield name("junk"), _junk(rng)
    for _ in range(50):
        yield name("deep"), _deep(rng).encode()
    for _ in range(40):
        field = rng.choice(["shape", "ge", "le", "lt"])
        expr = _huge(rng)
        body = BASE_ARG.replace('shape = "N K"\n', "") if field == "shape" else BASE_ARG
        yield name("huge"), _file(body + f'{field} = "{expr}"\n').encode()
    for _ in range(10):  # many dimensions
        dims = " ".join(rng.choice(["N", "K", "_", "8"]) for _ in range(rng.randrange(65, 3000)))
        yield name("rank"), _file(f'dtype = "bf16"\nshape = "{dims}"\n').encode()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("malformed")
    for fname, data in generate():
        (folder / fname).write_bytes(data)
    return folder


def test_the_generator_is_seeded_and_large():
    files = list(generate())
    assert len(files) >= 500
    assert files == list(generate())
    assert len({data for _, data in files}) > 480  # mostly distinct


def test_every_malformed_file_gives_a_contract_file_error_naming_it(corpus: Path):
    wrong: list[str] = []
    for f in sorted(corpus.iterdir()):
        try:
            load_contracts(f)
        except ContractFileError as exc:
            text = str(exc)
            if exc.file != str(f) or str(f) not in text or any(p.file != str(f) for p in getattr(exc, "problems", ())):
                wrong.append(f"{f.name}: does not name the file: {text[:200]}")
            elif "bug in opcontracts" in text or "pydantic.dev" in text:
                wrong.append(f"{f.name}: {text[:300]}")
            elif len(text) > 8000:
                wrong.append(f"{f.name}: a {len(text)}-character message")
        except BaseException as exc:  # noqa: BLE001 - exactly what this test is about
            wrong.append(f"{f.name}: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            wrong.append(f"{f.name}: loaded without an error: {f.read_bytes()[:200]!r}")
    assert not wrong, "\n".join(wrong)


def test_a_folder_of_them_is_one_error_listing_every_file(corpus: Path):
    with pytest.raises(ContractFileError) as ei:
        load_contracts(corpus)
    assert {p.file for p in ei.value.problems} == {str(f) for f in corpus.iterdir()}


def test_through_the_environment_every_file_is_skipped_with_a_warning(corpus: Path, monkeypatch):
    from opcontracts._attach.use import env_contracts as _user_contracts
    from opcontracts._lang import envwarn

    good = corpus.parent / "good_contracts"
    good.mkdir(exist_ok=True)
    (good / "ok.toml").write_text('[[contract]]\nop = "fuzz_ok"\n[contract.args.a]\ndtype = "bf16"\n')
    monkeypatch.setenv("OPCONTRACTS_CONTRACTS",
                       os.pathsep.join([str(corpus), str(good), str(corpus / "missing.toml")]))
    envwarn.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = _user_contracts()
    assert [c.op for c in loaded] == ["fuzz_ok"]  # the good folder still loads
    messages = [str(w.message) for w in caught]
    assert all(w.category is RuntimeWarning for w in caught)
    assert all(m.startswith("OPCONTRACTS_CONTRACTS: ") and m.endswith("; skipped") for m in messages)
    assert all(w.filename == __file__ for w in caught)  # the user's line, not opcontracts'
    files = sorted(corpus.glob("*.toml"))
    assert len(messages) == len(files) + 1
    for f, m in zip(files, messages):
        assert m.startswith(f"OPCONTRACTS_CONTRACTS: {f}")
    assert "missing.toml: no such file or folder" in messages[-1]
    with warnings.catch_warnings(record=True) as again:  # shown once per process
        warnings.simplefilter("always")
        _user_contracts()
    assert again == []


def test_import_opcontracts_patch_stays_alive_in_a_real_process(corpus: Path, tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text("import opcontracts.patch\nprint('alive', opcontracts.patch.is_applied())\n")
    env = {**os.environ, "OPCONTRACTS_CONTRACTS": str(corpus)}
    env.pop("OPCONTRACTS_MODE", None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "alive True"
    n_files = len(list(corpus.glob("*.toml")))
    assert out.stderr.count(f"{script}:1: RuntimeWarning: OPCONTRACTS_CONTRACTS: ") == n_files
    assert "Traceback" not in out.stderr
