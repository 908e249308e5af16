"""The real-stack lane: ``opcontracts selftest``'s checks as tests, on a real torch_npu.

Skipped unless a real torch_npu is importable (an Ascend machine with CANN).  There, run
``python -m pytest tests/test_real_stack.py`` (or ``opcontracts selftest``): each check runs on
the NPU, with MindSpeed and torchair when they are importable.  On a CPU machine the same
checks run against the emulation in ``tests/test_selftest.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from opcontracts._tools import selftest as _selftest

pytestmark = pytest.mark.skipif(
    not _selftest._real_torch_npu_importable(),
    reason="needs a real torch_npu (an Ascend NPU machine with CANN); there run "
    "`python -m pytest tests/test_real_stack.py` or `opcontracts selftest`")


@pytest.fixture(scope="module")
def stack() -> Iterator[_selftest.Stack]:
    s = _selftest.open_stack()
    assert s.real
    try:
        yield s
    finally:
        _selftest.close_stack(s)


@pytest.mark.parametrize("check", _selftest.CHECKS, ids=lambda c: c.__name__)
def test_check_on_the_real_stack(stack: _selftest.Stack,
                                 check: Callable[[_selftest.Stack], _selftest.Result]) -> None:
    result = check(stack)
    if result.status == _selftest.SKIP:
        pytest.skip(result.detail)
    assert result.status == _selftest.PASS, f"{result.name}: {result.detail}"
