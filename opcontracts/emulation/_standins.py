"""Stand-in ``torch_npu`` and ``mindspeed`` modules, served by a ``sys.meta_path`` finder.

The modules are real imports: a finder returns a ``ModuleSpec`` with a loader that builds
the module in ``exec_module``. So ``import mindspeed.ops.gmm`` and
``from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute`` go through the
normal import system, and other import hooks (a patcher that wraps loaders, say) see these
imports like any other. The finder sits just before ``PathFinder``: hooks inserted at the
front of ``sys.meta_path`` (before or after ``install()``) run first.

A real MindSpeed is never shadowed: when ``import mindspeed`` finds a ``mindspeed`` package
on ``sys.path`` (a test file inside a MindSpeed checkout, a ``pip install -e`` of it), the real
package and every module below it are imported, and MindSpeed's own Python (its
``megatron_adaptor``, which patches Megatron, its ``mindspeed.ops``) runs on the emulated
torch_npu; its JIT-built extensions are the emulation's (``_jit``, through
``torch.utils.cpp_extension.load``).  The stand-in ``mindspeed`` serves only where no real one
is importable.

Every module built here carries ``__opcontracts_emulation__ = True``; each load creates fresh
function objects, so patches applied to one install do not leak into the next.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..reference import _fam_gemm_comm as _gemm_ref
from ..reference._attention import npu_ring_attention_update as _ring_reference
from . import _jit, _surface
from . import _standin_gmm_util as _gmm_util
from ._naming import own as _own
from ._ops import NAMESPACE, OP_NAMES

__all__ = ["MARKER", "MODULE_NAMES", "StandinFinder", "is_standin", "real_mindspeed"]

MARKER = "__opcontracts_emulation__"

_MC2_PACKAGES = ("mindspeed.core.transformer", "mindspeed.core.transformer.moe",
                 "mindspeed.core.transformer.moe.moe_feature",
                 "mindspeed.core.transformer.moe.moe_feature.mc2moe",
                 "mindspeed.core.tensor_parallel", "mindspeed.core.tensor_parallel.mc2_feature")
_PACKAGES = ("torch_npu", "mindspeed", "mindspeed.ops", "mindspeed.op_builder", "mindspeed.core",
             "mindspeed.core.fusions", "mindspeed.te", "mindspeed.te.pytorch", *_MC2_PACKAGES,
             *_surface.PACKAGES)


def is_standin(module: object) -> bool:
    """Whether ``module`` was built by this emulation."""
    return getattr(module, MARKER, False) is True


def _npu() -> Any:
    """``torch.ops.npu``, resolved at each call so dispatcher-level wrappers are honoured."""
    return getattr(torch.ops, NAMESPACE)


# --------------------------------------------------------------------------- MindSpeed functions
# The signatures below equal MindSpeed's (see the facts file's MindSpeed table) and are left
# unannotated on purpose: ``str(inspect.signature(f))`` must read exactly like the table.


# MindSpeed's lines (``_jit.MINDSPEED_LINES``): what its C++ extensions check.
MINDSPEED_LINES = _jit.MINDSPEED_LINES
set_line = _jit.set_line


# --------------------------------------------------------------------------- MindSpeed's op builders
# mindspeed/op_builder/builder.py and the builders of the ops the stand-ins emulate
# (npu_moe_token_(un)permute_builder.py, gmm_builder.py, npu_rotary_position_embedding_builder.py):
# ``load()`` returns the JIT-built extension (``_jit.load``), cached per builder name as
# MindSpeed's ``_loaded_ops``; ``AS_LIBRARY`` is the emulation's ``Library("mindspeed", "DEF")``
# (``_jit.library()``, owned by install / uninstall).


def _op_builder_base(module: types.ModuleType) -> list[Any]:
    module.ASCEND_HOME_PATH = "ASCEND_HOME_PATH"  # type: ignore[attr-defined]
    module.AS_LIBRARY = _jit.library()  # type: ignore[attr-defined]

    class MindSpeedOpBuilder:
        _loaded_ops: dict[str, Any] = {}

        def __init__(self, name):  # type: ignore[no-untyped-def]
            self.name = name

        def register_op_proto(self, op_proto):  # type: ignore[no-untyped-def]
            if isinstance(op_proto, str):
                op_proto = [op_proto]
            for proto in op_proto:
                module.AS_LIBRARY.define(proto)  # type: ignore[attr-defined]

        def sources(self):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def load(self, verbose=True):  # type: ignore[no-untyped-def]
            if self.name in MindSpeedOpBuilder._loaded_ops:
                return MindSpeedOpBuilder._loaded_ops[self.name]
            op_module = _jit.load(self.name)  # torch.utils.cpp_extension.load(name=self.name, ...)
            MindSpeedOpBuilder._loaded_ops[self.name] = op_module
            return op_module

    return [MindSpeedOpBuilder]


_GMM_PROTO: tuple[str, ...] = (
    "npu_gmm.Tensor(Tensor original_weight, Tensor x, Tensor weight, *, Tensor? bias=None, Tensor? group_list=None, int? group_type=0, bool? gemm_fusion=False) -> Tensor",
    "npu_gmm.List(Tensor original_weight, Tensor x, Tensor weight, *, Tensor? bias=None, int[]? group_list=None, int? group_type=0, bool? gemm_fusion=False) -> Tensor",
)
_GMM_V2_PROTO: tuple[str, ...] = (
    "npu_gmm_v2.Tensor(Tensor original_weight, Tensor x, Tensor weight, *, Tensor? bias=None, Tensor? group_list=None, int? group_type=0, bool? gemm_fusion=False) -> Tensor",
)
"""gmm_builder.py's OP_PROTO (MindSpeed master 028de58ca629), verbatim."""


def _gmm_meta(original_weight, x, weight, *, bias=None, group_list=None, group_type=0, gemm_fusion=False):  # type: ignore[no-untyped-def]
    """gmm_builder.py's Meta kernel (``register_op_ir``)."""
    return x.new_empty((x.shape[0], weight.shape[-1]), dtype=x.dtype)


