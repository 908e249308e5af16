"""Stand-in of MindSpeed's ``mindspeed/core/transformer/moe/grouped_matmul_util.py``.

What MindSpeed's MoE experts train through (``GroupedMLP``'s ``get_gmm_op_cls().gmm_apply``,
the overlap MLPs' ``op_forward`` / ``op_dx`` / ``op_dw``), read from MindSpeed master
028de58ca629 (2026-07-21).  The facts kept, which decide what a guard sees:

* ``BF16GMMFunction`` is an ``autograd.Function`` whose forward and backward call a grouped
  matmul per SoC: on Atlas A2 / A3 (and with no NPU: ``NPUVersion.NONE``) the JIT-built gmm
  extension directly (``mindspeed.ops.gmm.GMMFunction.builder.load().npu_gmm``: C++ calling
  aclnn, no torch_npu op, so no guard sees the call, here as there); on Ascend 950
  (``check_npu_version(NPUVersion.A5)``) ``torch_npu.npu_grouped_matmul(..., split_item=3)``,
  looked up on the ``torch_npu`` module at each call, which ``opcontracts.patch`` guards;
* forward: ``x @ weight[g]`` per group (``group_type`` 0); backward: dx the same with the
  weight transposed, dw ``x^T @ grad`` per group (``group_type`` 2), or, with
  ``--gemm-gradient-accumulation-fusion``, ``mindspeed.ops.npu_groupmatmul_add
  .npu_groupmatmul_add_fp32`` accumulating into ``weight_param.main_grad`` (no weight
  gradient returned unless the parameter has ``grad_added_to_main_grad``);
* ``gmm_apply`` takes tokens per expert (a list or a tensor) and passes their cumulative sum;
* the SoC comes from ``torch_npu.npu.get_device_name()`` (``mindspeed/ops/npu_matmul_add.py``:
  ``get_npu_version``, cached per process; any failure is ``NONE``);
* the arguments come from ``mindspeed.args_utils.get_full_args()`` (Megatron's when they are
  initialised, else MindSpeed's own): here a namespace of the four fields read
  (:data:`ARG_DEFAULTS`), one per stand-in build, which a caller changes by attribute.

Not emulated: the fp8 functions (``MXFP8GMMFunction``, ``MXFP832x32GMMFunction``,
``TensorwiseGMMFunction``, chosen under ``--fp8``: they exist by name and raise
NotImplementedError), the fb-overlap ``WeightGradStore`` deferral of dw, and Megatron itself.
"""

from __future__ import annotations

import argparse
import functools
import types
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import torch

from . import _device
from ._naming import own

__all__ = ["ARG_DEFAULTS", "ARGS_UTILS", "GMM_UTIL", "npu_version", "table"]

ARGS_UTILS = "mindspeed.args_utils"
GMM_UTIL = "mindspeed.core.transformer.moe.grouped_matmul_util"

ARG_DEFAULTS: dict[str, Any] = {
    "fp8": None,                                 # Megatron --fp8-format: no fp8
    "fp8_recipe": "delayed",                     # Megatron --fp8-recipe
    "use_gmm_fp8": True,                         # MindSpeed --no-use-gmm-fp8 clears it
    "gemm_gradient_accumulation_fusion": False,  # MindSpeed --gemm-gradient-accumulation-fusion
}


def _device_name() -> str:
    """``'npu'`` when the emulated device is installed, else the CPU (MindSpeed moves a CPU
    group list to the NPU; without the device the emulation's tensors are CPU tensors)."""
    return "npu" if _device.installed() else "cpu"


def npu_version(module: types.ModuleType) -> None:
    """``NPUVersion``, ``get_npu_version`` and ``check_npu_version`` on
    ``mindspeed.ops.npu_matmul_add`` (MindSpeed defines them there)."""

    class NPUVersion(IntEnum):
        NONE = 0
        A2 = 2
        A3 = 3
        A5 = 5
        MAX_VERSION = 999

    @functools.cache
    def get_npu_version() -> NPUVersion:
        try:
            import torch_npu  # type: ignore[import-not-found]  # the stand-in

            name = torch_npu.npu.get_device_name()
        except Exception:  # no device: MindSpeed reads NONE as "not an NPU"
            return NPUVersion.NONE
        if "Ascend910_95" in name or "Ascend950" in name:
            return NPUVersion.A5
        if "Ascend910_93" in name:
            return NPUVersion.A3
        if "Ascend910B" in name or "A2G" in name:
            return NPUVersion.A2
        return NPUVersion.MAX_VERSION

    def check_npu_version(min_version: NPUVersion | None = None,
                          max_version: NPUVersion | None = None) -> bool:
        version = module.get_npu_version()
        if version == NPUVersion.NONE:
            return False
        return not ((min_version is not None and version < min_version)
                    or (max_version is not None and version > max_version))

    # not in __all__: MindSpeed's names npu_matmul_add_fp32
    own(module, [NPUVersion, get_npu_version, check_npu_version], public=False)


