"""The torch_npu surface real code imports, beyond the fused ops: stand-in modules for the
stand-in finder (``_standins``), the release's extra dtypes, and the one line a script gets
when it imports something the emulation does not have.

Modules (each built from what the real one does; ``_testing``, ``_transfer``, ``_npu_api``):

* ``torch_npu.testing`` and its ``testcase``, ``common_utils``, ``common_distributed``,
  ``decorator`` (``_testing``);
* ``torch_npu.contrib`` and ``torch_npu.contrib.transfer_to_npu`` (``_transfer``: cuda devices
  and ``torch.cuda.*`` go to the emulated npu device);
* ``torch_npu.utils`` (``get_cann_version``) and ``torch_npu.npu.utils`` (``get_cann_version``,
  ``_is_gte_cann_version``, the device, stream and dtype-support functions);
* ``torchair`` with ``get_npu_backend`` / ``get_compiler`` (``torch.compile`` backends that
  run the captured graph eagerly on the emulated device), ``CompilerConfig``
  (``torchair.configs.compiler_config``), ``use_internal_format_weight``, ``logger``, and
  ``torchair.ge`` / ``register_fx_node_ge_converter`` (``_torchair_ge``: converters recorded);
* ``mindspeed.megatron_adaptor``: imports ``torch_npu.contrib.transfer_to_npu`` and (when it
  is importable) ``megatron.training`` as MindSpeed's does; MindSpeed's patches to Megatron
  are not applied (``exe_adaptation`` does nothing): a Megatron module MindSpeed would route to
  a fused op runs Megatron's own code.

``torch_npu.<dtype>`` (``hifloat8``, ``float8_e8m0fnu``, ``float4_e2m1fn_x2``, ``int4``, ...,
and the standard names) are integers as in torch_npu: its ``DType`` enum, the aclDataType
plus 256 (``torch_npu/csrc/custom_dtype/Init.h``), which the ops take as their dtype arguments.

An import of a ``torch_npu`` / ``mindspeed`` / ``torchair`` module the emulation does not have
raises :class:`NotEmulatedError` (a ``ModuleNotFoundError``), whose message says what is not
emulated, what is, and where to read more; ``opcontracts run`` prints it as one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from . import _acl, _c10d, _npu_api, _profiler, _testing, _torchair_ge, _transfer
from ._naming import own

__all__ = ["DTYPES", "NEEDS_DEVICE", "PACKAGES", "NotEmulatedError", "check_known", "extend_torch_npu", "table"]

DOC = "docs/emulated-device.md"

DTYPES: dict[str, int] = {name: 256 + acl for name, acl in (
    ("float32", 0), ("float16", 1), ("int8", 2), ("int32", 3), ("uint8", 4), ("int16", 6),
    ("uint16", 7), ("uint32", 8), ("int64", 9), ("uint64", 10), ("float64", 11), ("bool", 12),
    ("string", 13), ("complex64", 16), ("complex128", 17), ("bfloat16", 27), ("int4", 29),
    ("uint1", 30), ("complex32", 33), ("hifloat8", 34), ("float8_e5m2", 35),
    ("float8_e4m3fn", 36), ("float8_e8m0fnu", 37), ("float6_e3m2", 38), ("float6_e2m3", 39),
    ("float4_e2m1fn_x2", 40), ("float4_e1m2fn_x2", 41))}
"""``torch_npu.<name>``: torch_npu's DType values (aclDataType + 256)."""

ROOTS = ("torch_npu", "mindspeed", "torchair")
LAZY_SUBMODULES = ("utils", "contrib", "testing", "profiler", "_C")  # torch_npu.<name> without importing it


class NotEmulatedError(ModuleNotFoundError):
    """An import of a torch_npu / MindSpeed / torchair module the emulation does not have."""

    opcontracts_not_emulated = True


def _emulated_summary() -> str:
    return ("the emulation has torch_npu's fused ops, torch_npu.npu, torch_npu.testing, "
            "torch_npu.contrib.transfer_to_npu, torch_npu.utils, torchair and mindspeed.ops")


def not_emulated(name: str, what: str = "module") -> str:
    """The message for a ``name`` the emulation does not have."""
    return (f"No {what} named {name!r}: opcontracts' CPU emulation does not emulate {name} "
            f"({_emulated_summary()}; see {DOC})")