def _op_builders() -> list[Any]:
    from mindspeed.op_builder.builder import AS_LIBRARY, MindSpeedOpBuilder  # type: ignore[import-not-found]

    def one_source(class_name: str, op: str) -> type:
        """A builder of one CANN source file, ``ops/csrc/cann/<op>.cpp`` (MindSpeed writes each
        out as a class of its own: ``OP_NAME``, ``__init__``, ``sources``)."""

        def __init__(self):  # type: ignore[no-untyped-def]
            MindSpeedOpBuilder.__init__(self, self.OP_NAME)

        def sources(self):  # type: ignore[no-untyped-def]
            return [f"ops/csrc/cann/{self.OP_NAME}.cpp"]

        return type(class_name, (MindSpeedOpBuilder,),
                    {"OP_NAME": op, "__init__": __init__, "sources": sources,
                     "__module__": __name__, "__qualname__": class_name})

    MoeTokenUnpermuteOpBuilder = one_source("MoeTokenUnpermuteOpBuilder", "npu_moe_token_unpermute")
    MoeTokenPermuteOpBuilder = one_source("MoeTokenPermuteOpBuilder", "npu_moe_token_permute")
    RotaryPositionEmbeddingOpBuilder = one_source("RotaryPositionEmbeddingOpBuilder",
                                                  "npu_rotary_position_embedding")

    class GMMOpBuilder(MindSpeedOpBuilder):  # type: ignore[misc]
        OP_NAME = "grouped_matmul"
        OP_PROTO = _GMM_PROTO

        def __init__(self):  # type: ignore[no-untyped-def]
            super().__init__(self.OP_NAME)
            self.register_op_proto(self.OP_PROTO)
            self.register_op_ir()

        def sources(self):  # type: ignore[no-untyped-def]
            return ["ops/csrc/cann/gmm.cpp", "ops/csrc/flop_counter/flop_counter.cpp"]

        def register_op_ir(self):  # type: ignore[no-untyped-def]
            AS_LIBRARY.impl("npu_gmm.Tensor", _gmm_meta, "Meta")  # (and torchair's converter)

    class GMMV2OpBuilder(GMMOpBuilder):
        OP_NAME = "grouped_matmul_v2"
        OP_PROTO = _GMM_V2_PROTO

        def register_op_ir(self):  # type: ignore[no-untyped-def]
            AS_LIBRARY.impl("npu_gmm_v2.Tensor", _gmm_meta, "Meta")

    return [MoeTokenUnpermuteOpBuilder, MoeTokenPermuteOpBuilder, RotaryPositionEmbeddingOpBuilder,
            GMMOpBuilder, GMMV2OpBuilder]


# --------------------------------------------------------------------------- mindspeed.ops over them
# The Python of mindspeed/ops/npu_moe_token_(un)permute.py, gmm.py and
# npu_rotary_position_embedding.py (MindSpeed master 028de58ca629): a module-level builder, the
# extension loaded at each call.  The signatures equal MindSpeed's (the facts file's MindSpeed
# table) and are left unannotated on purpose: ``str(inspect.signature(f))`` must read exactly
# like the table.


def _unpermute_module(module: types.ModuleType) -> list[Any]:
    from mindspeed.op_builder import MoeTokenUnpermuteOpBuilder  # type: ignore[import-not-found]

    module.moe_token_unpermute_op_builder = MoeTokenUnpermuteOpBuilder()  # type: ignore[attr-defined]

    def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):  # type: ignore[no-untyped-def]
        """MindSpeed's unpermute: its JIT-built extension (``_jit``: on ``master`` MindSpeed's
        own bf16 / int32 checks, forward and backward; on ``core_r0.8.0`` ranks only, and an
        fp32 cast when probs is fp32), which calls the CANN kernel directly."""
        moe_token_unpermute_ops = module.moe_token_unpermute_op_builder.load()  # type: ignore[attr-defined]
        return moe_token_unpermute_ops.npu_moe_token_unpermute(
            permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)

    return [npu_moe_token_unpermute]


def _permute_module(module: types.ModuleType) -> list[Any]:
    from mindspeed.op_builder import MoeTokenPermuteOpBuilder  # type: ignore[import-not-found]

    module.moe_token_permute_op_builder = MoeTokenPermuteOpBuilder()  # type: ignore[attr-defined]

    def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):  # type: ignore[no-untyped-def]
        """MindSpeed's permute: its JIT-built extension (``_jit``; on ``master`` bf16 tokens and
        int64 / int32 indices checked, forward and backward)."""
        moe_token_permute_ops = module.moe_token_permute_op_builder.load()  # type: ignore[attr-defined]
        return moe_token_permute_ops.npu_moe_token_permute(tokens, indices, num_out_tokens, padded_mode)

    return [npu_moe_token_permute]


def _rope_module(module: types.ModuleType) -> list[Any]:
    from mindspeed.op_builder import RotaryPositionEmbeddingOpBuilder  # type: ignore[import-not-found]

    module.rope_op_builder = RotaryPositionEmbeddingOpBuilder()  # type: ignore[attr-defined]

    def npu_rotary_position_embedding(x, cos, sin, mode=0):  # type: ignore[no-untyped-def]
        """MindSpeed's RoPE (its JIT-built extension): mode 0 rotates halves, mode 1
        interleaved pairs (the kernel of ``npu_rotary_mul``)."""
        rope_ops = module.rope_op_builder.load()  # type: ignore[attr-defined]
        return rope_ops.npu_rotary_position_embedding(x, cos, sin, mode)

    return [npu_rotary_position_embedding]


