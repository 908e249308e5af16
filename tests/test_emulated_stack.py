"""One consistent stack: each emulation profile states the torch_npu / CANN / SoC its kernels
behave as, the detected versions say so while the emulation is installed, and strict mode
rejects what the emulated kernels would misread.  A user's ``set_versions``, environment
variables and declared targets still decide."""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import opcontracts
from opcontracts import emulation
from opcontracts._lang import versions
from opcontracts.emulation import _profiles
from opcontracts.errors import ContractViolation

BF16, FP16, FP32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32


@pytest.fixture
def targets_dropped() -> Iterator[None]:
    prev = opcontracts.set_targets()
    try:
        yield
    finally:
        opcontracts.set_targets(*prev)


def _permuted(npu: types.ModuleType, dtype: torch.dtype = BF16
              ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(4, 8, generator=g).to(dtype)
    indices = torch.randint(0, 4, (4, 2), generator=g).to(torch.int64)
    with opcontracts.mode("off"):
        return npu.npu_moe_token_permute(tokens, indices)  # type: ignore[no-any-return]


def test_each_named_profile_states_its_stack() -> None:
    assert set(_profiles.STACKS) == set(_profiles.PROFILES)
    for name, stack in _profiles.STACKS.items():
        assert stack.torch_npu == emulation._install.DEFAULT_TORCH_NPU_VERSION, name
        assert stack.soc == emulation.DEFAULT_SOC, name
        assert stack.why, name
    assert _profiles.resolve("narrow").stack is _profiles.STACKS["narrow"]
    assert _profiles.resolve({"npu_swiglu": {"self": ["bf16"]}}).stack is None


def test_detected_versions_are_the_profiles_stack(npu: types.ModuleType) -> None:
    env = versions.current()
    assert (env.torch_npu, env.cann) == ("2.13.0", "8.0.RC3")
    assert "cann" in env.emulated and "profile 'narrow'" in env.origin("cann")
    # the SoC is the npu device's: without the device it stays unknown (SoC-scoped rules apply)
    assert env.soc is None
    emulation.install("wide")  # a profile switch keeps the torch_npu module: re-detected
    assert versions.current().cann == "9.1.0"
    emulation.install({"npu_swiglu": {"self": ["bf16"]}})  # a custom profile states no CANN
    assert versions.current().cann is None


def test_strict_rejects_fp32_probs_into_unpermute_under_the_default_profile(
        npu: types.ModuleType, targets_dropped: None) -> None:
    permuted, sorted_indices = _permuted(npu)
    probs = torch.rand(4, 2)  # fp32: the narrow kernel reads its bytes as bf16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a conditional warning: the stack is known
        with opcontracts.mode("strict"), pytest.raises(ContractViolation) as info:
            npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    assert info.value.arg == "probs"
    with opcontracts.mode("off"):  # unguarded, the emulated kernel misreads it
        wrong = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
        right = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs.to(BF16))
    assert not torch.allclose(wrong.float(), right.float(), atol=1e-2, equal_nan=False)


def test_set_versions_still_decides(npu: types.ModuleType, targets_dropped: None) -> None:
    permuted, sorted_indices = _permuted(npu)
    opcontracts.set_versions(cann="8.5.0")
    assert versions.current().origin("cann") == "set_versions()"
    with opcontracts.mode("strict"):
        npu.npu_moe_token_unpermute(permuted, sorted_indices, torch.rand(4, 2))


def test_environment_variable_still_decides(npu: types.ModuleType, targets_dropped: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPCONTRACTS_CANN_VERSION", "9.0.0")
    opcontracts.set_versions()  # re-read the environment
    try:
        assert versions.current().cann == "9.0.0"
    finally:
        monkeypatch.delenv("OPCONTRACTS_CANN_VERSION")
        opcontracts.set_versions()
    assert versions.current().cann == "8.0.RC3"


def test_declared_targets_still_decide(npu: types.ModuleType, targets_dropped: None) -> None:
    permuted, sorted_indices = _permuted(npu)
    opcontracts.set_targets(cann="9.1.0")
    with opcontracts.mode("strict"):
        npu.npu_moe_token_unpermute(permuted, sorted_indices, torch.rand(4, 2))


def _misreads(profile: _profiles.Profile, kernels: tuple[str, ...], arg: str,
              dtype: torch.dtype) -> bool:
    for kernel in kernels:
        supported = profile.supported(kernel, arg)
        if supported is not None and dtype not in supported:
            return True
    return False


@pytest.mark.parametrize("profile", sorted(_profiles.PROFILES))
@pytest.mark.parametrize("dtype", [FP16, FP32])
def test_strict_rejects_every_dtype_a_profiles_token_kernels_misread(
        emulated: Any, targets_dropped: None, profile: str, dtype: torch.dtype) -> None:
    """For the MoE token ops, a probs or token dtype the forward or its backward kernel would
    misread under the profile is rejected by strict mode under the stack the profile states."""
    emulated(profile)
    import torch_npu

    resolved = _profiles.resolve(profile)
    permuted, sorted_indices = _permuted(torch_npu)
    calls: dict[tuple[tuple[str, ...], str], Any] = {
        (("npu_moe_token_unpermute", "npu_moe_token_unpermute_grad"), "probs"):
            lambda: torch_npu.npu_moe_token_unpermute(permuted, sorted_indices,
                                                      torch.rand(4, 2).to(dtype)),
        (("npu_moe_token_unpermute", "npu_moe_token_unpermute_grad"), "permuted_tokens"):
            lambda: torch_npu.npu_moe_token_unpermute(permuted.to(dtype), sorted_indices,
                                                      torch.rand(4, 2).to(BF16)),
        (("npu_moe_token_permute",), "tokens"):
            lambda: torch_npu.npu_moe_token_permute(torch.randn(4, 8).to(dtype),
                                                    torch.zeros(4, 2, dtype=torch.int64)),
    }
    for (kernels, arg), call in calls.items():
        if not _misreads(resolved, kernels, arg, dtype):
            continue
        with opcontracts.mode("strict"), pytest.raises(ContractViolation):
            call()


def test_the_device_reports_the_profiles_soc(emulated: Any) -> None:
    emulated("narrow", device=True)
    import torch_npu  # noqa: F401  (detection reads the modules already imported)

    env = versions.current()
    assert (env.cann, env.soc) == ("8.0.RC3", _profiles.STACKS["narrow"].soc)