def check_known(fullname: str) -> None:
    """Raise :class:`NotEmulatedError` for a module below a stand-in root that the emulation
    does not have (the stand-in finder calls this for names it does not serve)."""
    root = fullname.partition(".")[0]
    if root not in ROOTS or fullname == root:
        return
    if fullname == "torch_npu.npu" or fullname.startswith("torch_npu.npu."):
        if "torch_npu.npu" not in sys.modules:
            raise NotEmulatedError(
                f"No module named {fullname!r}: the emulated npu device is not installed "
                "(opcontracts run --emulate installs it; in code: "
                "opcontracts.emulation.install(device=True))", name=fullname)
    raise NotEmulatedError(not_emulated(fullname), name=fullname)


# -- torch_npu itself -------------------------------------------------------------------------

def extend_torch_npu(module: types.ModuleType) -> None:
    """The dtypes, and submodules reached as attributes (``torch_npu.utils.get_cann_version``
    after a plain ``import torch_npu``, as torch_npu's ``__init__`` imports them)."""
    for name, value in DTYPES.items():
        setattr(module, name, value)
    from . import _formats  # NPU storage formats: torch_npu.Format, get_npu_format

    def get_npu_format(tensor):  # type: ignore[no-untyped-def]
        """The tensor's storage format, a ``torch_npu.Format`` (``_formats``)."""
        return _formats.get_npu_format(tensor)

    module.Format = _formats.Format  # type: ignore[attr-defined]
    own(module, [get_npu_format], public=False)

    def __getattr__(name: str) -> Any:
        if name in LAZY_SUBMODULES:
            return importlib.import_module(f"{module.__name__}.{name}")
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(not_emulated(f"torch_npu.{name}", "attribute"))

    module.__getattr__ = __getattr__  # type: ignore[method-assign]


# -- torch_npu.utils, torch_npu.npu.utils, torch_npu.contrib ------------------------------------

def _utils(module: types.ModuleType) -> None:
    def get_cann_version(module="CANN"):  # type: ignore[no-untyped-def]
        """The CANN version (the emulation's: ``_npu_api.cann_version``)."""
        return _npu_api.cann_version(module)

    own(module, [get_cann_version])


def _collect_env(module: types.ModuleType) -> None:
    def get_cann_version():  # type: ignore[no-untyped-def]
        """The installed CANN's version, which torch_npu reads from the
        ``ascend_*_install.info`` under ``ASCEND_HOME_PATH``: the emulated CANN's."""
        return _npu_api.cann_version("CANN")

    own(module, [get_cann_version])


def _npu_utils(module: types.ModuleType) -> None:
    device = sys.modules.get("torch_npu.npu")
    if device is None:
        raise NotEmulatedError(
            "torch_npu.npu.utils needs the emulated npu device (opcontracts run --emulate, or "
            "opcontracts.emulation.install(device=True))", name=module.__name__)
    for name in _npu_api.utils_names():
        if hasattr(device, name):
            setattr(module, name, getattr(device, name))

    def _is_gte_cann_version(version, module="CANN"):  # type: ignore[no-untyped-def]
        return _npu_api.is_gte_cann_version(version, module)

    own(module, [_is_gte_cann_version], public=False)
    module.__all__ = [n for n in _npu_api.utils_names() if hasattr(module, n)]  # type: ignore[attr-defined]


def _contrib(module: types.ModuleType) -> None:
    module.__doc__ = ("opcontracts emulation of torch_npu.contrib (transfer_to_npu only).")


def _transfer_to_npu(module: types.ModuleType) -> None:
    module.__doc__ = _transfer.__doc__
    module.__all__ = []  # type: ignore[attr-defined]
    _transfer.apply()


# -- torchair -----------------------------------------------------------------------------------

