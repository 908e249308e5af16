"""The ``torch.npu`` / ``torch_npu.npu`` functions real scripts call beyond the device itself.

torch_npu's ``torch_npu/npu/__init__.py`` (with ``npu_config.py``, ``random.py``, ``memory.py``,
``utils.py``) gives the device module its configuration, random state, memory statistics,
compile mode and the CANN version; :func:`extend` puts the emulation's versions of them on the
emulated device module (``_device``), each behaving as it can on CPU memory:

* **random state**: npu ops draw from the CPU generator (``_device``), the kernels that draw
  their own bits (fusion attention's dropout) from the NPU generator's Philox seed and offset
  (``_philox``), so ``get_rng_state`` is the CPU generator's state followed by the Philox
  state's 16 bytes, and ``set_rng_state`` sets both (``seed`` and ``initial_seed`` are the
  CPU generator's; ``default_generators[i]``'s state is ``get_rng_state()``'s, as on torch_npu,
  the rest of it the CPU generator's): a state saved before an op and set again
  makes the op draw the same numbers (an activation checkpoint's recompute the same dropout
  mask), and ``torch.random.fork_rng(device_type="npu")`` works;
* **memory statistics**: npu tensors live in host memory, which no NPU allocator caches: the
  allocator statistics (``memory_allocated``, ``memory_reserved``, their peaks,
  ``memory_stats``) are 0 and resetting them, ``empty_cache``, is a no-op; ``mem_get_info`` and
  ``get_device_properties().total_memory`` are the host's memory;
* **configuration**: ``config.allow_internal_format``, ``matmul.allow_hf32``,
  ``set_compile_mode``, ``set_option`` are recorded (the emulated kernels have one format and
  one precision);
* **the CANN version** (``torch_npu.npu.utils.get_cann_version``): the version opcontracts
  detects for the stack (``set_versions(cann=...)``, ``$OPCONTRACTS_CANN``), else the one the
  active emulation profile states, else :data:`EMULATED_CANN`.

Streams, events and graphs are ``_npu_streams``.  ``torch.npu.amp`` / autocast are not here.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import types
from typing import Any

import torch

from . import _npu_streams, _philox

__all__ = ["EMULATED_CANN", "cann_version", "extend", "is_gte_cann_version", "utils_names"]

EMULATED_CANN = "8.0.RC3"
"""The CANN the emulated kernels behave as when neither the user nor the profile says: the
default profile's MoE token kernels are CANN 8.0.RC3's (``_profiles``)."""

_CANN_MODULES = ("CANN", "RUNTIME", "COMPILER", "HCCL", "TOOLKIT", "OPP", "OPP_KERNEL", "DRIVER")

_settings: dict[str, Any] = {"jit_compile": False, "options": {}, "mm_bmm_nd": True}


def cann_version(module: str = "CANN") -> str:
    """What ``torch_npu.npu.utils.get_cann_version(module)`` returns on the emulation."""
    if module not in _CANN_MODULES:
        raise RuntimeError(f"torch_npu.npu.utils.get_cann_version: module {module!r} is not one "
                           f"of {', '.join(_CANN_MODULES)}")
    versions = sys.modules.get("opcontracts._lang.versions")  # never imported from here
    detected = versions.current().cann if versions is not None else None
    if detected:
        return str(detected)
    from . import _profiles

    stated = getattr(_profiles.active(), "cann", None)
    return str(stated) if stated else EMULATED_CANN


_CANN_RE = re.compile(r"^(\d+(?:\.\d+)*)(?:[.\-_]?(rc|alpha|beta)[.\-_]?(\d+))?"
                      r"(?:[.\-_]?(alpha|beta|b)[.\-_]?(\d+))?$", re.IGNORECASE)
_STAGE = {"alpha": 0, "beta": 1, "rc": 2, None: 3}


def _cann_key(text: str) -> tuple[int, ...] | None:
    """An order for CANN versions: ``8.0.RC3`` < ``8.0.0`` < ``8.1.RC1``; a build tag after a
    release candidate (``8.0.RC2.alpha003``) sorts before it."""
    m = _CANN_RE.match(text.strip())
    if m is None:
        return None
    release = tuple(int(p) for p in m.group(1).split("."))
    release = (release + (0, 0, 0))[:3]
    stage = _STAGE[m.group(2).lower() if m.group(2) else None]
    build = (0, int(m.group(5))) if m.group(4) else (1, 0)
    return (*release, stage, int(m.group(3) or 0), *build)


def is_gte_cann_version(version: str, module: str = "CANN") -> bool:
    """``torch_npu.npu.utils._is_gte_cann_version``: the CANN version is ``version`` or later."""
    wanted = _cann_key(version)
    if wanted is None:
        raise RuntimeError(f"torch_npu.npu.utils._is_gte_cann_version: cannot read the version "
                           f"{version!r} (expected e.g. '8.0.RC3' or '8.1.0')")
    current = _cann_key(cann_version(module))
    return current is not None and current >= wanted


# -- configuration ----------------------------------------------------------------------------

class _NpuConfig:
    """``torch.npu.config``: ``allow_internal_format`` (private formats such as NZ; the
    emulation keeps the format an explicit ``npu_format_cast`` gives, ``_formats``, whatever
    is set, and stores every format's values as ND)."""

    allow_internal_format = False


class _AllowHF32:
    """``torch.npu.matmul`` / ``torch.npu.conv``: ``allow_hf32`` (the emulation computes in
    the tensors' own precision)."""

    def __init__(self, default: bool) -> None:
        self.allow_hf32 = default


def set_compile_mode(jit_compile: bool = False) -> None:
    _settings["jit_compile"] = bool(jit_compile)


def is_jit_compile_false() -> bool:
    return not _settings["jit_compile"]


def set_option(option: dict[str, Any]) -> None:
    if not isinstance(option, dict):
        raise TypeError("npu option must be a dict.")
    _settings["options"].update({str(k): str(v) for k, v in option.items()})


def set_aoe(dump_path: str) -> None:
    os.makedirs(dump_path, exist_ok=True)


def set_mm_bmm_format_nd(is_nd: bool = True) -> None:
    _settings["mm_bmm_nd"] = bool(is_nd)


def get_mm_bmm_format_nd() -> bool:
    return bool(_settings["mm_bmm_nd"])


# -- random state (the CPU generator, which npu ops draw from, and the Philox state) ---------

def get_rng_state(device: Any = "npu") -> torch.Tensor:
    """The CPU generator's state followed by the NPU generator's 16 bytes (``_philox``)."""
    philox = torch.frombuffer(bytearray(_philox.get_state()), dtype=torch.uint8)
    return torch.cat([torch.get_rng_state(), philox])


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    """A state of :func:`get_rng_state`; a CPU generator's state alone sets the CPU generator,
    a real torch_npu state (16 or 8 bytes: seed and offset) the Philox state alone."""
    state = new_state.cpu() if isinstance(new_state, torch.Tensor) else torch.as_tensor(new_state)
    state = state.contiguous().view(torch.uint8).reshape(-1)
    n = state.numel()
    if n in (8, _philox.STATE_BYTES):
        _philox.set_state(bytes(state.tolist()))
        return
    cpu_size = torch.get_rng_state().numel()
    if n == cpu_size + _philox.STATE_BYTES:
        torch.set_rng_state(state[:cpu_size].clone())
        _philox.set_state(bytes(state[cpu_size:].tolist()))
        return
    torch.set_rng_state(state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state_all(new_states: Any) -> None:
    for state in new_states:
        set_rng_state(state)


def seed() -> None:
    torch.seed()


def seed_all() -> None:
    torch.seed()


def initial_seed() -> int:
    return int(torch.initial_seed())


# -- memory (host memory; no caching allocator) -----------------------------------------------

def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of the host's physical memory."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0, 0


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return _host_memory()


def memory_allocated(device: Any = None) -> int:
    return 0


def max_memory_allocated(device: Any = None) -> int:
    return 0


def memory_reserved(device: Any = None) -> int:
    return 0


def max_memory_reserved(device: Any = None) -> int:
    return 0


def memory_cached(device: Any = None) -> int:
    return 0


def max_memory_cached(device: Any = None) -> int:
    return 0


def reset_peak_memory_stats(device: Any = None) -> None:
    return None


def reset_max_memory_allocated(device: Any = None) -> None:
    return None


def reset_max_memory_cached(device: Any = None) -> None:
    return None


def reset_accumulated_memory_stats(device: Any = None) -> None:
    return None


def empty_cache() -> None:
    return None


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    if not 0 <= float(fraction) <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")


def memory_stats(device: Any = None) -> collections.OrderedDict[str, int]:
    keys = [f"{stat}.{pool}.{kind}"
            for stat in ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                         "allocation", "segment", "active", "inactive_split")
            for pool in ("all", "small_pool", "large_pool")
            for kind in ("current", "peak", "allocated", "freed")]
    keys += ["num_alloc_retries", "num_ooms"]
    return collections.OrderedDict((k, 0) for k in sorted(keys))


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    return ("opcontracts emulated npu: tensors live in host memory; no NPU caching allocator "
            "(every statistic is 0)\n")


class _DeviceProperties:
    """What ``torch.npu.get_device_properties`` returns (the emulated SoC's name, the host's
    memory)."""

    def __init__(self, name: str, total_memory: int) -> None:
        self.name = name
        self.total_memory = total_memory
        self.cube_core_num = 1
        self.vector_core_num = 1
        self.L2_cache_size = 0

    def __repr__(self) -> str:
        return (f"_NPUDeviceProperties(name='{self.name}', total_memory="
                f"{self.total_memory // (1024 * 1024)}MB, cube_core_num={self.cube_core_num}, "
                f"vector_core_num={self.vector_core_num}, L2_cache_size="
                f"{self.L2_cache_size // (1024 * 1024)}MB)")


def is_bf16_supported(including_emulation: bool = False) -> bool:
    return True


def is_support_inf_nan() -> bool:
    return True


def utils_names() -> tuple[str, ...]:
    """The names ``torch_npu.npu.utils`` has (taken from the device module)."""
    return ("synchronize", "set_device", "current_device", "device", "device_of",
            "StreamContext", "stream", "set_stream", "current_stream", "default_stream",
            "is_support_inf_nan", "is_bf16_supported", "get_cann_version", "empty_cache")


_FUNCTIONS = (
    set_compile_mode, is_jit_compile_false, set_option, set_aoe, set_mm_bmm_format_nd,
    get_mm_bmm_format_nd,
    get_rng_state, set_rng_state, get_rng_state_all, set_rng_state_all, seed, seed_all,
    initial_seed,
    mem_get_info, memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved,
    memory_cached, max_memory_cached, reset_peak_memory_stats, reset_max_memory_allocated,
    reset_max_memory_cached, reset_accumulated_memory_stats, empty_cache,
    set_per_process_memory_fraction, memory_stats, memory_summary,
    is_bf16_supported, is_support_inf_nan,
)


class _NpuGenerator:
    """``torch.npu.default_generators[i]`` as torch_npu has it: its state is ``get_rng_state()``'s
    (the CPU generator's, which npu ops draw from, and the Philox seed and offset), so a state
    taken with one and set with the other round-trips (Megatron's ``_set_cuda_rng_state`` sets
    ``torch.cuda.get_rng_state()``'s through ``default_generators[idx].set_state``).  Anything
    else is the CPU generator's."""

    def __init__(self, mod: types.ModuleType, index: int) -> None:
        self._mod = mod
        self.device = torch.device("npu", index)

    def get_state(self) -> torch.Tensor:
        return get_rng_state()

    def set_state(self, new_state: torch.Tensor) -> _NpuGenerator:
        set_rng_state(new_state)
        return self

    def manual_seed(self, seed: int) -> _NpuGenerator:
        self._mod.manual_seed(int(seed))
        return self

    def seed(self) -> int:
        seed()
        return initial_seed()

    def initial_seed(self) -> int:
        return initial_seed()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.default_generator, name)


