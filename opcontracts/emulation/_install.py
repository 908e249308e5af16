"""install() / uninstall(): the emulation's lifecycle, and the refusal to shadow a real torch_npu."""

from __future__ import annotations

import importlib.util
import sys
import threading

from torch.library import Library

from . import _device, _ops, _profiles, _transfer
from ._jit import arm_library, disarm_library, install_compiler, set_line, uninstall_compiler
from ._standins import MODULE_NAMES, StandinFinder, is_standin

__all__ = ["current_profile", "install", "installed", "installed_release", "uninstall"]

DEFAULT_TORCH_NPU_VERSION = "2.13.0"
DEFAULT_MINDSPEED_VERSION = "0.8.0"

_lock = threading.RLock()
_lib: Library | None = None
_finder: StandinFinder | None = None
_release: str | None = None  # the torch_npu release whose structure the ops have


def _real_torch_npu() -> str | None:
    """Why a real torch_npu is present (without importing it), or None."""
    module = sys.modules.get("torch_npu")
    if module is not None and not is_standin(module):
        return f"sys.modules['torch_npu'] is {module!r}"
    if module is None:
        try:
            spec = importlib.util.find_spec("torch_npu")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and not (_finder is not None and _finder.owns(spec)):
            return f"torch_npu is importable from {spec.origin or spec.name}"
    return None


def install(
    profile: str | _profiles.ProfileSpec | _profiles.Profile = "narrow",
    *,
    version: str | None = None,
    mindspeed_version: str = DEFAULT_MINDSPEED_VERSION,
    device: bool | str = False,
    mindspeed_line: str = "core_r0.8.0",
) -> None:
    """Register the emulated ``torch.ops.npu`` ops and the stand-in modules.

    ``profile`` is a name from ``PROFILES`` or a mapping of the same structure.  A named
    profile behaves as one stack (``_profiles.STACKS``: torch_npu, CANN, SoC), and while the
    emulation is installed the detected versions say so (``opcontracts env``: CANN and
    the SoC from the stand-in ``torch_npu``), so strict mode judges calls on the stack whose
    kernels run; ``set_versions``, ``OPCONTRACTS_*_VERSION`` and declared targets still win.
    A custom mapping states no CANN (unknown).  ``version`` is
    the torch_npu release to emulate (default: the profile's, ``2.13.0``): its structure (``_release``: which MoE token ops are
    autograd-only over an internal ``_npu_*`` op, which grad ops their backward calls, with the
    release's schemas) and the version the stand-in reports; a release the wheel digest does
    not know is a ValueError naming the known ones. ``mindspeed_line`` is the MindSpeed line the
    stand-ins behave as (``_jit.MINDSPEED_LINES``): MindSpeed's unpermute / permute (and gmm,
    rope) are JIT-built extensions calling the CANN kernels directly, never torch_npu's ops
    (``_jit``); ``"master"`` runs MindSpeed's own bf16 ``TORCH_CHECK``s in unpermute / permute,
    forward and backward (a RuntimeError, as MindSpeed raises); ``"core_r0.8.0"`` (the
    DeepSeek-V3 line, default) has none (ranks only, and an fp32 cast when probs is fp32), so a
    wrong dtype reaches the kernel. The stand-in MindSpeed owns ``Library("mindspeed",
    "DEF")`` (defined at its first use, so a real MindSpeed on ``sys.path`` defines its own):
    ``torch.ops.mindspeed.npu_gmm`` is defined on it when ``mindspeed.ops.gmm`` is imported (as
    MindSpeed's ``GMMOpBuilder`` does) and is gone after ``uninstall()``.
    Installing again switches the profile (and
    the reported versions); a different ``version`` registers the ops anew (references to op
    packets taken before go stale). When ``opcontracts.patch`` is
    applied, the new ops are guarded at once (the patch is applied again). Raises RuntimeError when a
    real torch_npu is loaded or importable: the emulation never shadows real kernels.

    ``device=True`` also registers the emulated ``npu`` device (``_device``: ``torch.npu``,
    ``torch_npu.npu``, npu tensors over CPU memory, the ops' kernels for it, backward on the
    engine's worker thread) reporting the SoC ``OPCONTRACTS_EMULATE_SOC`` names, else
    ``_device.DEFAULT_SOC`` (SettingError on a name that is not a chip's); a string is the SoC
    it reports (``device="Ascend910_9382"``).  Installing again with ``device=False`` keeps a
    device already installed.
    """
    global _lib, _finder, _release
    resolved = _profiles.resolve(profile, _ops.tensor_args())
    stack = resolved.stack
    if version is None:
        version = stack.torch_npu if stack is not None else DEFAULT_TORCH_NPU_VERSION
    _check_release(version)
    set_line(mindspeed_line)
    if _lib is not None and _release != version:
        if not device and _device.installed():
            device = _device.reported_soc()  # the device stays, with the SoC it reports
        uninstall()
    with _lock:
        versions = {"torch_npu": version, "mindspeed": mindspeed_version,
                    **_stack_versions(resolved, device)}
        if _lib is not None and _finder is not None:
            _profiles.activate(resolved)
            _finder.set_versions(versions)
            _install_device(device)
            _versions_changed()
            return
        reason = _real_torch_npu()
        if reason is not None:
            raise RuntimeError(
                f"opcontracts.emulation.install() refused: a real torch_npu is present ({reason}). "
                "The emulation is for machines without an NPU stack."
            )
        lib = _ops.register(version)
        arm_library()  # MindSpeed's AS_LIBRARY, defined when a stand-in first needs it
        install_compiler()  # a real MindSpeed's JIT builds get the emulated extensions
        _profiles.activate(resolved)
        finder = StandinFinder(versions)
        finder.insert()
        _lib, _finder, _release = lib, finder, version
        try:
            _install_device(device)
        except BaseException:
            _drop()  # nothing half-installed
            raise
    _versions_changed()
    # The new ``torch.ops.npu`` ops appear without any import the patch's hook could see:
    # an applied patch guards them now (it never imports anything itself).
    patch = sys.modules.get("opcontracts.patch")  # never imported from here
    if patch is not None and patch.is_applied():
        patch.apply()