def _gmm_module(module: types.ModuleType) -> list[Any]:
    """mindspeed/ops/gmm.py: ``npu_gmm`` checks its arguments in Python and calls
    ``torch.ops.mindspeed.npu_gmm`` (``_v2``), whose kernel (registered here for PrivateUse1
    as MindSpeed does, and for CPU: the emulation's tensors) runs ``GMMFunction`` over the JIT
    extension.  No Autograd kernel: torch's autograd fallback, as on the NPU."""
    from mindspeed.op_builder import GMMOpBuilder, GMMV2OpBuilder  # type: ignore[import-not-found]
    from mindspeed.op_builder.builder import AS_LIBRARY  # type: ignore[import-not-found]
    from mindspeed.ops.npu_groupmatmul_add import npu_groupmatmul_add_fp32  # type: ignore[import-not-found]

    def check_optional_tensor(tensor, device, name):  # type: ignore[no-untyped-def]
        if not isinstance(tensor, (torch.Tensor, type(None))):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(tensor)}.")
        if isinstance(tensor, torch.Tensor) and tensor.device != device:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{device}(arg0) and {tensor.device}({name})!")

    class GMMFunction(torch.autograd.Function):
        builder = GMMOpBuilder()
        builder2 = GMMV2OpBuilder()

        @staticmethod
        def forward(ctx, original_weight, x, weight, bias, group_args):  # type: ignore[no-untyped-def]
            group_list, group_type, gemm_fusion, group_list_type, group_list_data_type = group_args
            if bias is not None and bias.requires_grad:
                raise ValueError("Bias is not supported to compute gradient!")
            if (x.requires_grad or weight.requires_grad) and group_type != 0:
                raise ValueError("group_type must be zero to compute gradients of x and weight!")
            bias = [] if bias is None else [bias]
            if group_list_type == 0:
                outputs = GMMFunction.builder.load().npu_gmm([x], [weight], bias, group_list, group_type, group_list_type)
            elif group_list_type == 1:
                outputs = GMMFunction.builder2.load().npu_gmm([x], [weight], bias, group_list, group_type, group_list_type)
            if group_list_data_type == 0:
                ctx.save_for_backward(x, weight, original_weight)
                ctx.group_list = group_list
            else:
                ctx.save_for_backward(x, weight, group_list, original_weight)
            ctx.gemm_fusion = gemm_fusion
            ctx.group_list_type = group_list_type
            ctx.group_list_data_type = group_list_data_type
            return outputs[0]

        @staticmethod
        def backward(ctx, grad_outputs):  # type: ignore[no-untyped-def]
            if ctx.group_list_data_type == 0:
                x, weight, original_weight = ctx.saved_tensors
                group_list = ctx.group_list
            else:
                x, weight, group_list, original_weight = ctx.saved_tensors
            builder = GMMFunction.builder if ctx.group_list_type == 0 else GMMFunction.builder2
            if ctx.gemm_fusion:
                dx, _, dbias = builder.load().npu_gmm_backward_fusion(
                    [grad_outputs], [weight], group_list, ctx.group_list_type)
                cumulative = group_list if ctx.group_list_type == 0 else torch.cumsum(group_list, dim=0)
                npu_groupmatmul_add_fp32(x, grad_outputs, cumulative, original_weight.main_grad)
                dbias = None if len(dbias) == 0 else dbias[0]
                if hasattr(original_weight, "grad_added_to_main_grad"):
                    grad_weight = torch.zeros(weight.shape, dtype=x.dtype, device=x.device,
                                              requires_grad=False)  # MindSpeed: on the current device
                    original_weight.grad_added_to_main_grad = True
                else:
                    grad_weight = None
                return None, dx[0], grad_weight, dbias, None
            dx, dw, dbias = builder.load().npu_gmm_backward(
                [grad_outputs], [x], [weight], group_list, ctx.group_list_type)
            dbias = None if len(dbias) == 0 else dbias[0]
            return None, dx[0], dw[0], dbias, None

    def npu_gmm_param_verification(x, weight, *, bias=None, group_list=None, group_type=0, group_list_type=0):  # type: ignore[no-untyped-def]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"arg0 must be a torch.Tensor, got {type(x)}.")
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"arg1 must be a torch.Tensor, got {type(weight)}.")
        if not isinstance(bias, (torch.Tensor, type(None))):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias)}.")
        if group_list_type == 0:
            if not (
                isinstance(group_list, (torch.Tensor, type(None)))
                or (isinstance(group_list, list) and all(isinstance(x, int) for x in group_list))
            ):
                raise TypeError(f"group_list must be a List of int64, torch.Tensor or None, got {type(group_list)}.")
        else:
            if not (isinstance(group_list, (torch.Tensor, type(None)))):
                raise TypeError(f"group_list must be a torch.Tensor or None, got {type(group_list)}.")
        if isinstance(group_list, torch.Tensor):
            if len(group_list.shape) > 1:
                raise ValueError(f"If group_list is not None, it must be an one-dimensional tensor, "
                                 f"got dimension of group_list: {len(group_list.shape)}!")
            if group_list.dtype != torch.int64:
                raise TypeError(f"group_list must be a List of int64, got group_list type: {type(group_list)}, "
                                f"dtype: {group_list.dtype}!")
        if not isinstance(group_type, (int, type(None))):
            raise TypeError(f"group_type must be an int or None, got {type(group_type)}.")
        x_device = x.device
        device_warning = "Expected all tensors to be on the same device, but found at least two devices"
        if weight.device != x_device:
            raise RuntimeError(f"{device_warning}, {x_device}(arg0) and {weight.device}(arg1)!")
        if bias is not None and bias.device != x_device:
            raise RuntimeError(f"{device_warning}, {x_device}(arg0) and {bias.device}(bias)!")
        if isinstance(group_list, torch.Tensor) and group_list.device != x_device:
            raise RuntimeError(f"{device_warning}, {x_device}(arg0) and {group_list.device}(group_list)!")

    def _npu_gmm_common(original_weight, x, weight, *, bias=None, group_list=None, group_type=0, group_list_type=0, gemm_fusion=False):  # type: ignore[no-untyped-def]
        support_dtype = [torch.float16, torch.bfloat16, torch.float32]
        if weight.dtype not in support_dtype:
            raise TypeError(f"Only support non quant case, but got weight dtype {weight.dtype}.")
        npu_gmm_param_verification(x, weight, bias=bias, group_list=group_list, group_type=group_type,
                                   group_list_type=group_list_type)
        if group_list_type == 0:
            return torch.ops.mindspeed.npu_gmm(original_weight, x, weight, bias=bias, group_list=group_list, group_type=group_type, gemm_fusion=gemm_fusion)
        elif group_list_type == 1:
            return torch.ops.mindspeed.npu_gmm_v2(original_weight, x, weight, bias=bias, group_list=group_list, group_type=group_type, gemm_fusion=gemm_fusion)
        else:
            raise ValueError(f"group_list_type must be 0 or 1, but got {group_list_type}.")

    def _npu_gmm(original_weight, x, weight, *, bias=None, group_list=None, group_type=0, gemm_fusion=False):  # type: ignore[no-untyped-def]
        if isinstance(group_list, (torch.Tensor, type(None))):
            group_list_data_type = 1
        else:
            group_list_data_type = 0
        group_args = (group_list, group_type, gemm_fusion, 0, group_list_data_type)
        return GMMFunction.apply(original_weight, x, weight, bias, group_args)

    def npu_gmm(x, weight, *, bias=None, group_list=None, group_type=0, gemm_fusion=False, original_weight=None):  # type: ignore[no-untyped-def]
        """MindSpeed's grouped matmul: ``group_list`` holds cumulative row ends
        (``torch.ops.mindspeed.npu_gmm``)."""
        return _npu_gmm_common(original_weight, x, weight, bias=bias, group_list=group_list, group_type=group_type, group_list_type=0, gemm_fusion=gemm_fusion)

    def _npu_gmm_v2(original_weight, x, weight, *, bias=None, group_list=None, group_type=0, gemm_fusion=False):  # type: ignore[no-untyped-def]
        group_args = (group_list, group_type, gemm_fusion, 1, 1)
        return GMMFunction.apply(original_weight, x, weight, bias, group_args)

    def npu_gmm_v2(x, weight, *, bias=None, group_list=None, group_type=0, gemm_fusion=False, original_weight=None):  # type: ignore[no-untyped-def]
        """Like :func:`npu_gmm`, but ``group_list`` holds per-group row counts
        (``torch.ops.mindspeed.npu_gmm_v2``)."""
        return _npu_gmm_common(original_weight, x, weight, bias=bias, group_list=group_list, group_type=group_type, group_list_type=1, gemm_fusion=gemm_fusion)

    # @impl(AS_LIBRARY, "npu_gmm.List" / "npu_gmm.Tensor" / "npu_gmm_v2.Tensor", "PrivateUse1")
    for key in ("PrivateUse1", "CPU"):
        AS_LIBRARY.impl("npu_gmm.List", _npu_gmm, key)
        AS_LIBRARY.impl("npu_gmm.Tensor", _npu_gmm, key)
        AS_LIBRARY.impl("npu_gmm_v2.Tensor", _npu_gmm_v2, key)
    helpers = [check_optional_tensor, GMMFunction, npu_gmm_param_verification, _npu_gmm_common,
               _npu_gmm, _npu_gmm_v2]
    _own(module, helpers, public=False)  # not in __all__: MindSpeed's lists npu_gmm, npu_gmm_v2
    return [npu_gmm, npu_gmm_v2]


