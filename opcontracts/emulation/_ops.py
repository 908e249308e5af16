"""The emulated ``npu`` ops: schemas and their registration with the PyTorch dispatcher.

Schemas are copied from torch_npu 2.14.0 (``npu_native_functions_by_codegen.yaml``, as quoted in
``shared/reference/npu-op-facts.md``). ``npu_grouped_matmul`` and ``npu_fusion_attention`` are
abbreviated there; their schemas below keep the quoted argument names, order, keyword-only
marker and defaults and leave out the quantization / TND-only arguments.

Per op the registration is:

* ``CompositeExplicitAutograd``: the op's reference (``opcontracts.reference``), entered
  through ``_raw.kernel_view`` so that arguments in a dtype the active profile does not
  support are misread, as on the NPU;
* a fake implementation (``torch.library.register_fake``) for ``torch.compile``;
* for differentiable ops, an ``Autograd`` kernel (``_autograd``) running ``_backward``'s formula.

Everything is registered through one ``torch.library.Library("npu", "FRAGMENT")``; destroying
it removes every definition and kernel again (see :func:`deregister`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.library import Library

from .. import reference
from . import _fakes, _raw
from ._autograd import BackwardFn, make_autograd_kernel
from ._backward import BACKWARDS

__all__ = ["NAMESPACE", "OPS", "OP_NAMES", "OpDef", "deregister", "register", "tensor_args"]

NAMESPACE = "npu"

SCHEMAS: dict[str, str] = {
    "npu_moe_token_permute": "npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False) -> (Tensor, Tensor)",
    "npu_moe_token_permute_grad": "npu_moe_token_permute_grad(Tensor tokens, Tensor grad_permuted_tokens, Tensor indices, Tensor sorted_indices, bool padded_mode=False) -> Tensor",
    "npu_moe_token_unpermute": "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> Tensor",
    "npu_moe_token_unpermute_grad": "npu_moe_token_unpermute_grad(Tensor permuted_tokens, Tensor grad_unpermuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> (Tensor, Tensor)",
    "npu_moe_token_permute_with_routing_map": "npu_moe_token_permute_with_routing_map(Tensor tokens, Tensor routing_map, *, Tensor? probs=None, int? num_out_tokens=None, bool drop_and_pad=False) -> (Tensor, Tensor, Tensor)",
    "npu_moe_token_unpermute_with_routing_map": "npu_moe_token_unpermute_with_routing_map(Tensor permuted_tokens, Tensor sorted_indices, int[] restore_shape, *, Tensor? probs=None, Tensor? routing_map=None, bool drop_and_pad=False) -> Tensor",
    "npu_moe_init_routing": "npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)",
    "npu_moe_finalize_routing": "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, int? k=1) -> Tensor",
    "npu_moe_gating_top_k_softmax": "npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
    "npu_moe_compute_expert_tokens": "npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor",
    # Reduced from torch_npu 2.14.0: the quantization arguments (scale, offset, antiquant_*,
    # per_token_scale, ...), act_type and the tuning arguments are left out.
    "npu_grouped_matmul": "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor? group_list=None, int? split_item=0, int? group_type=None, int? group_list_type=0) -> Tensor[]",
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_swiglu": "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    "npu_rotary_mul": "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor",
    # Reduced from torch_npu 2.14.0: the arguments after ``sync`` (softmax_layout, sink, ...)
    # are left out.
    "npu_fusion_attention": "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)",
}


@dataclass(frozen=True)
class OpDef:
    """One emulated op: its schema, reference kernel, fake and (optional) backward formula."""

    name: str
    schema: str
    kernel: Callable[..., Any]
    fake: Callable[..., Any]
    backward: BackwardFn | None = None


def _reference(name: str) -> Callable[..., Any]:
    ref = reference.get(name)
    if ref is None:  # pragma: no cover - a schema without a reference is a packaging bug
        raise RuntimeError(f"opcontracts.reference has no reference for emulated op {name!r}")
    return ref.forward


OPS: tuple[OpDef, ...] = tuple(
    OpDef(
        name=name,
        schema=schema,
        kernel=_reference(name),
        fake=getattr(_fakes, name),
        backward=BACKWARDS.get(name),
    )
    for name, schema in SCHEMAS.items()
)
OP_NAMES: tuple[str, ...] = tuple(op.name for op in OPS)


def tensor_args() -> Mapping[str, frozenset[str]]:
    """Per op, the names of its Tensor / Tensor[] arguments (what a profile may restrict)."""
    result: dict[str, frozenset[str]] = {}
    for op in OPS:
        schema = torch._C.parse_schema(f"{NAMESPACE}::{op.schema}")
        result[op.name] = frozenset(
            a.name for a in schema.arguments if "Tensor" in str(a.type)
        )
    return result


def _through(view: Callable[[str, str, Any], Any], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with each argument first passed through ``view(name, arg, value)``."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        for arg, value in bound.arguments.items():
            bound.arguments[arg] = view(name, arg, value)
        return fn(*bound.args, **bound.kwargs)

    return entry


def _exists(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> Library:
    """Define every op in the ``npu`` namespace; the returned Library owns all registrations.

    Raises RuntimeError when one of the ops is already defined (a real torch_npu, or another
    emulation), before registering anything.
    """
    taken = [name for name in OP_NAMES if _exists(name)]
    if taken:
        raise RuntimeError(
            f"torch.ops.{NAMESPACE} already defines {', '.join(taken)}: a real torch_npu or another "
            "emulation is loaded; opcontracts.emulation will not shadow it"
        )
    lib = Library(NAMESPACE, "FRAGMENT")
    try:
        for op in OPS:
            lib.define(op.schema)
            lib.impl(op.name, _through(_raw.kernel_view, op.name, op.kernel), "CompositeExplicitAutograd")
            torch.library.register_fake(
                f"{NAMESPACE}::{op.name}", _through(_raw.fake_view, op.name, op.fake), lib=lib
            )
            if op.backward is not None:
                overload = getattr(getattr(torch.ops, NAMESPACE), op.name).default
                lib.impl(op.name, make_autograd_kernel(overload, op.backward), "Autograd", with_keyset=True)
    except BaseException:
        lib._destroy()
        raise
    return lib


def deregister(lib: Library) -> None:
    """Undo :func:`register`: ``Library._destroy`` drops the definitions, kernels and fakes and
    clears the cached ``torch.ops.npu.<name>`` packets (wrappers set on them go too)."""
    lib._destroy()