def _stack_versions(profile: _profiles.Profile, device: bool | str) -> dict[str, str]:
    """What the stand-in ``torch_npu`` says of the stack (``_standins.STACK``): the profile,
    its CANN and the SoC (the device's when it reports one, else the profile's)."""
    stack = profile.stack
    if isinstance(device, str) and device:
        soc = device
    elif _device.installed():
        soc = _device.reported_soc()
    elif device is True:
        soc = _device.soc_setting()  # what the device about to be installed reports
    else:
        soc = stack.soc if stack is not None else ""
    return {"profile": profile.name, "cann": (stack.cann or "") if stack is not None else "",
            "soc": soc}


def _versions_changed() -> None:
    """The detected versions re-read (the stack the stand-in states may have changed with the
    profile while ``torch_npu`` stayed the same module), the registry's resolutions with them."""
    versions = sys.modules.get("opcontracts._lang.versions")  # not loaded: nothing cached
    if versions is not None:
        versions.refresh()


def _install_device(device: bool | str) -> None:
    """The npu device when asked for; while it is installed, its kernels for every op the
    emulation defines now (registered again after each install: the ops may be new)."""
    if device:
        _device.install(_device.soc_setting() if device is True else str(device))
    if _device.installed():
        _device.register_op_kernels()


def uninstall() -> None:
    """Undo :func:`install`: drop the stand-in modules, the finder, the ``npu`` ops and the
    ``npu`` device (what of the device cannot be undone: ``_device``).

    References to stand-in modules or op packets taken earlier go stale (calling them fails).
    A no-op when not installed.  When ``opcontracts.patch`` is applied, its guards on the
    emulated ops are removed first (restoring onto live objects) and the patch is applied
    again afterwards, so it holds no record of an object that is gone.
    """
    if _lib is None and _finder is None:
        return
    patch = sys.modules.get("opcontracts.patch")  # never imported from here
    if patch is None or not patch.is_applied():
        _drop()
        return
    patch.unpatch()
    try:
        _drop()
    finally:
        patch.apply()


def _drop() -> None:
    global _lib, _finder
    with _lock:
        _transfer.restore()  # transfer_to_npu's patches to torch, if a script imported it
        _device.uninstall()  # its kernels for the ops first, while the ops exist
        if _finder is not None:
            _finder.remove()
        for name in list(sys.modules):
            root = name.split(".", 1)[0]
            if (name in MODULE_NAMES or root in ("torch_npu", "mindspeed")) and is_standin(
                sys.modules[name]
            ):
                del sys.modules[name]
        disarm_library()  # torch.ops.mindspeed.* (defined by the stand-in builders)
        uninstall_compiler()
        if _lib is not None:
            _ops.deregister(_lib)
        _profiles.deactivate()
        set_line("core_r0.8.0")
        _lib, _finder, _release = None, None, None


def _check_release(version: str) -> None:
    from ..wheel import digest

    known = digest.load().versions
    if version not in known:
        raise ValueError(f"opcontracts.emulation.install(version={version!r}): the wheel digest "
                         f"has no torch_npu {version}; known releases: {', '.join(known)}")


def installed_release() -> str | None:
    """The torch_npu release whose structure the installed emulation has (None: not installed)."""
    return _release if _lib is not None else None


def installed() -> bool:
    """Whether the emulation is installed in this process."""
    return _lib is not None


def current_profile() -> _profiles.Profile | None:
    """The active :class:`Profile` (``.name``, ``.kernels``, ``.as_spec()``), None when not installed."""
    return _profiles.active()