def _args_utils(module: types.ModuleType) -> None:
    args = argparse.Namespace(**ARG_DEFAULTS)

    def get_full_args() -> argparse.Namespace:
        """Megatron's arguments are not emulated: MindSpeed's own namespace."""
        return args

    own(module, [get_full_args])
    module.__doc__ = "opcontracts emulation of mindspeed.args_utils (the fields grouped_matmul_util reads)."


_FP8 = ("is fp8 and not emulated (it needs MindSpeed's fp8 recipes and torch_npu's mx / "
        "dynamic quant ops)")


def _not_emulated(name: str, why: str = _FP8) -> Any:
    def refused(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"opcontracts emulation: grouped_matmul_util.{cls.__name__}.{name} {why}")

    refused.__name__ = name
    return classmethod(refused)


def _grouped_matmul_util(module: types.ModuleType) -> None:
    from mindspeed.args_utils import get_full_args  # type: ignore[import-not-found]
    from mindspeed.ops.npu_matmul_add import NPUVersion  # type: ignore[import-not-found]

    mod = module  # looked up at each call, as MindSpeed's module globals are

    def _gmm(x: torch.Tensor, w: torch.Tensor, bias: Any, group_list: torch.Tensor,
             group_type: int, group_list_type: int) -> torch.Tensor:
        """The SoC's grouped matmul: the extension on A2 / A3, torch_npu's op on Ascend 950."""
        if mod.check_npu_version(NPUVersion.A5):
            return mod.torch_npu.npu_grouped_matmul(  # type: ignore[no-any-return]
                [x], [w], bias=bias, group_list=group_list, split_item=3,
                group_type=group_type, group_list_type=group_list_type)[0]
        from mindspeed.ops.gmm import GMMFunction  # type: ignore[import-not-found]

        return GMMFunction.builder.load().npu_gmm(  # type: ignore[no-any-return]
            [x], [w], bias or [], group_list, group_type, group_list_type)[0]

    class BaseGMMFunction(torch.autograd.Function):
        @classmethod
        def gmm_apply(cls, x: torch.Tensor, weight: torch.Tensor, bias: Any,
                      tokens_per_expert: Any, weight_param: Any) -> torch.Tensor:
            if isinstance(tokens_per_expert, list):
                tokens_per_expert = torch.tensor(tokens_per_expert, dtype=torch.int64,
                                                 device=_device_name())
            return cls.apply(x, weight, bias, torch.cumsum(tokens_per_expert, dim=0),
                             weight_param)  # type: ignore[no-any-return]

        @classmethod
        def forward(cls, ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any,  # type: ignore[override]
                    group_list: Any, weight_param: Any, group_list_type: int = 0) -> torch.Tensor:
            if not isinstance(group_list, torch.Tensor):
                group_list = torch.tensor(group_list, dtype=torch.int64, device=_device_name())
            elif group_list.device.type == "cpu":
                group_list = group_list.to(_device_name())
            out = cls.op_forward(ctx, x, weight, group_list, group_list_type, bias=bias)
            ctx.save_for_backward(x, weight, group_list)
            ctx.weight_param, ctx.group_list_type = weight_param, group_list_type
            return out

        @classmethod
        def backward(cls, ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
            x, weight, group_list = ctx.saved_tensors
            dx = cls.op_dx(ctx, grad, weight, group_list, ctx.group_list_type)
            if get_full_args().gemm_gradient_accumulation_fusion:
                dw = cls.op_gmm_add(x, weight, grad, group_list, ctx.weight_param)
            else:
                dw = cls.op_dw(ctx, x, grad, group_list, ctx.group_list_type)
            return dx, dw, None, None, None, None

        # what a subclass computes with (BF16GMMFunction, the fp8 ones)
        op_forward = op_dx = op_dw = _not_emulated(
            "op_*", "is a subclass's (BF16GMMFunction computes; BaseGMMFunction does not)")

        @classmethod
        def op_gmm_add(cls, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                       group_list: torch.Tensor, weight_param: Any) -> torch.Tensor | None:
            """dw accumulated into ``main_grad`` in fp32; the weight gradient autograd gets is
            a placeholder, and only for a parameter Megatron's DDP marks."""
            cls.gmm_add_impl(x, grad, group_list, weight_param, weight.shape)
            if not hasattr(weight_param, "grad_added_to_main_grad"):
                return None
            weight_param.grad_added_to_main_grad = True
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            return make(weight.shape, dtype=x.dtype, device=x.device)

        @classmethod
        def gmm_add_impl(cls, x: torch.Tensor, grad: torch.Tensor, group_list: torch.Tensor,
                         weight_param: Any, weight_shape: Any) -> None:
            from mindspeed.ops.npu_groupmatmul_add import npu_groupmatmul_add_fp32  # type: ignore[import-not-found]

            npu_groupmatmul_add_fp32(x, grad, group_list, weight_param.main_grad)

    class BF16GMMFunction(BaseGMMFunction):
        @classmethod
        def op_forward(cls, ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                       group_list: torch.Tensor, group_list_type: int = 0,
                       bias: Any = None) -> torch.Tensor:
            return _gmm(x, weight, bias, group_list, 0, group_list_type)

        @classmethod
        def op_dx(cls, ctx: Any, grad: torch.Tensor, weight: torch.Tensor,
                  group_list: torch.Tensor, group_list_type: int = 0,
                  bias: Any = None) -> torch.Tensor:
            wt = weight.transpose(1, 2) if weight.dim() == 3 else weight.t()
            return _gmm(grad, wt, bias, group_list, 0, group_list_type)

        @classmethod
        def op_dw(cls, ctx: Any, x: torch.Tensor, grad: torch.Tensor,
                  group_list: torch.Tensor, group_list_type: int = 0,
                  bias: Any = None) -> torch.Tensor:
            return _gmm(x.t(), grad, bias, group_list, 2, group_list_type)

    fp8: list[type] = []
    for name in ("MXFP8GMMFunction", "TensorwiseGMMFunction"):
        fp8.append(type(name, (BaseGMMFunction,), {
            "__doc__": "fp8: not emulated (its op_* raise NotImplementedError).",
            **{op: _not_emulated(op) for op in ("op_forward", "op_dx", "op_dw", "gmm_add_impl")}}))
    fp8.append(type("MXFP832x32GMMFunction", (fp8[0],), {"__doc__": fp8[0].__doc__}))
    by_recipe = {"mxfp8": fp8[0], "mxfp8-32x32": fp8[2], "tensorwise": fp8[1], "delayed": fp8[1]}

    def get_gmm_quant_func() -> type | None:
        """The fp8 function of the recipe under ``--fp8`` (blockwise has none: bf16)."""
        args = get_full_args()
        if not args.fp8 or not args.use_gmm_fp8:
            return None
        return by_recipe.get(str(getattr(args.fp8_recipe, "value", args.fp8_recipe)))

    def get_gmm_op_cls() -> type:
        return mod.get_gmm_quant_func() or mod.BF16GMMFunction  # type: ignore[no-any-return]

    import torch_npu  # type: ignore[import-not-found]  # the stand-in
    from mindspeed.ops.npu_matmul_add import check_npu_version  # type: ignore[import-not-found]

    module.torch_npu = torch_npu  # type: ignore[attr-defined]
    module.check_npu_version = check_npu_version  # type: ignore[attr-defined]
    module.NPUVersion = NPUVersion  # type: ignore[attr-defined]
    own(module, [BaseGMMFunction, BF16GMMFunction, *fp8, get_gmm_quant_func, get_gmm_op_cls])
    del module.__all__  # MindSpeed's module has none
    module.__doc__ = ("opcontracts emulation of mindspeed.core.transformer.moe.grouped_matmul_util "
                      "(BF16GMMFunction: the gmm extension on A2/A3, torch_npu.npu_grouped_matmul "
                      "on Ascend 950; the fp8 functions are not emulated).")


def table() -> dict[str, Callable[[types.ModuleType], None]]:
    """The stand-in modules built here (their packages: ``_standins._Builders.package``)."""
    return {ARGS_UTILS: _args_utils, GMM_UTIL: _grouped_matmul_util}