def npu_fusion_attention(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None, scale=1., keep_prob=1., pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None):  # type: ignore[no-untyped-def]
    """MindSpeed's fusion attention v2 (``mindspeed.ops.fusion_attention_v2``: a JIT-built op over
    the CANN v2 flash-attention kernels; emulated by ``torch.ops.npu.npu_fusion_attention_v2``,
    whose autograd calls the v2 grad kernel, as MindSpeed's FusionAttentionV2Function does)."""
    return _npu().npu_fusion_attention_v2(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        sparse_mode=sparse_mode, gen_mask_parallel=gen_mask_parallel, sync=sync,
        pse_type=pse_type, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)


def npu_fusion_attention_grad(query, key, value, grad_outputs, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, scale=1., keep_prob=1., pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, seed=1234, offset=0, numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None):  # type: ignore[no-untyped-def]
    """MindSpeed's fusion attention v2 backward: (dq, dk, dv, dpse), dpse None without pse (the
    v2 grad kernel, ``torch.ops.npu.npu_fusion_attention_grad_v2``)."""
    dq, dk, dv, dpse, *_ = _npu().npu_fusion_attention_grad_v2(
        query, key, value, grad_outputs, head_num, input_layout, pse=pse,
        padding_mask=padding_mask, atten_mask=atten_mask, softmax_max=softmax_max,
        softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        scale_value=scale, keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, seed=seed, offset=offset, numels=numels, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        sparse_mode=sparse_mode, gen_mask_parallel=gen_mask_parallel, sync=sync,
        pse_type=pse_type, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)
    return dq, dk, dv, (dpse if pse is not None else None)


def npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max, cur_softmax_sum, actual_seq_qlen=None, layout="SBH"):  # type: ignore[no-untyped-def]
    """Merge two partial attention results by their softmax statistics (plain PyTorch: MindSpeed's
    reference, ``opcontracts.reference``).

    Layout "SBH": attn_out (S, B, H), stats (B, N, S, 8); layout "TND": attn_out (T, N, D),
    stats (T, N, 8). Returns (attn_out, softmax_max, softmax_sum).
    """
    return _ring_reference(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out,
                           cur_softmax_max, cur_softmax_sum, actual_seq_qlen, layout)


def fused_swiglu(x):  # type: ignore[no-untyped-def]
    """MindSpeed's ``mindspeed.core.fusions.fused_bias_swiglu.fused_swiglu``: ``npu_swiglu(x, dim=-1)``."""
    return _npu().npu_swiglu(x, dim=-1)


def _swiglu_classes(module: types.ModuleType) -> list[type]:
    """MindSpeed's ``SwiGLUFunction`` / ``BiasSwiGLUFunction`` (plain classes with a static
    ``apply``): they call the module's ``fused_swiglu`` by name at call time, as MindSpeed's
    do, so a guard set on that attribute sees their calls."""

    class SwiGLUFunction:
        @staticmethod
        def apply(x, *args):  # type: ignore[no-untyped-def]
            return module.fused_swiglu(x)

    class BiasSwiGLUFunction:
        @staticmethod
        def apply(x, bias, *args):  # type: ignore[no-untyped-def]
            return module.fused_swiglu(x + bias)

    for cls in (SwiGLUFunction, BiasSwiGLUFunction):
        cls.__module__ = module.__name__
        cls.__qualname__ = cls.__name__
    return [SwiGLUFunction, BiasSwiGLUFunction]


def npu_matmul_add_fp32(total_input, grad_output, grad):  # type: ignore[no-untyped-def]
    """MindSpeed's gradient accumulation into an fp32 main_grad (``mindspeed.ops.npu_matmul_add``,
    the ATB LinearOperation with transposeA and accumulation): ``grad += grad_output.T @
    total_input``, in place, computed in fp32; returns None, and does nothing for empty inputs,
    as MindSpeed's.  ``grad`` is read and written as fp32 whatever its dtype (the kernel's)."""
    for dim in total_input.shape:
        if dim == 0:
            return
    for dim in grad_output.shape:
        if dim == 0:
            return
    _jit.atb_matmul_add(grad_output, total_input, grad)


def npu_matmul_add_fp16(total_input, grad_output, grad):  # type: ignore[no-untyped-def]
    """MindSpeed's plain-PyTorch variant for fp16 / bf16 main_grads (no kernel of its own)."""
    for dim in total_input.shape:
        if dim == 0:
            return
    for dim in grad_output.shape:
        if dim == 0:
            return
    with torch.no_grad():  # as MindSpeed calls it: inside backward, where grad mode is off
        grad_weight = grad_output.t().matmul(total_input)
        grad.add_(grad_weight)


def npu_groupmatmul_add_fp32(x, dy, grouplist, grad):  # type: ignore[no-untyped-def]
    """MindSpeed's grouped gradient accumulation (``mindspeed.ops.npu_groupmatmul_add``):
    ``grad`` viewed as (G, K, N) gets ``x[rows_g].T @ dy[rows_g]`` added per group of rows
    (``grouplist`` cumulative), in place; returns None.  As MindSpeed on Ascend 950 (the ATB
    kernel of A2/A3 computes the same): through torch_npu's grouped matmul add, here the
    emulated out-of-place ``torch.ops.npu.npu_grouped_matmul_add``, written back into grad."""
    _jit.atb_groupmatmul_add(x, dy, grouplist, grad)


# --------------------------------------------------------------------------- MindSpeed's MC2
# mindspeed/ops/grouped_matmul_mc2.py (MindSpeed master): the autograd.Functions and the
# functions that call them, over the emulated communication fusions.  The process group is
# whatever the caller passes: a torch.distributed group, or the reference's LoopbackGroup (one
# process; its collectives are the emulated ops' loopback).  Built fresh for each load of the
# module, so a guard set on one install's classes does not outlive it.


def _expert_weight_grad(x: torch.Tensor, dy: torch.Tensor, group_list: Any) -> torch.Tensor:
    """The experts' weight gradient MindSpeed's MC2 backwards compute: a K-split grouped matmul
    of ``x.T`` and ``dy`` over ``group_list`` (counts), through the guarded torch_npu op."""
    return _npu().npu_grouped_matmul([x.T], [dy], bias=None, group_list=group_list,  # type: ignore[no-any-return]
                                     split_item=3, group_type=2, group_list_type=1)[0]