class _DefaultGenerators:
    """One generator per emulated device (``len`` is the device count)."""

    def __init__(self, mod: types.ModuleType) -> None:
        self._mod = mod

    def __len__(self) -> int:
        return max(1, int(self._mod.device_count()))

    def __getitem__(self, index: int) -> _NpuGenerator:
        if not -len(self) <= index < len(self):
            raise IndexError(f"default_generators: device {index} of {len(self)}")
        return _NpuGenerator(self._mod, index % len(self))

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))


def extend(mod: types.ModuleType) -> None:
    """Put the API above, the streams, events and graphs (``_npu_streams``) on the device
    module ``mod``; names the device module already has are kept.  ``mod`` becomes a package
    (``import torch_npu.npu.utils`` finds its submodules through the stand-in finder)."""

    def put(name: str, value: Any) -> None:
        if name not in mod.__dict__:
            setattr(mod, name, value)

    for fn in _FUNCTIONS:
        fn.__module__ = mod.__name__
        put(fn.__name__, fn)

    def get_device_properties(device: Any = None) -> _DeviceProperties:
        return _DeviceProperties(mod.get_device_name(device), _host_memory()[1])

    def get_cann_version(module: str = "CANN") -> str:
        return cann_version(module)

    put("get_device_properties", get_device_properties)
    put("get_cann_version", get_cann_version)
    put("config", _NpuConfig())
    put("matmul", _AllowHF32(False))
    put("conv", _AllowHF32(True))
    put("default_generators", _DefaultGenerators(mod))
    for name, value in _npu_streams.api(mod).items():
        put(name, value)
    put("__path__", [])  # a package: torch_npu.npu.utils and the like are submodules

    def __getattr__(name: str) -> Any:  # torch_npu.npu.utils without importing it first
        if name == "utils":
            import importlib

            return importlib.import_module(f"{mod.__name__}.utils")
        raise AttributeError(f"module {mod.__name__!r} has no attribute {name!r}")

    put("__getattr__", __getattr__)
    public = sorted(n for n, v in mod.__dict__.items()
                    if not n.startswith("_") and (callable(v) or n in ("config", "matmul", "conv")))
    put("__all__", public)
