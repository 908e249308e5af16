"""The checks torch_npu's C++ glue makes before it calls a kernel, raised as it raises them.

op-plugin wraps most kernels in a short C++ function (``op_plugin/ops/opapi/*KernelNpuOpApi.cpp``)
whose ``TORCH_CHECK``s reject some arguments before the aclnn kernel runs: a ``RuntimeError``
whose message is the check's text.  The emulation runs the same checks, with the same key
phrase, before the reference (and before the fake, as the glue runs before any output is
allocated), so code that catches a real error (op-plugin's own tests do, by message) sees the
one it would see on the NPU.  Only the glue's checks live here: what the kernel itself
tolerates is the reference's business, what the documentation allows the contracts'.

Each check takes the op's arguments by name (``checks(name)(**bound)``) and raises or returns.

The glue also decides some of what an op returns around the kernel's result (``outputs``): an
output that is only kept for the backward node, which the glue hands over or leaves undefined.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["GLUE_CHECKS", "GLUE_OUTPUTS", "checks", "outputs"]

_IN_NOT_SPLIT_OUT_NOT_SPLIT, _IN_SPLIT_OUT_NOT_SPLIT = 0, 1
_GROUP_TYPES = (-1, 0, 2)  # DEFAULT_SPLIT, M_SPLIT, K_SPLIT


def _grouped_matmul(args: Mapping[str, Any], *, tensor_group_list: bool) -> None:
    """op-plugin GroupedMatmulKernelNpuOpApi.cpp (7.2.0 .. master): the ``Tensor? group_list``
    overload requires ``group_type`` (its schema's default is None) and one of -1 / 0 / 2; both
    overloads then run ``check_dims``.  The ``int[]? group_list`` overload (``.List``) checks
    no group_type."""
    if tensor_group_list:
        group_type = args.get("group_type")
        if group_type is None:
            raise RuntimeError("Requires manual passing group_type, current is None.")
        if group_type not in _GROUP_TYPES:
            raise RuntimeError("Use Tensor input with current cann version, The group type must "
                               f"be -1, 0 or 2, but now is [{group_type}]")
    x, weight = list(args.get("x") or ()), list(args.get("weight") or ())
    if not x or not weight:
        raise RuntimeError("Invalid inputs: neither x nor weight could be empty.")
    split_item = args.get("split_item")
    split_item = 0 if split_item is None else split_item
    if split_item not in (0, 1, 2, 3):
        raise RuntimeError(f"Invalid value of split_item [{split_item}], which should only be "
                           "one of 0/1/2/3.")
    if split_item not in (_IN_NOT_SPLIT_OUT_NOT_SPLIT, _IN_SPLIT_OUT_NOT_SPLIT):
        return
    group_list = args.get("group_list")
    if tensor_group_list:
        single = len(weight) == 1 and weight[0].dim() == 3
        n_weight = int(weight[0].size(0)) if single else len(weight)
        n_groups = int(group_list.size(0)) if group_list is not None else 0
    else:
        n_weight = len(weight)
        n_groups = len(group_list) if group_list is not None else 0
    if n_groups > 0:
        if len(x) != 1 or n_weight != n_groups:
            raise RuntimeError(
                "Invalid inputs. When split_item = 0 or 1 and input group_list is not None, the "
                "following two conditions are supposed to be satisfied: (1) length of x equals 1; "
                "(2) length of weight equals that of group_list. Actual lengths: "
                f"x [{len(x)}], weight [{n_weight}], group_list [{n_groups}].")
    elif len(x) != n_weight:
        raise RuntimeError(
            "When split_item = 0 or 1 and input group_list is None, the num of x tensors must "
            f"equal the num of weight tensors.Actual lengths: x [{len(x)}], weight [{n_weight}].")


def _on_ascend950() -> bool:
    """Whether the emulated device reports an Ascend 950 (the glue skips some checks there);
    without the device, the default chip (an A2).  Asked of the device emulation, not of
    ``torch_npu``: the glue runs whether or not the caller imported it."""
    from . import _device

    return _device.installed() and _device.reported_soc().startswith("Ascend950")


def _rotary_mode(op: str) -> Callable[[Mapping[str, Any]], None]:
    """op-plugin RotaryMulKernelNpuOpApi.cpp / RotaryMulBackwardKernelNpuOpApi.cpp: before
    Ascend 950, ``rotary_mode`` is ``half`` or ``interleave``."""

    def check(args: Mapping[str, Any]) -> None:
        mode = args.get("rotary_mode", "half")
        if mode not in ("half", "interleave") and not _on_ascend950():
            raise RuntimeError(f"The rotary_mode of {op} should be half or interleave, but got "
                               f"{mode}")

    return check


def _mrope_cache_mode(args: Mapping[str, Any]) -> None:
    """op-plugin RopeWithSinCosCacheKernelNpuOpApi.cpp (49a65c88, 2026-03: the releases whose
    ``npu_mrope`` has ``cache_mode``, 2.7.1.post4, 2.8.0.post4, 2.9.0.post2 on): ``cache_mode``
    is ``default`` or ``interleave``, and ``interleave`` needs ``aclnnRopeWithSinCosCacheV2``,
    looked up in the CANN installed: from CANN 9.0.0 here (op-plugin's test gates its cache-mode
    cases on 9.0.0; no doc names the first CANN with the V2 kernel).  ``rotary_mode`` is not
    refused there: any value but ``half`` runs gpt-j style (``is_neox_style``'s check is always
    true until master's 96b51a1d, 2026-08); the contract allows half / interleave only."""
    from . import _npu_api

    mode = args.get("cache_mode")
    mode = "default" if mode is None else mode
    if mode not in ("default", "interleave"):
        raise RuntimeError("cache_mode only support default or interleave")
    if mode == "interleave" and not _npu_api.is_gte_cann_version("9.0.0"):
        raise RuntimeError(f"npu_mrope: cache_mode='{mode}' requires aclnnRopeWithSinCosCacheV2, "
                           "but current environment does not support it. Please upgrade CANN or "
                           "use cache_mode='default'.")


def _dropout_probability(args: Mapping[str, Any]) -> None:
    """op-plugin DropoutGenMaskKernelNpuOpApi.cpp: ``p`` in [0, 1]."""
    p = float(args["p"])
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")


GLUE_CHECKS: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "_npu_dropout_gen_mask": _dropout_probability,
    "npu_grouped_matmul": lambda a: _grouped_matmul(a, tensor_group_list=True),
    "npu_grouped_matmul.List": lambda a: _grouped_matmul(a, tensor_group_list=False),
    "npu_mrope": _mrope_cache_mode,
    "npu_rotary_mul": _rotary_mode("npu_rotary_mul"),
    "npu_rotary_mul_backward": _rotary_mode("npu_rotary_mul_backward"),
}
"""Per op (``name`` or ``name.overload``), the glue's checks."""


def checks(name: str) -> Callable[[Mapping[str, Any]], None] | None:
    """The glue's checks of ``name`` (``op`` or ``op.overload``), or None when it has none."""
    return GLUE_CHECKS.get(name)


def _unpermute_for_backward(args: Mapping[str, Any], out: Any, *, fake: bool) -> Any:
    """op-plugin MoeTokenUnpermuteKernelNpuOpApi.cpp (master from 2026-07, dc5f694a "Optimize
    moe token unpermute backward memory" and e17530db; the releases with
    ``_npu_moe_token_unpermute``: 2.7.1.post11, 2.9.0.post9, 2.12.0.post3, 2.13, 2.14): the
    second output, ``permuted_tokens_for_backward``, is what ``NpuMoeTokenUnpermuteBackward0``
    saves (``Functions.h``: ``probs_``, ``sorted_indices_``, ``permuted_tokens_for_backward_``,
    no ``permuted_tokens_``).  The glue returns ``permuted_tokens`` itself there when ``probs``
    is given, before CANN 9.1.0 or on an Ascend 950, and an undefined tensor (None) otherwise:
    the backward then keeps no permuted tokens alive.  The fake returns a new tensor where the
    kernel returns the input (a fake aliasing its input is refused)."""
    from . import _npu_api

    unpermuted, _ = out
    tokens = args["permuted_tokens"]
    keep = (args.get("probs") is not None or not _npu_api.is_gte_cann_version("9.1.0")
            or _on_ascend950())
    if not keep:
        return unpermuted, None
    return unpermuted, (tokens.new_empty(tokens.shape) if fake else tokens.detach())


def _format_cast(args: Mapping[str, Any], out: Any, *, fake: bool) -> Any:
    """torch_npu's ``npu_format_cast``: the tensor itself (its storage) when it already has the
    format asked for, else the new tensor in that format (NZ of fewer than 2 dims: ND); the
    format is kept on the storage (``_formats``)."""
    from . import _formats

    if fake:
        return out
    self = args["self"]
    want = _formats.storage_format(self.dim(), int(args["acl_format"]))
    if _formats.format_of(self) == want:
        return self.detach()  # the same storage, as the real glue returns self
    _formats.set_format(out, want)
    return out


GLUE_OUTPUTS: dict[str, Callable[..., Any]] = {
    "_npu_moe_token_unpermute": _unpermute_for_backward,
    "npu_format_cast": _format_cast,
}
"""Per op, what the glue makes of the kernel's outputs: ``(arguments, outputs, fake=) ->
outputs``."""


def outputs(name: str) -> Callable[..., Any] | None:
    """The glue's treatment of ``name``'s outputs, or None when it returns the kernel's."""
    return GLUE_OUTPUTS.get(name)