def _grouped_matmul_mc2(module: types.ModuleType) -> list[Any]:
    """AllToAllGroupedMatmul / GroupedMatmulAllToAll and all2all_grouped_matmul /
    grouped_matmul_all2all, as MindSpeed writes them (the functions look the classes up in
    ``module`` at call time, as MindSpeed's do in theirs)."""

    class AllToAllGroupedMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inputs, weights, group, send_counts, recv_counts, shared_inputs, shared_weight):  # type: ignore[no-untyped-def]
            hcomm, ep_world_size = _gemm_ref.group_info(group)
            group_list_tensor = send_counts.reshape(ep_world_size, -1).sum(dim=0)
            send_counts = send_counts.tolist()
            recv_counts = recv_counts.tolist()
            output, shared_output, permute_output = _npu().npu_alltoallv_gmm(
                inputs, weights, hcomm, ep_world_size, send_counts, recv_counts,
                mm_x=shared_inputs, mm_weight=shared_weight, permute_out_flag=True)
            ctx.save_for_backward(weights, shared_inputs, shared_weight, permute_output)
            ctx.hcomm, ctx.ep_world_size = hcomm, ep_world_size
            ctx.send_counts, ctx.recv_counts = send_counts, recv_counts
            ctx.group_list_tensor = group_list_tensor
            return output, shared_output

        @staticmethod
        def backward(ctx, *grad_output):  # type: ignore[no-untyped-def]
            output_grad, shared_output_grad = grad_output
            weights, shared_inputs, shared_weight, permute_output = ctx.saved_tensors
            inputs_grad, shared_inputs_grad = _npu().npu_gmm_alltoallv(
                output_grad, weights, ctx.hcomm, ctx.ep_world_size, ctx.recv_counts,
                ctx.send_counts, mm_x=shared_output_grad, mm_weight=shared_weight,
                trans_gmm_weight=True)
            weights_grad = _expert_weight_grad(permute_output, output_grad, ctx.group_list_tensor)
            shared_weight_grad = (None if shared_inputs is None
                                  else torch.matmul(shared_inputs.T, shared_output_grad))
            return inputs_grad, weights_grad, None, None, None, shared_inputs_grad, shared_weight_grad

    class GroupedMatmulAllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inputs, weights, group, send_counts, recv_counts, shared_inputs, shared_weight):  # type: ignore[no-untyped-def]
            hcomm, ep_world_size = _gemm_ref.group_info(group)
            group_list_tensor = send_counts.reshape(ep_world_size, -1).sum(dim=0)
            send_counts = send_counts.tolist()
            recv_counts = recv_counts.tolist()
            output, shared_output = _npu().npu_gmm_alltoallv(
                inputs, weights, hcomm, ep_world_size, send_counts, recv_counts,
                mm_x=shared_inputs, mm_weight=shared_weight)
            ctx.save_for_backward(inputs, weights, shared_inputs, shared_weight)
            ctx.hcomm, ctx.ep_world_size = hcomm, ep_world_size
            ctx.send_counts, ctx.recv_counts = send_counts, recv_counts
            ctx.group_list_tensor = group_list_tensor
            return output, shared_output

        @staticmethod
        def backward(ctx, *grad_output):  # type: ignore[no-untyped-def]
            output_grad, shared_output_grad = grad_output
            inputs, weights, shared_inputs, shared_weight = ctx.saved_tensors
            inputs_grad, shared_inputs_grad, permute_grad = _npu().npu_alltoallv_gmm(
                output_grad, weights, ctx.hcomm, ctx.ep_world_size, ctx.recv_counts,
                ctx.send_counts, mm_x=shared_output_grad, mm_weight=shared_weight,
                permute_out_flag=True, trans_gmm_weight=True)
            weights_grad = _expert_weight_grad(inputs, permute_grad, ctx.group_list_tensor)
            shared_weight_grad = (None if shared_inputs is None
                                  else torch.matmul(shared_inputs.T, shared_output_grad))
            return inputs_grad, weights_grad, None, None, None, shared_inputs_grad, shared_weight_grad

    def all2all_grouped_matmul(inputs, weights, group, send_counts, recv_counts, shared_inputs=None, shared_weight=None):  # type: ignore[no-untyped-def]
        output = module.AllToAllGroupedMatmul.apply(inputs, weights, group, send_counts, recv_counts, shared_inputs, shared_weight)
        if shared_inputs is not None:
            return output[0], output[1]  # experts output and shared experts outputs
        return output[0]

    def grouped_matmul_all2all(inputs, weights, group, send_counts, recv_counts, shared_inputs=None, shared_weight=None):  # type: ignore[no-untyped-def]
        output = module.GroupedMatmulAllToAll.apply(inputs, weights, group, send_counts, recv_counts, shared_inputs, shared_weight)
        if shared_inputs is not None:
            return output[0], output[1]  # experts output and shared experts outputs
        return output[0]

    return [AllToAllGroupedMatmul, GroupedMatmulAllToAll, all2all_grouped_matmul,
            grouped_matmul_all2all]


