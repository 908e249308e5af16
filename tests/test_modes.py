"""Modes: strict / warn / fix / off, contexts, threads, asyncio, per-op overrides, env."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import opcontracts
from opcontracts import Arg, Contract, ContractViolation, ContractWarning

C = Contract("probs_op", {"tokens": Arg("bf16", "N H"), "probs": Arg("bf16", "N K")},
             source="test source")
calls: list[str] = []


@opcontracts.enforce(C)
def op(tokens, probs):
    calls.append(probs.dtype)
    return tokens.float().sum() + probs.float().sum()


def good():
    return torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(4, 2, dtype=torch.bfloat16)


def bad():
    return torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(4, 2, dtype=torch.float32)


def test_default_mode_is_warn():
    code = "import opcontracts; print(opcontracts.get_mode())"
    env = {k: v for k, v in os.environ.items() if k != "OPCONTRACTS_MODE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "warn"


def test_env_var_sets_mode_and_a_bad_value_stops_the_start_up():
    # a CI typo must not silently weaken checking: OPCONTRACTS_MODE=loud used to fall back to
    # warn with a warning at an internal line; now the start-up of a job fails, naming the
    # variable: the patch's import, a decorated function's definition, get_mode()
    code = "import opcontracts; print(opcontracts.get_mode())"
    env = {**os.environ, "OPCONTRACTS_MODE": "strict"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "strict"
    decorated = ("import opcontracts\n@opcontracts.enforce(opcontracts.Contract('o', "
                 "{'x': opcontracts.Arg('bf16')}))\ndef f(x): return x\n")
    for line in (code, "import opcontracts.patch", decorated):
        env["OPCONTRACTS_MODE"] = "loud"
        out = subprocess.run([sys.executable, "-c", line], env=env, capture_output=True, text=True)
        assert out.returncode == 1 and out.stdout == ""
        assert ("opcontracts.errors.SettingError: OPCONTRACTS_MODE: unknown mode 'loud'; "
                "expected one of strict, warn, fix, off") in out.stderr


def test_set_mode_returns_previous_and_validates():
    assert opcontracts.set_mode("strict") == "warn"
    assert opcontracts.get_mode() == "strict"
    assert opcontracts.set_mode("off") == "strict"
    with pytest.raises(ValueError, match="unknown mode"):
        opcontracts.set_mode("loud")
    with pytest.raises(opcontracts.OpContractsError, match="unknown mode"):
        opcontracts.mode("loud")


def test_strict_raises_before_the_call():
    calls.clear()
    with opcontracts.mode("strict"), pytest.raises(ContractViolation):
        op(*bad())
    assert calls == []


def test_warn_warns_once_per_call_site_and_calls_original():
    calls.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("default")
        for _ in range(3):
            op(*bad())  # one call site
        op(*bad())  # another call site
    assert len(calls) == 4
    cw = [x for x in w if issubclass(x.category, ContractWarning)]
    assert len(cw) == 2
    assert cw[0].filename == __file__
    assert "probs" in str(cw[0].message)
    rep = opcontracts.report()
    assert sum(r.count for r in rep.records) == 4 and len(rep.records) == 2


def test_warning_filter_error_raises_every_time():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContractWarning)
        for _ in range(2):
            with pytest.raises(ContractWarning):
                op(*bad())


def test_off_never_calls_the_checker():
    hits = []
    c = Contract("spy", {"x": Arg("bf16")})

    @opcontracts.enforce(c)
    def f(x):
        return x

    real = f.__opcontracts__.check

    def spy(*a, **k):
        hits.append(1)
        return real(*a, **k)

    # rebuild a guard around a spying checker
    from opcontracts._engine.enforce import make_guard

    f.__opcontracts__.check = spy
    g = make_guard(f.__wrapped__, f.__opcontracts__)
    with opcontracts.mode("off"):
        g(torch.ones(1))
    assert hits == []
    g(torch.ones(1))
    assert hits == [1]


def test_mode_is_a_decorator_and_nests():
    @opcontracts.mode("strict")
    def run():
        with opcontracts.mode("off"):
            op(*bad())
            assert opcontracts.get_mode() == "off"
        assert opcontracts.get_mode() == "strict"
        op(*bad())

    with pytest.raises(ContractViolation):
        run()
    assert opcontracts.get_mode() == "warn"


def test_set_mode_inside_context_is_local_to_it():
    with opcontracts.mode("strict"):
        assert opcontracts.set_mode("off") == "strict"
        assert opcontracts.get_mode() == "off"
    assert opcontracts.get_mode() == "warn"


def test_per_op_override():
    assert opcontracts.set_mode("strict", op="probs_op") == "warn"
    assert opcontracts.get_mode(op="probs_op") == "strict"
    assert opcontracts.get_mode() == "warn"
    with pytest.raises(ContractViolation):
        op(*bad())
    with opcontracts.mode("off"):  # a block without op= wins over overrides
        op(*bad())
    with opcontracts.mode("fix", op="probs_op"):
        op(*bad())


def test_threads_have_independent_contexts():
    barrier = threading.Barrier(4)
    seen: dict[str, object] = {}

    def worker(m: str) -> None:
        with opcontracts.mode(m):
            barrier.wait()
            try:
                op(*bad())
                seen[m] = "ok"
            except ContractViolation:
                seen[m] = "raised"
            barrier.wait()
            seen[m + "_mode"] = opcontracts.get_mode()

    ts = [threading.Thread(target=worker, args=(m,)) for m in ("strict", "off", "fix", "warn")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for th in ts:
            th.start()
        for th in ts:
            th.join()
    assert seen["strict"] == "raised"
    assert seen["off"] == seen["fix"] == seen["warn"] == "ok"
    assert all(seen[m + "_mode"] == m for m in ("strict", "off", "fix", "warn"))
    assert opcontracts.get_mode() == "warn"


def test_global_set_mode_reaches_new_threads():
    opcontracts.set_mode("strict")
    out = []
    th = threading.Thread(target=lambda: out.append(opcontracts.get_mode()))
    th.start()
    th.join()
    assert out == ["strict"]


def test_asyncio_tasks_are_isolated():
    async def task(m: str, delay: float) -> str:
        with opcontracts.mode(m):
            await asyncio.sleep(delay)
            return opcontracts.get_mode()

    @opcontracts.mode("strict")
    async def decorated() -> str:
        await asyncio.sleep(0.01)
        return opcontracts.get_mode()

    async def main():
        return await asyncio.gather(task("off", 0.02), task("fix", 0.01), decorated())

    assert asyncio.run(main()) == ["off", "fix", "strict"]


def test_one_mode_object_entered_by_two_overlapping_tasks():
    # the first task to leave used to raise "Token ... was created in a different Context":
    # the object's token stack was thread-local, and both tasks run on one thread
    shared = opcontracts.mode("strict")
    order: list[str] = []

    async def task(name: str, delay: float) -> str:
        with shared:
            order.append(f"enter {name}")
            await asyncio.sleep(delay)
            seen = opcontracts.get_mode()
        order.append(f"leave {name}")
        return f"{seen} then {opcontracts.get_mode()}"

    async def main() -> list[str]:
        with opcontracts.mode("fix"):
            return await asyncio.gather(task("a", 0.01), task("b", 0.05))

    assert asyncio.run(main()) == ["strict then fix", "strict then fix"]
    assert order == ["enter a", "enter b", "leave a", "leave b"]
    assert opcontracts.get_mode() == "warn"
    with shared:  # still usable, and nests with itself
        with shared:
            assert opcontracts.get_mode() == "strict"
    assert opcontracts.get_mode() == "warn"
