"""Autocast on the emulated ``npu`` device, and ``torch.npu.amp``.

torch has no autocast kernels for PrivateUse1; torch_npu registers its own on the
``AutocastPrivateUse1`` key (a fallthrough for every op, and per-op casting policies: the
same op lists and policies as torch's CUDA autocast).  :func:`register` does the same in
Python: matmuls and convolutions run in the autocast dtype (``torch.get_autocast_dtype("npu")``,
float16 unless set, as torch_npu), the ops that need range run in float32, reductions and
softmax get ``dtype=float32``, a few mixed-input ops promote to the widest input, and
``binary_cross_entropy`` is refused as unsafe.  Only floating npu tensors other than float64
are cast, as torch's autocast casts.  Not done: torch's cache of the casts of leaf weights
within one autocast region (each op casts again; the values and gradients are the same).

``torch.npu.amp`` (:func:`amp_module`) is torch_npu's: ``autocast(enabled, dtype, cache_enabled)``
on the npu device, ``GradScaler`` (torch's, on npu, with torch_npu's ``dynamic`` argument) and
``custom_fwd`` / ``custom_bwd``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.library import Library

__all__ = ["amp_module", "register"]

DEVICE_TYPE = "npu"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)  # type: ignore[attr-defined]

_LOWER = ("_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
          "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
          "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear", "addbmm",
          "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
          "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
          "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
         "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
         "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
         "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
         "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
         "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
         "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
         "pdist", "cdist", "renorm", "logsumexp")
_FP32_SET_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                   "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
                   "sum", "sum.dim_IntList")
_FP32_APPEND_DTYPE = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype"}
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler",
            "index_put", "tensordot", "scatter_add")


def _eligible(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.device.type == DEVICE_TYPE
            and value.is_floating_point() and value.dtype != torch.float64)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value):
        return value.to(dtype) if value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _cast_all(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple(_cast(v, dtype) for v in args), {k: _cast(v, dtype) for k, v in kwargs.items()}


def _lower(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    args, kwargs = _cast_all(args, kwargs, torch.get_autocast_dtype(DEVICE_TYPE))
    return op(*args, **kwargs)


def _fp32(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    args, kwargs = _cast_all(args, kwargs, torch.float32)
    return op(*args, **kwargs)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)


def _fp32_set_dtype(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _eligible(_first_tensor(args, kwargs)):
        names = [a.name for a in op._schema.arguments]
        at = names.index("dtype")
        if at < len(args):
            if args[at] is None:
                args = (*args[:at], torch.float32, *args[at + 1:])
        elif kwargs.get("dtype") is None:
            kwargs = {**kwargs, "dtype": torch.float32}
    return op(*args, **kwargs)


def _fp32_append_dtype(overload: str) -> Callable[..., Any]:
    def policy(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not _eligible(_first_tensor(args, kwargs)):
            return op(*args, **kwargs)
        other = getattr(op._overloadpacket, overload)
        return other(*args, **kwargs, dtype=torch.float32)
    return policy


def _promote(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dtype = torch.get_autocast_dtype(DEVICE_TYPE)
    stack = list((*args, *kwargs.values()))
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(value)
        elif _eligible(value):
            dtype = torch.promote_types(dtype, value.dtype)
    args, kwargs = _cast_all(args, kwargs, dtype)
    return op(*args, **kwargs)


def _banned(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
        "(a sigmoid before them loses its range in the autocast dtype): use "
        "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, "
        "which are safe to autocast")


def _kernel(op: Any, policy: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return policy(op, args, kwargs)
    kernel.__name__ = f"npu_autocast_{op._opname}"
    return kernel


def _policies() -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = {}
    table.update(dict.fromkeys(_LOWER, _lower))
    table.update(dict.fromkeys(_FP32, _fp32))
    table.update(dict.fromkeys(_FP32_SET_DTYPE, _fp32_set_dtype))
    table.update({name: _fp32_append_dtype(o) for name, o in _FP32_APPEND_DTYPE.items()})
    table.update(dict.fromkeys(_PROMOTE, _promote))
    table["binary_cross_entropy"] = _banned
    return table


def register() -> list[Library]:
    """The autocast kernels for the npu device (a fallthrough for every other op)."""
    every = Library("_", "IMPL")
    every.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    aten = Library("aten", "IMPL")
    for name, policy in _policies().items():
        packet_name, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, packet_name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None:  # not in this torch build
            continue
        aten.impl(name, _kernel(op, policy), "AutocastPrivateUse1")
    return [every, aten]


# -- torch.npu.amp ------------------------------------------------------------------------------

class autocast(torch.amp.autocast_mode.autocast):  # noqa: N801  # torch_npu's name
    """``torch.npu.amp.autocast``: :class:`torch.autocast` on the npu device, float16 unless
    told."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                 cache_enabled: bool = True) -> None:
        super().__init__(DEVICE_TYPE, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """``torch.npu.amp.GradScaler``: torch's loss scaler on the npu device; ``dynamic=False``
    keeps the scale fixed (``update()`` changes it only when given a new one)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, dynamic: bool = True,
                 enabled: bool = True) -> None:
        super().__init__(DEVICE_TYPE, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self._dynamic = dynamic

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self._dynamic or new_scale is not None or not self._enabled:
            super().update(new_scale)
            return
        self._per_optimizer_states.clear()  # a fixed scale: only the step's record goes


def custom_fwd(fwd: Any = None, *, cast_inputs: torch.dtype | None = None) -> Any:
    """``torch.npu.amp.custom_fwd``: ``torch.amp.custom_fwd`` on the npu device."""
    return functools.partial(torch.amp.custom_fwd, device_type=DEVICE_TYPE)(
        fwd=fwd, cast_inputs=cast_inputs)


def custom_bwd(bwd: Any) -> Any:
    """``torch.npu.amp.custom_bwd``: ``torch.amp.custom_bwd`` on the npu device."""
    return functools.partial(torch.amp.custom_bwd, device_type=DEVICE_TYPE)(bwd)


def amp_module(parent: str) -> types.ModuleType:
    """``torch.npu.amp`` (``<parent>.amp``)."""
    mod = types.ModuleType(f"{parent}.amp", "opcontracts' emulated torch.npu.amp")
    for obj in (autocast, GradScaler, custom_fwd, custom_bwd):
        setattr(mod, obj.__name__, obj)
    mod.__all__ = ["autocast", "GradScaler", "custom_fwd", "custom_bwd"]  # type: ignore[attr-defined]
    # torch_npu/npu/amp's submodules: torch's dynamo names ``torch.cuda.amp.autocast_mode
    # .autocast``, which transfer_to_npu turns into this module's
    for sub, objs in (("autocast_mode", (autocast, custom_fwd, custom_bwd)),
                      ("grad_scaler", (GradScaler,))):
        child = types.ModuleType(f"{mod.__name__}.{sub}")
        for obj in objs:
            setattr(child, obj.__name__, obj)
        setattr(mod, sub, child)
    mod.__opcontracts_emulation__ = True  # type: ignore[attr-defined]
    return mod