def _mc2_fuse_a2a() -> list[Any]:
    """AlltoallvPermuteGmm / GmmUnpermuteAlltoallv of
    mindspeed/core/transformer/moe/moe_feature/mc2moe/mc2_fuse_a2a.py (Megatron MoE with
    --moe-alltoall-mc2), as MindSpeed writes them; ``rearrange(w, 'n h f -> n f h')`` is the
    transpose it is."""

    class AlltoallvPermuteGmm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gmm1_inputs, weight1, ep_group, group_list, share_cached_fc1_input, share_expert_weight1, use_shared_experts=False, send_counts=None, recv_counts=None):  # type: ignore[no-untyped-def]
            if send_counts is None or recv_counts is None:
                raise AssertionError('Please check your comm input!!!')
            if use_shared_experts:
                mm_x = share_cached_fc1_input
            else:
                mm_x = None
                share_expert_weight1 = None
            hcom_info, ep_world_size = _gemm_ref.group_info(ep_group)
            mm1_out, shared_expert_mm1_out, permute2_out = _npu().npu_alltoallv_gmm(
                gmm_x=gmm1_inputs, gmm_weight=weight1, hcom=hcom_info,
                ep_world_size=ep_world_size, send_counts=send_counts, recv_counts=recv_counts,
                send_counts_tensor=None, recv_counts_tensor=None, mm_x=mm_x,
                mm_weight=share_expert_weight1, trans_gmm_weight=False, trans_mm_weight=False,
                permute_out_flag=True)
            ctx.save_for_backward(weight1, permute2_out, gmm1_inputs, share_expert_weight1)
            ctx.use_shared_experts = use_shared_experts
            ctx.group_list = group_list
            ctx.send_counts, ctx.recv_counts = send_counts, recv_counts
            ctx.ep_world_size, ctx.hcom_info = ep_world_size, hcom_info
            return mm1_out, shared_expert_mm1_out

        @staticmethod
        def backward(ctx, mm1_out_grad, shared_expert_mm1_out_grad):  # type: ignore[no-untyped-def]
            weight1, permute2_out, gmm1_inputs, share_expert_weight1 = ctx.saved_tensors
            weight1 = weight1.transpose(1, 2)  # rearrange(weight1, 'n h f -> n f h')
            gmm1_inputs_grad, shared_expert_fc1_inputs_grad = _npu().npu_gmm_alltoallv(
                gmm_x=mm1_out_grad, gmm_weight=weight1, hcom=ctx.hcom_info,
                ep_world_size=ctx.ep_world_size, send_counts=ctx.recv_counts,
                recv_counts=ctx.send_counts, send_counts_tensor=None, recv_counts_tensor=None,
                mm_x=shared_expert_mm1_out_grad, mm_weight=share_expert_weight1,
                trans_gmm_weight=False, trans_mm_weight=False)
            weight1_grad = _expert_weight_grad(permute2_out, mm1_out_grad, ctx.group_list)
            shared_expert_weight1_grad = None
            if ctx.use_shared_experts:
                shared_expert_weight1_grad = _expert_weight_grad(gmm1_inputs, shared_expert_mm1_out_grad, ctx.group_list)
            return (gmm1_inputs_grad, weight1_grad, None, None, shared_expert_fc1_inputs_grad,
                    shared_expert_weight1_grad, None, None, None)

    class GmmUnpermuteAlltoallv(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gmm2_inputs, weight2, ep_group, group_list, share_cached_fc2_input, share_expert_weight2, use_shared_experts=False, send_counts=None, recv_counts=None):  # type: ignore[no-untyped-def]
            if send_counts is None or recv_counts is None:
                raise AssertionError('Please check your comm input!!!')
            if use_shared_experts:
                mm_x = share_cached_fc2_input
            else:
                mm_x = None
                share_expert_weight2 = None
            hcom_info, ep_world_size = _gemm_ref.group_info(ep_group)
            alltoall_out, shared_expert_mm2_out = _npu().npu_gmm_alltoallv(
                gmm_x=gmm2_inputs, gmm_weight=weight2, hcom=hcom_info,
                ep_world_size=ep_world_size, send_counts=recv_counts, recv_counts=send_counts,
                send_counts_tensor=None, recv_counts_tensor=None, mm_x=mm_x,
                mm_weight=share_expert_weight2, trans_gmm_weight=False, trans_mm_weight=False)
            ctx.save_for_backward(gmm2_inputs, weight2, share_expert_weight2)
            ctx.use_shared_experts = use_shared_experts
            ctx.group_list = group_list
            ctx.send_counts, ctx.recv_counts = send_counts, recv_counts
            ctx.ep_world_size, ctx.hcom_info = ep_world_size, hcom_info
            return alltoall_out, shared_expert_mm2_out

        @staticmethod
        def backward(ctx, alltoall_result_grad, shared_expert_mm2_out_grad):  # type: ignore[no-untyped-def]
            gmm2_inputs, weight2, share_expert_weight2 = ctx.saved_tensors
            weight2 = weight2.transpose(1, 2)  # rearrange(weight2, 'n h f -> n f h')
            gmm2_input_grad, shared_expert_fc2_input_grad, unpermute1_input_grad = \
                _npu().npu_alltoallv_gmm(
                    gmm_x=alltoall_result_grad, gmm_weight=weight2, hcom=ctx.hcom_info,
                    ep_world_size=ctx.ep_world_size, send_counts=ctx.send_counts,
                    recv_counts=ctx.recv_counts, send_counts_tensor=None,
                    recv_counts_tensor=None, mm_x=shared_expert_mm2_out_grad,
                    mm_weight=share_expert_weight2, trans_gmm_weight=False,
                    trans_mm_weight=False, permute_out_flag=True)
            weight2_grad = _expert_weight_grad(gmm2_inputs, unpermute1_input_grad, ctx.group_list)
            shared_expert_weight2_grad = None
            if ctx.use_shared_experts:
                shared_expert_weight2_grad = _expert_weight_grad(gmm2_inputs, shared_expert_mm2_out_grad, ctx.group_list)
            return (gmm2_input_grad, weight2_grad, None, None, shared_expert_fc2_input_grad,
                    shared_expert_weight2_grad, None, None, None)

    return [AlltoallvPermuteGmm, GmmUnpermuteAlltoallv]


def _loopback_all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``torch.distributed._all_gather_base`` over a loopback group: every rank holds this
    rank's shard (the emulated npu_all_gather_base_mm gathers the same way)."""
    return torch.cat([x] * world_size, 0)


