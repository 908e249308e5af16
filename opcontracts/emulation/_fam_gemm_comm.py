"""Emulated ops of the grouped GEMM family: one ``EmulatedOp`` entry per op (see
``_family``); their references live in ``opcontracts.reference._fam_gemm_comm`` (which says
what the communication fusions compute in one process).

torch_npu registers no autograd for any of them (they are in the ``custom`` section of
``npu_native_functions_by_codegen.yaml``, none under ``autograd``).  MindSpeed trains through
the all-to-all / all-gather fusions with its own ``autograd.Function``, whose backward calls the
paired op (mindspeed/ops/grouped_matmul_mc2.py, mindspeed/core/tensor_parallel/mc2_feature/
linear_function.py).  So the emulation registers no autograd kernel for them either: a backward
through one directly gets torch's autograd fallback, as on the NPU (a warning, no gradient to
its inputs: ``_ops._opaque``), and MindSpeed's stand-ins bring their own backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._family import EmulatedOp

__all__ = ["OPS"]

_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"
HALF = ("bf16", "fp16")


def _finalize_routing_fake(
    x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor, *,
    scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    offset: torch.Tensor | None = None, pertoken_scale: torch.Tensor | None = None,
    shared_input: torch.Tensor | None = None, logit: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None, dtype: torch.dtype | None = None,
    shared_input_weight: float | None = 1.0, shared_input_offset: int | None = 0,
    output_bs: int | None = 0, group_list_type: int | None = 1,
    tuning_config: Sequence[int] | None = None, x_dtype: int | None = None,
    w_dtype: int | None = None, scale_dtype: int | None = None,
    pertoken_scale_dtype: int | None = None,
) -> torch.Tensor:
    # the meta kernel: (output_bs or m, n) in fp32, n x 8 for an int32 (int4) weight
    n = w.size(-1) * 8 if w.dtype == torch.int32 else w.size(-1)
    return x.new_empty((output_bs or x.size(0), n), dtype=torch.float32)


def _mm_y(mm_x: torch.Tensor | None, mm_weight: torch.Tensor | None,
          trans: bool) -> torch.Tensor | None:
    if mm_x is None or mm_weight is None:
        return None
    return mm_x.new_empty((mm_x.size(0), mm_weight.size(0) if trans else mm_weight.size(1)))


def _alltoallv_gmm_fake(
    gmm_x: torch.Tensor, gmm_weight: torch.Tensor, hcom: str, ep_world_size: int,
    send_counts: Sequence[int], recv_counts: Sequence[int], *,
    send_counts_tensor: torch.Tensor | None = None,
    recv_counts_tensor: torch.Tensor | None = None, mm_x: torch.Tensor | None = None,
    mm_weight: torch.Tensor | None = None, trans_gmm_weight: bool = False,
    trans_mm_weight: bool = False, permute_out_flag: bool = False, comm_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    rows = sum(recv_counts)
    n = gmm_weight.size(1) if trans_gmm_weight else gmm_weight.size(2)
    permuted = gmm_x.new_empty((rows, gmm_x.size(1))) if permute_out_flag else None
    return gmm_x.new_empty((rows, n)), _mm_y(mm_x, mm_weight, trans_mm_weight), permuted


def _gmm_alltoallv_fake(
    gmm_x: torch.Tensor, gmm_weight: torch.Tensor, hcom: str, ep_world_size: int,
    send_counts: Sequence[int], recv_counts: Sequence[int], *,
    send_counts_tensor: torch.Tensor | None = None,
    recv_counts_tensor: torch.Tensor | None = None, mm_x: torch.Tensor | None = None,
    mm_weight: torch.Tensor | None = None, trans_gmm_weight: bool = False,
    trans_mm_weight: bool = False, comm_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = gmm_weight.size(1) if trans_gmm_weight else gmm_weight.size(2)
    return gmm_x.new_empty((sum(recv_counts), n)), _mm_y(mm_x, mm_weight, trans_mm_weight)


def _all_gather_base_mm_fake(
    self: torch.Tensor, x2: torch.Tensor, hcom: str, world_size: int, *,
    bias: torch.Tensor | None = None, x1_scale: torch.Tensor | None = None,
    x2_scale: torch.Tensor | None = None, gather_index: int = 0, gather_output: bool = True,
    comm_turn: int = 0, output_dtype: torch.dtype | None = None, comm_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the meta kernel's shapes and dtypes
    world = max(world_size, 1)
    dtype = self.dtype
    if x2_scale is not None:
        dtype = torch.float16 if x2_scale.dtype == torch.int64 else output_dtype or torch.bfloat16
    out = self.new_empty((self.size(0) * world, x2.size(1)), dtype=dtype)
    gathered = self.new_empty((self.size(0) * world, self.size(1)) if gather_output else (0,))
    return out, gathered


def _grouped_matmul_add_fake(
    self: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor, *,
    transpose_x: bool = True, transpose_weight: bool = False, group_type: int = 2,
    group_list_type: int | None = 0,
) -> torch.Tensor:
    return self.new_empty(self.shape)


OPS: tuple[EmulatedOp, ...] = (
    EmulatedOp(
        "npu_grouped_matmul_finalize_routing",
        fake=_finalize_routing_fake,
        # a8w8 as the doc lists it; int4 weights (int32) are not emulated: read as int8
        dtypes={"x": ("int8",), "w": ("int8",), "group_list": ("int64",),
                "scale": ("fp32", "int64"), "bias": ("fp32",), "offset": ("fp32",),
                "pertoken_scale": ("fp32",), "shared_input": ("bf16",), "logit": ("fp32",),
                "row_index": ("int64", "int32")},
        source=f"{_DOCS} (npu_grouped_matmul_finalize_routing)",
    ),
    EmulatedOp(
        "npu_alltoallv_gmm",
        fake=_alltoallv_gmm_fake,
        dtypes={"gmm_x": HALF, "gmm_weight": HALF, "mm_x": HALF, "mm_weight": HALF},
        source=f"{_DOCS} (npu_alltoallv_gmm)",
    ),
    EmulatedOp(
        "npu_gmm_alltoallv",
        fake=_gmm_alltoallv_fake,
        dtypes={"gmm_x": HALF, "gmm_weight": HALF, "mm_x": HALF, "mm_weight": HALF},
        source=f"{_DOCS} (npu_gmm_alltoallv)",
    ),
    EmulatedOp(
        "npu_all_gather_base_mm",
        fake=_all_gather_base_mm_fake,
        # int8 with its scales (the quantized mode, 2.6.0.post3 on)
        dtypes={"self": (*HALF, "int8"), "x2": (*HALF, "int8"), "bias": HALF,
                "x1_scale": ("fp32",), "x2_scale": ("fp32", "int64")},
        source=f"{_DOCS} (npu_all_gather_base_mm)",
    ),
    EmulatedOp(
        "npu_grouped_matmul_add",
        fake=_grouped_matmul_add_fake,
        dtypes={"self": ("fp32",), "x": HALF, "weight": HALF, "group_list": ("int64",)},
        source=f"{_DOCS} (npu_grouped_matmul_add)",
    ),
)
