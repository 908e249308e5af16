"""MindSpeed's JIT-built C++ extensions, emulated: what ``MindSpeedOpBuilder.load()`` returns.

On the real stack ``mindspeed.ops.npu_moe_token_unpermute`` (and permute, gmm, rope) is a thin
Python function over a C++ extension that ``mindspeed/op_builder/builder.py`` compiles with
``torch.utils.cpp_extension.load`` (``mindspeed/ops/csrc/cann/*.cpp``).  Its functions are
pybind11 builtins; their ``torch::autograd::Function`` checks what MindSpeed's line checks
(``TORCH_CHECK``) and calls the CANN kernel with ``ACLNN_CMD``: no torch_npu op, no dispatcher,
no Python attribute between MindSpeed and the kernel.  So nothing of torch_npu's contracts can
fire inside a MindSpeed call, and a ``TorchDispatchMode`` sees no ``npu`` op there.

The emulation keeps that shape:

* :func:`aclnn` is "the CANN kernel, called directly": the shared reference
  (``opcontracts.reference``, the same one the emulated torch_npu op runs) read through the
  active dtype profile (``_raw.kernel_view``) below autograd; never ``torch.ops.npu.*``;
* :func:`load` builds an extension module by the name MindSpeed's builder gives it (its
  ``OP_NAME``), with the functions the ``.cpp`` binds, each an ``autograd.Function`` as the C++
  one: the checks of the installed MindSpeed line (:data:`MINDSPEED_LINES`), the kernel, and a
  backward calling the grad kernel the same way;
* :func:`library` is MindSpeed's ``AS_LIBRARY = Library("mindspeed", "DEF")``
  (``op_builder/builder.py``), defined when a stand-in builder first needs it (a real MindSpeed
  defines its own) and destroyed by ``uninstall()``; the stand-in builders define their ops on
  it as MindSpeed's do (``GMMOpBuilder.__init__``).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.library import Library

from .. import reference
from ..reference import _fam_gemm_comm as _gemm_ref
from . import _raw
from ._naming import own
from ._ops import _opaque, _through
from ._raw import reinterpret

__all__ = ["EXTENSIONS", "MINDSPEED_LINES", "aclnn", "arm_library", "atb_groupmatmul_add", "atb_matmul_add", "disarm_library",
           "install_compiler", "library", "line", "load", "set_line", "uninstall_compiler"]

MINDSPEED_LINES = ("core_r0.8.0", "master")
"""MindSpeed lines whose unpermute / permute C++ differ: ``master``'s
(``mindspeed/ops/csrc/cann/npu_moe_token_(un)permute.cpp``) ``TORCH_CHECK``s bf16 tokens and
probs and int32 sorted_indices, forward and backward, since the op was added (2024-08); the
DeepSeek-V3 line (``core_r0.8.0``, ``2.0.0_core_r0.8.0``, ``2.1.0_core_r0.8.0``: commits
e3752b2a, 86660d80) removed the dtype checks (only ranks are checked) and instead casts
permuted_tokens (and, in backward, the incoming gradient) to fp32 when probs is fp32, which is
where the incident's silent NaN lives (the grad kernel gets fp32 where it reads bf16)."""

_state: dict[str, Any] = {"line": "core_r0.8.0", "library": None}

NAMESPACE = "mindspeed"


def set_line(name: str) -> None:
    if name not in MINDSPEED_LINES:
        raise ValueError(f"mindspeed_line={name!r}: one of {', '.join(MINDSPEED_LINES)}")
    _state["line"] = name


def line() -> str:
    """The MindSpeed line the extensions behave as."""
    return str(_state["line"])


# --------------------------------------------------------------------------- the mindspeed library


def arm_library() -> None:
    """While installed, :func:`library` defines MindSpeed's ``AS_LIBRARY`` at its first use:
    a stand-in builder's, never at install, so a real MindSpeed imported later defines its own
    ``Library("mindspeed", "DEF")`` (one namespace, one definer)."""
    _state["armed"] = True