def _loopback_reduce_scatter(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``torch.distributed._reduce_scatter_base`` over a loopback group: the adjoint of the
    loopback all-gather, the sum of the ``world_size`` chunks of dim 0 (what autograd through
    the gather gives, so the references' gradients and these agree)."""
    return torch.stack(x.chunk(world_size, 0)).sum(0)


def _mc2_linear_function() -> list[Any]:
    """ColumnSeqParallelLinearFunction of
    mindspeed/core/tensor_parallel/mc2_feature/linear_function.py (--use-ascend-mc2: the
    column-parallel linear with sequence parallelism), as MindSpeed writes it; on a
    ``torch.distributed`` group its collectives are torch's, on a LoopbackGroup the loopback
    (``torch.cuda.current_device()`` is the input's device here)."""

    class ColumnSeqParallelLinearFunction(torch.autograd.Function):
        """use npu_all_gather_base_mm in forward to overlap computation and communication."""

        @staticmethod
        def forward(ctx, input_, weight, bias, group, all_gather_recomputation=True, gradient_accumulation_fusion=False):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(input_)
            ctx.use_bias = bias is not None
            ctx.weight = weight
            ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
            ctx.all_gather_recomputation = all_gather_recomputation
            hcomm_info, world_size = _gemm_ref.group_info(group)
            x = input_.reshape(input_.shape[0] * input_.shape[1], input_.shape[2])
            # npu_all_gather_base_mm currently do not support bias
            output, all_gather_grad_output = _npu().npu_all_gather_base_mm(
                x, weight.t(), hcomm_info, world_size, bias=None, gather_index=0,
                gather_output=(not all_gather_recomputation))
            if bias is not None:
                output = output + bias
            output = output.view(int(output.shape[0] / input_.shape[1]), input_.shape[1],
                                 output.shape[1])
            ctx.all_gather_output = all_gather_grad_output
            ctx.world_size = world_size
            ctx.group = group
            return output

        @staticmethod
        def backward(ctx, grad_output):  # type: ignore[no-untyped-def]
            input_ = ctx.saved_tensors[0]
            weight = ctx.weight
            grad_output_ = grad_output.reshape(grad_output.shape[0] * grad_output.shape[1],
                                               grad_output.shape[2])
            if ctx.all_gather_recomputation:
                all_gather_output = _loopback_all_gather(input_.contiguous(), ctx.world_size)
            else:
                all_gather_output = ctx.all_gather_output
            grad_input = grad_output_.matmul(weight)
            grad_input = grad_input.reshape(grad_output.shape[0], grad_output.shape[1],
                                            weight.shape[1])
            sub_grad_input = _loopback_reduce_scatter(grad_input, ctx.world_size)
            # as MindSpeed: a 3-D gathered input (the recomputed one); the op's own gathered
            # output is 2-D, so MindSpeed's path without recomputation fails here
            all_gather_output = all_gather_output.reshape(
                all_gather_output.shape[0] * all_gather_output.shape[1],
                all_gather_output.shape[2])
            if ctx.gradient_accumulation_fusion and weight.main_grad.dtype == torch.float32:
                from mindspeed.ops.npu_matmul_add import npu_matmul_add_fp32
                npu_matmul_add_fp32(all_gather_output, grad_output_, weight.main_grad)
                if hasattr(weight, "grad_added_to_main_grad"):
                    # a dummy grad (MindSpeed: torch.empty unless zero_out_wgrad; zeros here)
                    grad_weight = torch.zeros(weight.main_grad.shape, dtype=input_.dtype,
                                              device=input_.device, requires_grad=False)
                    weight.grad_added_to_main_grad = True
                else:
                    grad_weight = None
            else:
                grad_weight = grad_output_.t().matmul(all_gather_output)
            if ctx.needs_input_grad[2] and ctx.use_bias:
                grad_bias = (grad_output_.sum(dim=0) if grad_output_.is_contiguous()
                             else grad_output_.t().sum(dim=1))
            else:
                grad_bias = None
            return sub_grad_input, grad_weight, grad_bias, None, None, None

    return [ColumnSeqParallelLinearFunction]


def _te_permutation() -> list[Any]:
    """MoePermuteMaskMap / MoeUnpermuteMaskMap of mindspeed/te/pytorch/permutation.py (MindSpeed
    2.2+, master 028de58ca629; ``fused_moe_permute.(un)permute(fused=True)`` applies them), as
    MindSpeed writes them: Python over torch_npu's routing-map ops, looked up on the
    ``torch_npu`` module at each call; the unpermute calls the *internal*
    ``torch_npu._npu_moe_token_unpermute_with_routing_map``.  Their backward calls the
    routing-map grad ops (``npu_moe_token_(un)permute_with_routing_map_grad``), emulated where
    the release has them (``_fam_moe_token``: 2.6.0.post3 on, with the routing-map ops; before,
    ``torch_npu`` has neither and the forward's lookup is the AttributeError)."""
    import torch_npu  # type: ignore[import-not-found]  # the stand-in

    class MoePermuteMaskMap(torch.autograd.Function):
        """functional Permute with mask router map"""

        @staticmethod
        def forward(ctx, tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):  # type: ignore[no-untyped-def]
            permuted_input, permuted_probs, sorted_indices = torch_npu.npu_moe_token_permute_with_routing_map(
                tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)
            num_tokens, _ = tokens.shape
            num_experts = routing_map.shape[1]
            ctx.num_tokens = num_tokens
            ctx.num_experts = num_experts
            ctx.drop_and_pad = drop_and_pad
            ctx.sorted_indices = sorted_indices
            ctx.routing_map = routing_map
            return permuted_input, permuted_probs, sorted_indices

        @staticmethod
        def backward(ctx, permuted_act_grad, permuted_probs_grad, _):  # type: ignore[no-untyped-def]
            act_grad = None
            probs_grad = None
            if ctx.needs_input_grad[0]:
                act_grad, probs_grad = torch_npu.npu_moe_token_permute_with_routing_map_grad(
                    permuted_act_grad, permuted_probs_grad, ctx.sorted_indices, ctx.routing_map,
                    ctx.num_experts, ctx.num_tokens, ctx.drop_and_pad)
            if not ctx.needs_input_grad[2]:
                probs_grad = None
            return act_grad, None, probs_grad, None, None

    class MoeUnpermuteMaskMap(torch.autograd.Function):
        """functional Unpermute with mask router map"""

        @staticmethod
        def forward(ctx, permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, drop_and_pad=False):  # type: ignore[no-untyped-def]
            if not permuted_tokens.numel():
                ctx.probs = probs
                return permuted_tokens
            unpermuted_output, out_index, permuted_token_id, _ = torch_npu._npu_moe_token_unpermute_with_routing_map(
                permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                drop_and_pad=drop_and_pad)
            with_probs = probs is not None
            if with_probs:
                ctx.save_for_backward(permuted_tokens, probs)
            ctx.restore_shape = restore_shape
            ctx.drop_and_pad = drop_and_pad
            ctx.sorted_indices = sorted_indices
            ctx.routing_map = routing_map
            ctx.out_index = out_index
            ctx.permuted_token_id = permuted_token_id
            ctx.with_probs = with_probs
            return unpermuted_output

        @staticmethod
        def backward(ctx, unpermuted_tokens_grad):  # type: ignore[no-untyped-def]
            if not unpermuted_tokens_grad.numel():
                return unpermuted_tokens_grad, None, None, ctx.probs, None, None
            act_grad = None
            probs_grad = None
            if ctx.needs_input_grad[0]:
                permuted_tokens, probs = None, None
                if ctx.with_probs:
                    permuted_tokens, probs = ctx.saved_tensors
                out_index = ctx.out_index if ctx.drop_and_pad else ctx.sorted_indices
                token_id = ctx.permuted_token_id if ctx.drop_and_pad else ctx.sorted_indices
                act_grad, probs_grad = torch_npu.npu_moe_token_unpermute_with_routing_map_grad(
                    unpermuted_tokens_grad, out_index, token_id, routing_map=ctx.routing_map,
                    permuted_tokens=permuted_tokens, probs=probs, drop_and_pad=ctx.drop_and_pad,
                    restore_shape=ctx.restore_shape)
            if not ctx.needs_input_grad[3]:
                probs_grad = None
            return act_grad, None, None, probs_grad, None, None

    return [MoePermuteMaskMap, MoeUnpermuteMaskMap]


# --------------------------------------------------------------------------- module builders


def _fresh(fn: Callable[..., Any], module: types.ModuleType) -> Callable[..., Any]:
    """A new function object with ``fn``'s code, owned by ``module``."""
    assert isinstance(fn, types.FunctionType)
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    copy.__doc__ = fn.__doc__
    copy.__qualname__ = fn.__name__
    copy.__module__ = module.__name__
    return copy


def _export(module: types.ModuleType, functions: Sequence[Callable[..., Any]]) -> None:
    for fn in functions:
        setattr(module, fn.__name__, _fresh(fn, module))
    module.__all__ = [fn.__name__ for fn in functions]  # type: ignore[attr-defined]


STACK = "__opcontracts_stack__"
"""The stand-in ``torch_npu``'s attribute saying the CANN and SoC the emulated kernels behave
as (the profile's ``Stack``): ``opcontracts._lang.versions`` reads it, never imports anything."""


def _stack(versions: dict[str, str]) -> dict[str, str]:
    return {k: versions[k] for k in ("profile", "cann", "soc") if versions.get(k)}


class _Builders:
    """What each stand-in module contains; versions are read at build time."""

    def __init__(self, versions: dict[str, str]) -> None:
        self.versions = versions

    def torch_npu(self, module: types.ModuleType) -> None:
        module.__version__ = self.versions["torch_npu"]  # type: ignore[attr-defined]
        module.__opcontracts_stack__ = _stack(self.versions)  # type: ignore[attr-defined]
        module.__doc__ = "opcontracts emulation of torch_npu: npu_* are torch.ops.npu packets."
        ns = _npu()
        for name in (*OP_NAMES, "npu_format_cast_"):
            if hasattr(ns, name):  # the release-only ops where the release has them
                setattr(module, name, getattr(ns, name))
        device = sys.modules.get("torch_npu.npu")  # the emulated device, when installed
        if device is not None:
            module.npu = device  # type: ignore[attr-defined]
        _surface.extend_torch_npu(module)  # dtypes, submodules, the not-emulated line

    def mindspeed(self, module: types.ModuleType) -> None:
        module.__version__ = self.versions["mindspeed"]  # type: ignore[attr-defined]
        module.__doc__ = "opcontracts emulation of MindSpeed (mindspeed.ops only)."

    def mindspeed_ops(self, module: types.ModuleType) -> None:
        module.__doc__ = "opcontracts emulation of mindspeed.ops."

    def op_builder_base(self, module: types.ModuleType) -> None:
        _own(module, _op_builder_base(module))

    def op_builder(self, module: types.ModuleType) -> None:
        module.__doc__ = ("opcontracts emulation of mindspeed.op_builder (the builders of the "
                          "JIT-built extensions the stand-ins emulate).")
        _own(module, _op_builders())

    def unpermute(self, module: types.ModuleType) -> None:
        _own(module, _unpermute_module(module))

    def permute(self, module: types.ModuleType) -> None:
        _own(module, _permute_module(module))

    def gmm(self, module: types.ModuleType) -> None:
        _own(module, _gmm_module(module))

    def rope(self, module: types.ModuleType) -> None:
        _own(module, _rope_module(module))

    def fusion_attention(self, module: types.ModuleType) -> None:
        _export(module, [npu_fusion_attention, npu_fusion_attention_grad])

    def ring(self, module: types.ModuleType) -> None:
        _export(module, [npu_ring_attention_update])

    def mindspeed_core(self, module: types.ModuleType) -> None:
        module.__doc__ = "opcontracts emulation of mindspeed.core (the fusions MindSpeed wraps)."

    def fused_bias_swiglu(self, module: types.ModuleType) -> None:
        _export(module, [fused_swiglu])
        for cls in _swiglu_classes(module):
            setattr(module, cls.__name__, cls)
            module.__all__.append(cls.__name__)  # type: ignore[attr-defined]

    def matmul_add(self, module: types.ModuleType) -> None:
        _export(module, [npu_matmul_add_fp32, npu_matmul_add_fp16])
        module.__all__ = ["npu_matmul_add_fp32"]  # type: ignore[attr-defined]  # MindSpeed's
        _gmm_util.npu_version(module)  # NPUVersion, check_npu_version (grouped_matmul_util's)

    def groupmatmul_add(self, module: types.ModuleType) -> None:
        _export(module, [npu_groupmatmul_add_fp32])

    def grouped_matmul_mc2(self, module: types.ModuleType) -> None:
        _own(module, _grouped_matmul_mc2(module))

    def mc2_fuse_a2a(self, module: types.ModuleType) -> None:
        _own(module, _mc2_fuse_a2a())

    def linear_function(self, module: types.ModuleType) -> None:
        _own(module, _mc2_linear_function())

    def te_permutation(self, module: types.ModuleType) -> None:
        module.__doc__ = "MoE Permutaion API"  # (sic, MindSpeed's)
        _own(module, _te_permutation())

    def package(self, module: types.ModuleType) -> None:
        module.__doc__ = (f"opcontracts emulation of {module.__name__} (only the modules "
                          "below it that the stand-ins emulate).")

    def table(self) -> dict[str, Callable[[types.ModuleType], None]]:
        return {
            "torch_npu": self.torch_npu,
            "mindspeed": self.mindspeed,
            "mindspeed.ops": self.mindspeed_ops,
            "mindspeed.op_builder": self.op_builder,
            "mindspeed.op_builder.builder": self.op_builder_base,
            "mindspeed.ops.npu_moe_token_unpermute": self.unpermute,
            "mindspeed.ops.npu_moe_token_permute": self.permute,
            "mindspeed.ops.gmm": self.gmm,
            "mindspeed.ops.npu_rotary_position_embedding": self.rope,
            "mindspeed.ops.fusion_attention_v2": self.fusion_attention,
            "mindspeed.ops.npu_ring_attention_update": self.ring,
            "mindspeed.ops.npu_matmul_add": self.matmul_add,
            "mindspeed.ops.npu_groupmatmul_add": self.groupmatmul_add,
            "mindspeed.ops.grouped_matmul_mc2": self.grouped_matmul_mc2,
            "mindspeed.core": self.mindspeed_core,
            "mindspeed.core.fusions": self.mindspeed_core,
            "mindspeed.core.fusions.fused_bias_swiglu": self.fused_bias_swiglu,
            **{name: self.package for name in _MC2_PACKAGES},
            **_gmm_util.table(),  # mindspeed.args_utils, ...moe.grouped_matmul_util
            "mindspeed.core.transformer.moe.moe_feature.mc2moe.mc2_fuse_a2a": self.mc2_fuse_a2a,
            "mindspeed.core.tensor_parallel.mc2_feature.linear_function": self.linear_function,
            "mindspeed.te": self.package,
            "mindspeed.te.pytorch": self.package,
            "mindspeed.te.pytorch.permutation": self.te_permutation,
            **_surface.table(),  # torch_npu.testing, transfer_to_npu, torchair, ...
        }


MODULE_NAMES: tuple[str, ...] = tuple(_Builders({}).table())


_NEVER_SHADOWED = ("mindspeed", "acl")  # MindSpeed's Python, CANN's pyACL: the real ones win


def _real_package(root: str) -> bool:
    """Whether ``root`` of this process is (or, not yet imported, would be) the real package:
    the one imported when it is not a stand-in, else one found on ``sys.path``."""
    loaded = sys.modules.get(root)
    if loaded is not None:
        return not is_standin(loaded)
    try:
        return importlib.machinery.PathFinder.find_spec(root) is not None
    except (ImportError, ValueError):
        return False


def real_mindspeed() -> bool:
    """Whether the ``mindspeed`` of this process is a real MindSpeed (see :func:`_real_package`)."""
    return _real_package("mindspeed")


class _StandinLoader(importlib.abc.Loader):
    def __init__(self, builders: _Builders) -> None:
        self._builders = builders

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        setattr(module, MARKER, True)
        self._builders.table()[module.__name__](module)


class StandinFinder(importlib.abc.MetaPathFinder):
    """Finds the stand-in modules; everything else is left to the other finders."""

    def __init__(self, versions: dict[str, str]) -> None:
        self.versions = versions
        self._builders = _Builders(versions)
        self._loader = _StandinLoader(self._builders)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        root = fullname.partition(".")[0]
        if root in _NEVER_SHADOWED and _real_package(root):
            return None  # the real package, and every module below it
        if fullname not in MODULE_NAMES:
            _surface.check_known(fullname)  # below a stand-in root: one clear error
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, self._loader, origin=__file__, is_package=fullname in _PACKAGES
        )
        spec.has_location = True  # __file__ points at this file, where the code lives
        return spec

    def owns(self, spec: importlib.machinery.ModuleSpec | None) -> bool:
        return spec is not None and spec.loader is self._loader

    def insert(self) -> None:
        """Put the finder just before ``PathFinder`` (or last when there is none)."""
        for i, finder in enumerate(sys.meta_path):
            if finder is importlib.machinery.PathFinder:
                sys.meta_path.insert(i, self)
                return
        sys.meta_path.append(self)

    def remove(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)

    def set_versions(self, versions: dict[str, str]) -> None:
        """Change the reported versions, also on stand-ins already imported."""
        self.versions.update(versions)
        for name, attr in (("torch_npu", "torch_npu"), ("mindspeed", "mindspeed")):
            module = sys.modules.get(name)
            if is_standin(module):
                module.__version__ = self.versions[attr]  # type: ignore[union-attr]
                if name == "torch_npu":
                    setattr(module, STACK, _stack(self.versions))