class _Options:
    """A torchair sub-configuration (``config.debug``, ``config.experimental_config``...):
    options are recorded; the emulation runs the graph eagerly whatever they say."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Options(f"{self._name}.{name}")
        object.__setattr__(self, name, sub)
        return sub

    def __repr__(self) -> str:
        return f"<torchair option group {self._name}>"


_CONFIG_GROUPS = ("debug", "aoe_config", "export", "dump_config", "fusion_config",
                  "experimental_config", "inference_config", "ge_config")


def _compiler_config(module: types.ModuleType) -> None:
    class CompilerConfig:
        """torchair's ``CompilerConfig``: its option groups and ``mode``; an option it does
        not have is a ValueError, as torchair raises."""

        def __init__(self):  # type: ignore[no-untyped-def]
            for group in _CONFIG_GROUPS:
                object.__setattr__(self, group, _Options(group))
            object.__setattr__(self, "mode", "max-autotune")

        def __setattr__(self, key, value):  # type: ignore[no-untyped-def]
            if key not in (*_CONFIG_GROUPS, "mode"):
                raise ValueError(f"CompilerConfig has no option {key}, all options "
                                 f"{[*_CONFIG_GROUPS, 'mode']}")
            object.__setattr__(self, key, value)

    own(module, [CompilerConfig])


def _eager_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """Run the graph dynamo captured as it is (on the emulated device's kernels)."""
    return gm.forward  # type: ignore[no-any-return]


def _torchair(module: types.ModuleType) -> None:
    from torchair.configs.compiler_config import CompilerConfig  # type: ignore[import-not-found]

    def get_npu_backend(*, compiler_config=None, custom_decompositions=None):  # type: ignore[no-untyped-def]
        """A ``torch.compile`` backend: on the emulation, the captured graph runs eagerly."""
        return _eager_backend

    def get_compiler(compiler_config=None):  # type: ignore[no-untyped-def]
        return _eager_backend

    def use_internal_format_weight(model):  # type: ignore[no-untyped-def]
        return None  # one format (ND) on the emulated device

    def patch_for_hcom():  # type: ignore[no-untyped-def]
        return None

    def dynamo_export(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError(not_emulated("torchair.dynamo_export", "function"))

    register_fx_node_ge_converter = _torchair_ge.register_fx_node_ge_converter
    own(module, [get_npu_backend, get_compiler, use_internal_format_weight, patch_for_hcom,
                 dynamo_export])
    module.register_fx_node_ge_converter = register_fx_node_ge_converter  # type: ignore[attr-defined]
    module.ge = importlib.import_module("torchair.ge")  # type: ignore[attr-defined]  # as torchair's __init__
    module.CompilerConfig = CompilerConfig  # type: ignore[attr-defined]
    module.logger = logging.getLogger("torchair")  # type: ignore[attr-defined]
    module.__all__ += ["CompilerConfig", "logger", "register_fx_node_ge_converter"]  # type: ignore[attr-defined]


def _torchair_ge_module(module: types.ModuleType) -> None:
    _torchair_ge.fill_ge(module, not_emulated)


def _package(module: types.ModuleType) -> None:
    module.__doc__ = f"opcontracts emulation of {module.__name__}."


# -- mindspeed.megatron_adaptor -----------------------------------------------------------------

def _megatron_adaptor(module: types.ModuleType) -> None:
    importlib.import_module("torch_npu.contrib.transfer_to_npu")  # what MindSpeed's imports first
    if importlib.util.find_spec("megatron") is not None:
        # MindSpeed's adaptation imports Megatron's training package before anything else of
        # it (Megatron's legacy model imported first is a circular import without it)
        importlib.import_module("megatron.training")

    def exe_adaptation():  # type: ignore[no-untyped-def]
        """MindSpeed's patches to Megatron: not applied on the emulation."""
        return None

    own(module, [exe_adaptation])
    module.__doc__ = ("opcontracts emulation of mindspeed.megatron_adaptor: imports "
                      "torch_npu.contrib.transfer_to_npu and megatron.training as MindSpeed's "
                      "does; MindSpeed's patches to Megatron are not applied.")


def table() -> dict[str, Callable[[types.ModuleType], None]]:
    """Stand-in module name -> the function that fills it."""
    return {
        **_testing.TABLE,
        "torch_npu.utils": _utils,
        "torch_npu.utils.collect_env": _collect_env,
        "torch_npu.profiler": lambda m: _profiler.fill_profiler(m, not_emulated),
        "torch_npu.profiler.profiler": lambda m: _profiler.fill_profiler_module(m, not_emulated),
        "torch_npu.npu.utils": _npu_utils,
        "torch_npu.contrib": _contrib,
        "torch_npu.contrib.transfer_to_npu": _transfer_to_npu,
        "torchair": _torchair,
        "torchair.configs": _package,
        "torchair.configs.compiler_config": _compiler_config,
        "torchair.ge": _torchair_ge_module,
        "mindspeed.megatron_adaptor": _megatron_adaptor,
        "acl": _acl.fill_acl,
        "torch_npu._C": _c10d.fill_c,
    }


NEEDS_DEVICE = ("torch_npu.npu.utils", "torch_npu.contrib.transfer_to_npu",
                "mindspeed.megatron_adaptor")
"""The stand-in modules that import only with the emulated device installed."""

PACKAGES = ("torch_npu.testing", "torch_npu.utils", "torch_npu.contrib", "torch_npu.profiler", "torchair",
            "torchair.configs", "torchair.ge")