def disarm_library() -> None:
    """Drop the library, if a stand-in defined it (``torch.ops.mindspeed.*`` goes with it)."""
    _state["armed"] = False
    lib = _state["library"]
    _state["library"] = None
    if lib is not None:
        lib._destroy()


def library() -> Library:
    """The installed emulation's ``AS_LIBRARY``, ``Library("mindspeed", "DEF")``, defined at the
    first call (RuntimeError when not installed)."""
    if not _state.get("armed"):
        raise RuntimeError("the MindSpeed stand-ins need opcontracts.emulation.install()")
    if _state["library"] is None:
        _state["library"] = Library(NAMESPACE, "DEF")
    return _state["library"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- the CANN kernels


def aclnn(kernel: str) -> Callable[..., Any]:
    """The CANN kernel of torch_npu op ``kernel``, called as ``ACLNN_CMD`` calls it: its
    reference, each argument read as the kernel reads it under the active profile, below
    autograd (no graph is recorded inside it)."""
    ref = reference.get(kernel)
    if ref is None:  # pragma: no cover - a packaging bug
        raise RuntimeError(f"opcontracts.reference has no kernel {kernel!r}")
    return _opaque(_through(_raw.kernel_view, kernel, ref.forward))


def _scalar(t: torch.Tensor) -> str:
    """How c10 prints a ScalarType."""
    return {torch.bfloat16: "BFloat16", torch.float16: "Half", torch.float32: "Float",
            torch.float64: "Double", torch.int32: "Int", torch.int64: "Long",
            torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
            torch.bool: "Bool"}.get(t.dtype, str(t.dtype))


def _torch_check(ok: bool, *parts: object) -> None:
    """``TORCH_CHECK``: a RuntimeError with its message."""
    if not ok:
        raise RuntimeError("".join(str(p) for p in parts))


def _dtype_check(t: torch.Tensor, want: torch.dtype, name: str, should: str) -> None:
    _torch_check(t.dtype == want, "Input tensor ", name, " dtype [", _scalar(t),
                 "] is invalid, should be ", should)


def _dims(t: torch.Tensor, name: str, dims: int) -> None:
    _torch_check(t.dim() == dims, "The dims of input ", name, " should be ", dims,
                 " dimensional, but got ", t.dim(), "-dimensional.")


def _no_padded_mode(padded_mode: Any) -> None:
    if padded_mode:  # a std::runtime_error: RuntimeError in Python
        raise RuntimeError("current version only support padded_mode is false")


# --------------------------------------------------------------------------- npu_moe_token_unpermute
# mindspeed/ops/csrc/cann/npu_moe_token_unpermute.cpp (NPUMoeTokenUnpermute): the checks are
# CheckMoeTokenUnpermuteForward / Backward, per line.


def _check_unpermute_forward(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                             probs: torch.Tensor | None, padded_mode: Any, master: bool) -> None:
    _no_padded_mode(padded_mode)
    if master:
        _dtype_check(permuted_tokens, torch.bfloat16, "permuted_tokens", "bfloat16")
        _dtype_check(sorted_indices, torch.int32, "sorted_indices", "int32")
        if probs is not None:
            _dtype_check(probs, torch.bfloat16, "probs", "bfloat16")
    _dims(permuted_tokens, "permuted_tokens", 2)
    _dims(sorted_indices, "sorted_indices", 1)
    if probs is not None:
        _dims(probs, "probs", 2)


def _check_unpermute_backward(grad: torch.Tensor, sorted_indices: torch.Tensor,
                              probs: torch.Tensor | None, master: bool) -> None:
    if master:
        _dtype_check(grad, torch.bfloat16, "unpermuted_tokens_grad", "bfloat16")
        _dtype_check(sorted_indices, torch.int32, "sorted_indices", "int32")
        if probs is not None:
            _dtype_check(probs, torch.bfloat16, "probs", "bfloat16")
    _dims(grad, "unpermuted_tokens_grad", 2)
    _dims(sorted_indices, "sorted_indices", 1)
    if probs is not None:
        _dims(probs, "probs", 2)


def _fp32_target(permuted_tokens: torch.Tensor, probs: torch.Tensor | None) -> bool:
    """core_r0.8.0: ``target_dtype = probs ? probs.dtype : permuted_tokens.dtype``; cast when
    it is fp32."""
    return (probs.dtype if probs is not None else permuted_tokens.dtype) == torch.float32


class NPUMoeTokenUnpermute(torch.autograd.Function):
    """The C++ ``torch::autograd::Function`` of MindSpeed's unpermute extension."""

    @staticmethod
    def forward(ctx: Any, permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                probs: torch.Tensor | None, padded_mode: Any, restore_shape: Any) -> torch.Tensor:
        master = line() == "master"
        _check_unpermute_forward(permuted_tokens, sorted_indices, probs, padded_mode, master)
        tokens = permuted_tokens
        if not master and _fp32_target(permuted_tokens, probs):
            tokens = permuted_tokens.to(torch.float32)
        out = aclnn("npu_moe_token_unpermute")(tokens, sorted_indices, probs, False, None)
        ctx.save_for_backward(permuted_tokens, sorted_indices, probs)
        ctx.master = master
        return out if master else out.to(permuted_tokens.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        permuted_tokens, sorted_indices, probs = ctx.saved_tensors
        _check_unpermute_backward(grad, sorted_indices, probs, ctx.master)
        tokens = permuted_tokens
        if not ctx.master and _fp32_target(permuted_tokens, probs):
            tokens, grad = permuted_tokens.to(torch.float32), grad.to(torch.float32)
        grad_tokens, grad_probs = aclnn("npu_moe_token_unpermute_grad")(
            tokens, grad, sorted_indices, probs, False, None)
        grad_tokens = grad_tokens.to(permuted_tokens.dtype)
        return grad_tokens, None, (grad_probs if probs is not None else None), None, None


def _unpermute_extension(module: types.ModuleType) -> None:
    def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                                probs: torch.Tensor | None = None, padded_mode: bool = False,
                                restore_shape: Sequence[int] | None = None) -> torch.Tensor:
        """npu moe token unpermute"""
        return NPUMoeTokenUnpermute.apply(  # type: ignore[no-any-return]
            permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)

    own(module, [npu_moe_token_unpermute], public=False)


# --------------------------------------------------------------------------- npu_moe_token_permute
# mindspeed/ops/csrc/cann/npu_moe_token_permute.cpp (NPUMoeTokenPermute).


class NPUMoeTokenPermute(torch.autograd.Function):
    """The C++ ``torch::autograd::Function`` of MindSpeed's permute extension."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: Any,
                padded_mode: Any) -> tuple[torch.Tensor, torch.Tensor]:
        master = line() == "master"
        _no_padded_mode(padded_mode)
        if master:
            _dtype_check(tokens, torch.bfloat16, "tokens", "bfloat16")
            _torch_check(indices.dtype in (torch.int64, torch.int32), "Input tensor indices dtype [",
                         _scalar(indices), "] is invalid, should be int64 or int32")
        _dims(tokens, "tokens", 2)
        _torch_check(indices.dim() in (1, 2), "The dims of input indices should be 2 or 1 "
                     "dimensional, but got ", indices.dim(), "-dimensional.")
        topk = 1 if indices.dim() == 1 else indices.size(1)
        flatten = indices.numel()
        requested = int(num_out_tokens or 0)
        rows = min(requested, flatten) if requested > 0 else requested + flatten
        permuted, sorted_indices = aclnn("npu_moe_token_permute")(tokens, indices, rows, False)
        ctx.save_for_backward(sorted_indices)
        ctx.num_tokens, ctx.topk, ctx.master = tokens.size(0), topk, master
        ctx.mark_non_differentiable(sorted_indices)
        return permuted, sorted_indices

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:
        (sorted_indices,) = ctx.saved_tensors
        if ctx.master:
            _dtype_check(grad, torch.bfloat16, "permuted_tokens_grad", "bfloat16")
        _dims(grad, "grad_permuted_tokens", 2)
        # aclnnMoeTokenPermuteGrad(grad, sorted_indices, num_topK, padded_mode): the kernel of
        # torch_npu's permute grad, given the row count and top-k (its _grad_v2 arguments)
        grad_tokens = aclnn("npu_moe_token_permute_grad_v2")(
            grad, sorted_indices, ctx.num_tokens, grad.dtype, ctx.topk, False)
        return grad_tokens, None, None, None


def _permute_extension(module: types.ModuleType) -> None:
    def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor,
                              num_out_tokens: int | None = 0, padded_mode: bool = False
                              ) -> list[torch.Tensor]:
        """npu moe token permute"""
        return list(NPUMoeTokenPermute.apply(tokens, indices, num_out_tokens, padded_mode))

    own(module, [npu_moe_token_permute], public=False)


# --------------------------------------------------------------------------- grouped matmul
# mindspeed/ops/csrc/cann/gmm.cpp: npu_gmm (List[int] group_list: aclnnGroupedMatmulV2, cumulative;
# Tensor group_list: aclnnGroupedMatmulV4 with group_list_type), npu_gmm_backward (dx = gmm(grad,
# w^T), dw = gmm(x^T, grad, group_type 2) reshaped like weight), npu_gmm_backward_fusion (dx only).


def _gmm(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], bias: Sequence[torch.Tensor],
         group_list: Any, group_type: Any, group_list_type: Any) -> list[torch.Tensor]:
    _torch_check(len(x) > 0 and len(weight) > 0, "Neither x nor weight could be empty.")
    if group_list is not None and not isinstance(group_list, torch.Tensor):
        group_list = torch.tensor(list(group_list), dtype=torch.int64, device=x[0].device)
        group_list_type = 0  # aclnnGroupedMatmulV2 takes the cumulative ends
    out = aclnn("npu_grouped_matmul")(
        list(x), list(weight), bias=list(bias) or None, group_list=group_list, split_item=3,
        group_type=-1 if group_type is None else group_type,
        group_list_type=group_list_type or 0)
    return list(out)


def _t(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.transpose(-1, -2) for t in tensors]


def _gmm_extension(module: types.ModuleType) -> None:
    def npu_gmm(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor],
                bias: Sequence[torch.Tensor], group_list: Any = None, group_type: Any = None,
                group_list_type: Any = None) -> list[torch.Tensor]:
        """grouped matmul forward"""
        return _gmm(x, weight, bias, group_list, group_type, group_list_type)

    def npu_gmm_backward(grad: Sequence[torch.Tensor], x: Sequence[torch.Tensor],
                         weight: Sequence[torch.Tensor], group_list: Any = None,
                         group_list_type: Any = None) -> tuple[list[torch.Tensor], ...]:
        """grouped matmul backward"""
        dx = _gmm(grad, _t(weight), [], group_list, 0, group_list_type)
        dw = _gmm(_t(x), grad, [], group_list, 2, group_list_type)
        return dx, [d.reshape(w.shape) for d, w in zip(dw, weight, strict=False)], []

    def npu_gmm_backward_fusion(grad: Sequence[torch.Tensor], weight: Sequence[torch.Tensor],
                                group_list: Any = None, group_list_type: Any = None
                                ) -> tuple[list[torch.Tensor], ...]:
        """grouped matmul backward (dx only: the weight gradient is accumulated elsewhere)"""
        return _gmm(grad, _t(weight), [], group_list, 0, group_list_type), [], []

    own(module, [npu_gmm, npu_gmm_backward, npu_gmm_backward_fusion], public=False)


# --------------------------------------------------------------------------- rotary position embedding
# mindspeed/ops/csrc/cann/npu_rotary_position_embedding.cpp: forward and backward kernels (the
# aclnnRotaryPositionEmbedding pair): the kernel of torch_npu's npu_rotary_mul, mode 0 "half",
# mode 1 "interleave"; its backward kernel is emulated by the reference formula.


class NPURotaryPositionEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: int
                ) -> torch.Tensor:
        rotary_mode = "half" if mode == 0 else "interleave"
        ctx.save_for_backward(x, cos, sin)
        ctx.rotary_mode = rotary_mode
        return aclnn("npu_rotary_mul")(x, cos, sin, rotary_mode)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, cos, sin = ctx.saved_tensors
        ref = reference.get("npu_rotary_mul")
        assert ref is not None and ref.backward is not None
        grads = ref.backward({"self": x, "r1": cos, "r2": sin, "rotary_mode": ctx.rotary_mode},
                             None, grad)
        return grads["self"], grads["r1"], grads["r2"], None


def _rope_extension(module: types.ModuleType) -> None:
    def npu_rotary_position_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                      mode: int = 0) -> torch.Tensor:
        """rotary position embedding"""
        return NPURotaryPositionEmbedding.apply(x, cos, sin, mode)  # type: ignore[no-any-return]

    own(module, [npu_rotary_position_embedding], public=False)


def _ring_extension(module: types.ModuleType) -> None:
    # mindspeed/ops/csrc/cann/npu_ring_attention_update.cpp: the three outputs allocated like
    # the previous ones, aclnnRingAttentionUpdate, returned as a list
    kernel = aclnn("npu_ring_attention_update")

    def npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum,  # type: ignore[no-untyped-def]
                                  cur_attn_out, cur_softmax_max, cur_softmax_sum,
                                  actual_seq_qlen=None, layout="SBH"):
        """npu ring attention update"""
        out = kernel(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out,
                     cur_softmax_max, cur_softmax_sum, actual_seq_qlen=actual_seq_qlen,
                     input_layout=layout or "SBH")
        return list(out)

    own(module, [npu_ring_attention_update], public=False)


def _write_back(grad: torch.Tensor, result: torch.Tensor) -> None:
    """Store a kernel's fp32 accumulation in ``grad``, in place: as fp32 numbers when ``grad``
    is fp32, else as the kernel writes them: fp32 bytes into a buffer of another dtype (as far
    as it reaches; the rest of what the NPU kernel writes lies past its end)."""
    if grad.dtype == result.dtype or not grad.is_contiguous():
        grad.copy_(result)
        return
    raw = grad.view(-1).view(torch.uint8)
    raw.copy_(result.contiguous().view(-1).view(torch.uint8)[: raw.numel()])


def _as_fp32(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as the fp32-only kernel reads it (another dtype's bytes reinterpreted)."""
    return grad if grad.dtype == torch.float32 else reinterpret(grad, torch.float32)


def atb_matmul_add(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> None:
    """ATB's LinearOperation with transposeA and accumulation (mindspeed/ops/csrc/atb/
    matmul_add.cpp): ``C += x.T @ weight`` in place, computed in fp32; ``C`` is read and
    written as fp32 whatever its dtype (the kernel's)."""
    with torch.no_grad():
        _write_back(c, _gemm_ref.matmul_add_fp32(weight, x, _as_fp32(c)))


def atb_groupmatmul_add(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor,
                        grad: torch.Tensor) -> None:
    """ATB's GroupedMatmulInplaceAddOperation (mindspeed/ops/csrc/atb/groupmatmul_add.cpp):
    ``grad`` viewed as (G, K, N) gets ``x[rows_g].T @ weight[rows_g]`` added per group of rows
    (``group_list`` cumulative), in place; computed as torch_npu's grouped matmul add (the
    emulated out-of-place ``torch.ops.npu.npu_grouped_matmul_add``), written back into grad."""
    view = grad.view(group_list.shape[0], x.shape[-1], weight.shape[-1])
    with torch.no_grad():
        _write_back(view, torch.ops.npu.npu_grouped_matmul_add(view, x, weight, group_list))


def _matmul_add_extension(module: types.ModuleType) -> None:
    def npu_matmul_add_fp32(x, weight, C):  # type: ignore[no-untyped-def]  # noqa: N803 - the binding's name
        """matmul_add on ascend device"""
        atb_matmul_add(x, weight, C)

    own(module, [npu_matmul_add_fp32], public=False)


def _groupmatmul_add_extension(module: types.ModuleType) -> None:
    def npu_groupmatmul_add_fp32(x, weight, group_list, grad):  # type: ignore[no-untyped-def]
        """matmul_add on ascend device"""
        atb_groupmatmul_add(x, weight, group_list, grad)

    own(module, [npu_groupmatmul_add_fp32], public=False)


# --------------------------------------------------------------------------- load


EXTENSIONS: dict[str, Callable[[types.ModuleType], None]] = {
    "npu_moe_token_unpermute": _unpermute_extension,
    "npu_moe_token_permute": _permute_extension,
    "grouped_matmul": _gmm_extension,
    "grouped_matmul_v2": _gmm_extension,  # gmm.cpp built again (GMMV2OpBuilder)
    "npu_rotary_position_embedding": _rope_extension,
    "npu_ring_attention_update": _ring_extension,
    "npu_matmul_add_fp32": _matmul_add_extension,
    "npu_groupmatmul_add_fp32": _groupmatmul_add_extension,
}
"""The extensions by the name their builder gives ``torch.utils.cpp_extension.load``."""


def load(name: str) -> types.ModuleType:
    """What ``torch.utils.cpp_extension.load(name=name, sources=...)`` returns for MindSpeed's
    builder ``name``: a fresh module (not in ``sys.modules``) with the functions its ``.cpp``
    binds.  KeyError for an extension the emulation does not build."""
    module = types.ModuleType(name, f"opcontracts emulation of MindSpeed's JIT-built {name} "
                              "extension (C++ calling aclnn).")
    module.__file__ = f"<torch_extensions>/{name}/{name}.so"
    module.__opcontracts_emulation__ = True  # type: ignore[attr-defined]
    EXTENSIONS[name](module)
    return module


# --------------------------------------------------------------------------- the JIT compiler
# A real MindSpeed on sys.path (its op_builder/builder.py) builds its extensions with
# ``torch.utils.cpp_extension.load(name=OP_NAME, sources=[ops/csrc/cann/*.cpp], ...)``, imported
# by name when builder.py is imported.  While the emulation is installed that ``load`` returns
# the emulated extension of a name it builds (:data:`EXTENSIONS`) and compiles anything else as
# torch does (without CANN's headers that fails, as on a machine without CANN).  The builder
# also reads the CANN root from ``ASCEND_HOME_PATH`` and, for its ATB ops (matmul add), the
# NNAL root from ``ATB_HOME_PATH`` (set_env.sh of CANN and of cann-nnal set them on an NPU
# machine); unset, the emulated machine's roots are this package's folder, which has no headers:
# only the emulated extensions load.

CANN_ROOT_VAR = "ASCEND_HOME_PATH"
ROOT_VARS = (CANN_ROOT_VAR, "ATB_HOME_PATH")
_compiler: dict[str, Any] = {}


def _load(name: str, sources: Any = None, *args: Any, **kwargs: Any) -> Any:
    if name in EXTENSIONS:
        return load(name)
    return _compiler["load"](name, sources, *args, **kwargs)


def install_compiler() -> None:
    """``torch.utils.cpp_extension.load`` serves the emulated extensions; ``ASCEND_HOME_PATH``
    and ``ATB_HOME_PATH`` name the emulated roots when unset (put back by
    :func:`uninstall_compiler`)."""
    import os

    import torch.utils.cpp_extension as cpp_extension

    if _compiler:
        return
    _compiler["load"] = cpp_extension.load
    cpp_extension.load = _load  # type: ignore[assignment]
    root = os.path.dirname(os.path.abspath(__file__))
    _compiler["roots"] = [var for var in ROOT_VARS if not os.environ.get(var)]
    for var in _compiler["roots"]:
        os.environ[var] = root
    _compiler["root"] = root


def uninstall_compiler() -> None:
    import os

    import torch.utils.cpp_extension as cpp_extension

    if not _compiler:
        return
    if cpp_extension.load is _load:
        cpp_extension.load = _compiler["load"]
    for var in _compiler.get("roots", ()):
        if os.environ.get(var) == _compiler["root"]:
            del os.environ[var]
    _compiler.clear()
