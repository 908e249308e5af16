"""References of the grouped GEMM family: the forward of each op in plain PyTorch,
and one ``Reference`` entry per op in ``REFERENCES`` (``_table`` appends them).

torch_npu ops (torch_npu 2.14.0 ``_op_plugin_docs.py`` and ``_meta_registrations.py``):

* ``npu_grouped_matmul_finalize_routing``: the int8 grouped matmul of MoE experts, dequantized
  (per-channel ``scale`` (e, n), per-token ``pertoken_scale`` (m,)), each row times its
  ``logit`` and scatter-added into row ``row_index[i]`` of a zero fp32 output of
  ``output_bs`` (else m) rows, which also gets ``shared_input * shared_input_weight`` added at
  rows ``[shared_input_offset, shared_input_offset + len(shared_input))``;
* ``npu_alltoallv_gmm`` / ``npu_gmm_alltoallv``: an all-to-all over the expert-parallel group
  fused with a grouped matmul, plus an optional shared-expert ``mm_x @ mm_weight``;
* ``npu_all_gather_base_mm``: an all-gather over the tensor-parallel group fused with a matmul;
* ``npu_grouped_matmul_add``: ``self + stack_g(x[k_g].T @ weight[k_g])`` (K split; what
  MindSpeed's ``npu_groupmatmul_add_fp32`` runs on Ascend 950).

**The communication fusions run in one process.**  At world size 1 the collectives are the
identity and the references compute exactly what the kernels do.  For a larger
``ep_world_size`` / ``world_size`` (the contracts require the documented 2..64) the references
define the collective as a loopback, so that they stay deterministic and checkable:

* all-to-all: the rows this rank sends to rank r come back as the rows it receives from rank r
  (received block (r, expert j) = sent block (r, j), cut or zero-padded to
  ``recv_counts[r * e + j]`` rows); with ``recv_counts == send_counts`` this is the local part
  of the op: ``alltoallv_gmm`` = permute (rank-major -> expert-major) then the grouped matmul,
  ``gmm_alltoallv`` = the grouped matmul then the unpermute;
* all-gather: every rank holds this rank's shard (the gathered input is ``world_size`` copies).

Counts are laid out rank-major, ``counts[r * e + j]`` for rank r and local expert j (the
npu_alltoallv_quant_gmm doc of the same release states the layout; e = gmm_weight.size(0)).
On a real multi-rank job the outputs depend on the other ranks' data, which no single-process
reference sees: a shadow compare of these ops is meaningful at world size 1 only.

MindSpeed's in-place accumulations (``npu_matmul_add_fp32``, ``npu_groupmatmul_add_fp32``;
``npu_matmul_add_fp16`` is plain torch in MindSpeed, the stand-in runs it as MindSpeed does) have
their math here (``matmul_add_fp32``, ``groupmatmul_add_fp32``: out of place), which the
stand-ins run.  Their ``Reference`` entries return None, as the ops do: the result is written
into ``grad``, and the shadow compare and the probe judge outputs only, so for these they
judge nothing (a reference that returned the accumulated tensor would be counted as an error:
"the op returned 0 tensors, its reference 1").  Judging a mutated argument would need the
compare to know which argument an op writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._entry import Reference
from ._matmul import _scale_values, group_sizes, npu_grouped_matmul
from ._util import acc_dtype, fit, safe_index

__all__ = ["REFERENCES", "LoopbackGroup", "group_info", "groupmatmul_add_fp32", "matmul_add_fp32"]

_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"
_F32 = torch.float32


# --------------------------------------------------------------------------- finalize routing
def npu_grouped_matmul_finalize_routing(
    x: torch.Tensor,
    w: torch.Tensor,
    group_list: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    pertoken_scale: torch.Tensor | None = None,
    shared_input: torch.Tensor | None = None,
    logit: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    shared_input_weight: float | None = 1.0,
    shared_input_offset: int | None = 0,
    output_bs: int | None = 0,
    group_list_type: int | None = 1,
    tuning_config: Sequence[int] | None = None,
    x_dtype: int | None = None,
    w_dtype: int | None = None,
    scale_dtype: int | None = None,
    pertoken_scale_dtype: int | None = None,
) -> torch.Tensor:
    """aclnnGroupedMatmulFinalizeRouting, a8w8 (see the module docstring).  a8w4 (an int32
    weight carrying int4, int64 scale, bias and offset: the doc gives no formula for them),
    hifloat8 / mxfp4 (``*_dtype``) and an output dtype other than fp32 (the meta kernel raises
    for it) are not emulated."""
    if dtype is not None and dtype != _F32:
        raise RuntimeError(f"Not supported output dtype is {dtype}")
    if w.dtype == torch.int32 or any(v is not None for v in (x_dtype, w_dtype, scale_dtype,
                                                              pertoken_scale_dtype)):
        raise NotImplementedError("npu_grouped_matmul_finalize_routing: a8w4 (int4 weights) "
                                  "and hifloat8 / mxfp4 inputs are not emulated")
    m, e = x.size(0), w.size(0)
    acc = acc_dtype(scale, pertoken_scale, logit, shared_input)
    sizes = group_sizes(group_list, 0 if group_list_type == 0 else 1, e)
    rows: list[torch.Tensor] = []
    start = 0
    for g in range(e):
        stop = min(start + sizes[g], m)
        y = x[start:stop].to(acc) @ w[g].to(acc)
        if scale is not None:
            y = y * _scale_values(scale[g].reshape(-1), acc)
        if bias is not None:
            y = y + bias[g].to(acc)
        rows.append(y)
        start = stop
    mm = torch.cat(rows, 0)
    mm = torch.cat([mm, mm.new_zeros((m - mm.size(0), mm.size(1)))], 0)  # rows past the groups
    if pertoken_scale is not None:
        mm = mm * pertoken_scale.to(acc).reshape(-1, 1)
    if logit is not None:
        mm = mm * logit.to(acc).reshape(-1, 1)
    out_rows = output_bs or m
    out = torch.zeros((out_rows, mm.size(1)), dtype=acc, device=x.device)
    if shared_input is not None:
        off = shared_input_offset or 0
        weight = 1.0 if shared_input_weight is None else shared_input_weight
        part = shared_input.to(acc) * weight
        idx = torch.arange(off, off + part.size(0), device=x.device)
        ids, valid = safe_index(idx, out_rows)
        out = out.index_add(0, ids, part * valid.to(acc).unsqueeze(1))
    dest = row_index if row_index is not None else torch.arange(m, device=x.device)
    ids, valid = safe_index(dest, out_rows)
    out = out.index_add(0, ids, mm * valid.to(acc).unsqueeze(1))
    return out if acc == torch.float64 else out.to(_F32)  # fp64 for the compare's copies


# --------------------------------------------------------------------------- all-to-all
def _blocks(rows: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """``rows`` cut into consecutive blocks of ``counts`` rows (short blocks zero-padded)."""
    out, start = [], 0
    for c in counts:
        c = max(int(c), 0)
        block = rows[start:start + c]
        if block.size(0) < c:
            block = torch.cat([block, block.new_zeros((c - block.size(0), *rows.shape[1:]))], 0)
        out.append(block)
        start += c
    return out


def _fit_rows(block: torch.Tensor, n: int) -> torch.Tensor:
    n = max(int(n), 0)
    if block.size(0) >= n:
        return block[:n]
    return torch.cat([block, block.new_zeros((n - block.size(0), *block.shape[1:]))], 0)


def _loopback(x: torch.Tensor, send_counts: Sequence[int],
              recv_counts: Sequence[int]) -> list[torch.Tensor]:
    """The received blocks in rank-major order: block (r, j) is the one sent to (r, j)."""
    sent = _blocks(x, send_counts)
    return [_fit_rows(b, n) for b, n in zip(sent, recv_counts, strict=False)] + [
        x.new_zeros((max(int(n), 0), *x.shape[1:])) for n in recv_counts[len(sent):]]


def _expert_major(blocks: list[torch.Tensor], world: int, e: int) -> list[torch.Tensor]:
    """Rank-major blocks (r, j) reordered expert-major: (0, 0), (1, 0), ..., (0, 1), ..."""
    return [blocks[r * e + j] for j in range(e) for r in range(world) if r * e + j < len(blocks)]


def _gmm(x: torch.Tensor, weight: torch.Tensor, counts: list[int], trans: bool) -> torch.Tensor:
    w = weight.transpose(-1, -2) if trans else weight
    gl = torch.tensor(counts, dtype=torch.int64, device=x.device)
    return npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=0,
                              group_list_type=1)[0]


def _shared_mm(mm_x: torch.Tensor | None, mm_weight: torch.Tensor | None,
               trans: bool) -> torch.Tensor | None:
    if mm_x is None or mm_weight is None:
        return None
    w = mm_weight.T if trans else mm_weight
    acc = acc_dtype(mm_x)
    return (mm_x.to(acc) @ w.to(acc)).to(mm_x.dtype)


def _counts_per_expert(counts: Sequence[int], world: int, e: int) -> list[int]:
    return [sum(max(int(counts[r * e + j]), 0) for r in range(world) if r * e + j < len(counts))
            for j in range(e)]


def npu_alltoallv_gmm(
    gmm_x: torch.Tensor,
    gmm_weight: torch.Tensor,
    hcom: str,
    ep_world_size: int,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    *,
    send_counts_tensor: torch.Tensor | None = None,
    recv_counts_tensor: torch.Tensor | None = None,
    mm_x: torch.Tensor | None = None,
    mm_weight: torch.Tensor | None = None,
    trans_gmm_weight: bool = False,
    trans_mm_weight: bool = False,
    permute_out_flag: bool = False,
    comm_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """alltoallv, permute to expert-major, grouped matmul (the all-to-all a loopback: see the
    module docstring); returns (gmm_y, mm_y or None, permute_out or None)."""
    world, e = max(ep_world_size, 1), gmm_weight.size(0)
    blocks = _expert_major(_loopback(gmm_x, send_counts, recv_counts), world, e)
    permuted = torch.cat(blocks, 0) if blocks else gmm_x.new_zeros((0, gmm_x.size(1)))
    y = _gmm(permuted, gmm_weight, _counts_per_expert(recv_counts, world, e), trans_gmm_weight)
    # permute_out is a buffer of its own, as the kernel's outputs are (autograd through the
    # reference must not see one output feeding another)
    return (y, _shared_mm(mm_x, mm_weight, trans_mm_weight),
            permuted.clone() if permute_out_flag else None)


def npu_gmm_alltoallv(
    gmm_x: torch.Tensor,
    gmm_weight: torch.Tensor,
    hcom: str,
    ep_world_size: int,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    *,
    send_counts_tensor: torch.Tensor | None = None,
    recv_counts_tensor: torch.Tensor | None = None,
    mm_x: torch.Tensor | None = None,
    mm_weight: torch.Tensor | None = None,
    trans_gmm_weight: bool = False,
    trans_mm_weight: bool = False,
    comm_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """grouped matmul on expert-major rows (group g: the rows this rank sends back for local
    expert g, over all ranks), unpermute to rank-major, alltoallv (a loopback); returns
    (y, mm_y or None)."""
    world, e = max(ep_world_size, 1), gmm_weight.size(0)
    y = _gmm(gmm_x, gmm_weight, _counts_per_expert(send_counts, world, e), trans_gmm_weight)
    per_expert = _blocks(y, [max(int(send_counts[r * e + j]), 0) for j in range(e)
                             for r in range(world) if r * e + j < len(send_counts)])
    rank_major: list[torch.Tensor] = [y.new_zeros((0, y.size(1)))] * len(send_counts)
    i = 0
    for j in range(e):
        for r in range(world):
            if r * e + j < len(send_counts):
                rank_major[r * e + j] = per_expert[i]
                i += 1
    sent = torch.cat(rank_major, 0) if rank_major else y
    out = torch.cat(_loopback(sent, send_counts, recv_counts) or [y.new_zeros((0, y.size(1)))], 0)
    return out, _shared_mm(mm_x, mm_weight, trans_mm_weight)


# --------------------------------------------------------------------------- all-gather
def npu_all_gather_base_mm(
    self: torch.Tensor,
    x2: torch.Tensor,
    hcom: str,
    world_size: int,
    *,
    bias: torch.Tensor | None = None,
    x1_scale: torch.Tensor | None = None,
    x2_scale: torch.Tensor | None = None,
    gather_index: int = 0,
    gather_output: bool = True,
    comm_turn: int = 0,
    output_dtype: torch.dtype | None = None,
    comm_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """allgather(self) @ x2 (+ bias), the all-gather a loopback (``world_size`` copies of this
    shard); quantized (int8 with ``x2_scale`` per channel, ``x1_scale`` per token): dequantized
    to fp16 with an int64 x2_scale, else to ``output_dtype`` (default bf16), as the meta kernel
    types them.  Returns (output, gathered input or an empty tensor without gather_output)."""
    if gather_index != 0:
        raise NotImplementedError("npu_all_gather_base_mm: gather_index 1 (the doc: only 0)")
    world = max(world_size, 1)
    gathered = torch.cat([self] * world, 0)
    acc = acc_dtype(self, x2) if self.is_floating_point() else _F32
    y = gathered.to(acc) @ x2.to(acc)
    dtype = self.dtype
    if x2_scale is not None:
        y = y * _scale_values(x2_scale.reshape(1, -1), acc)
        if x1_scale is not None:
            y = y * torch.cat([x1_scale.reshape(-1, 1)] * world, 0).to(acc)
        dtype = torch.float16 if x2_scale.dtype == torch.int64 else output_dtype or torch.bfloat16
    if bias is not None:
        y = y + bias.to(acc)
    gather_out = gathered.clone() if gather_output else self.new_empty((0,))  # its own buffer
    return y.to(dtype), gather_out


# --------------------------------------------------------------------------- K-split accumulate
def npu_grouped_matmul_add(
    self: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    group_list: torch.Tensor,
    *,
    transpose_x: bool = True,
    transpose_weight: bool = False,
    group_type: int = 2,
    group_list_type: int | None = 0,
) -> torch.Tensor:
    """``self[g] + x[k_g].T @ weight[k_g]`` for each group g of the K axis (x (K, M) transposed,
    weight (K, N), self (G, M, N) fp32), accumulated in fp32."""
    xt = x.T if transpose_x else x
    w = weight.T if transpose_weight else weight
    (y,) = npu_grouped_matmul([xt], [w], group_list=group_list, split_item=3, group_type=2,
                              group_list_type=group_list_type, output_dtype=_F32)
    acc = acc_dtype(self)
    return (self.to(acc) + fit(y.reshape(-1), self.numel()).view(self.shape).to(acc)).to(
        self.dtype)


# --------------------------------------------------------------------------- MindSpeed math
def matmul_add_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
    """``grad + grad_output.T @ total_input`` in fp32 (MindSpeed's npu_matmul_add_fp32: the
    ATB LinearOperation with transposeA and accumulation), out of place."""
    acc = acc_dtype(grad, total_input)
    return grad.to(acc) + grad_output.to(acc).T @ total_input.to(acc)


def groupmatmul_add_fp32(x: torch.Tensor, dy: torch.Tensor, group_list: torch.Tensor,
                         grad: torch.Tensor) -> torch.Tensor:
    """MindSpeed's npu_groupmatmul_add_fp32 out of place: ``grad`` read as (G, K, N) plus
    ``x[rows_g].T @ dy[rows_g]`` per group of rows (cumulative ``group_list``), in fp32."""
    view = grad.reshape(group_list.numel(), x.size(-1), dy.size(-1))
    return npu_grouped_matmul_add(view, x, dy, group_list).reshape(grad.shape)


# --------------------------------------------------------------------------- examples
def _vals(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randint(-16, 17, shape, generator=gen) / 8).to(dtype)


def _ints(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """int8 values in [-8, 8) (negative ones: a uint8 misread would change them)."""
    return torch.randint(-8, 8, shape, generator=gen).to(torch.int8)


def _scales(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(1, 17, shape, generator=gen) / 16


def finalize_routing_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    m, k, n, e, batch = 8, 32, 256, 2, 4  # k a multiple of 16, n of 32 and >= 256 (a8w8)
    row_index = torch.randperm(m, generator=gen) // 2  # top-2 routing: two rows per token
    return (_ints(gen, m, k), _ints(gen, e, k, n), torch.tensor([3, 5])), {
        "scale": _scales(gen, e, n) / 64, "pertoken_scale": _scales(gen, m),
        "shared_input": _vals(gen, 2, n), "logit": _scales(gen, m),
        "row_index": row_index.to(torch.int64), "shared_input_offset": 1, "output_bs": batch}


def alltoallv_gmm_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    counts = [1, 2, 0, 1, 1, 0, 2, 1] + [0] * 8  # 2 local experts, ep_world_size 8
    return (_vals(gen, sum(counts), 8), _vals(gen, 2, 8, 4), "ep_group", 8, counts, counts), {
        "mm_x": _vals(gen, 3, 8), "mm_weight": _vals(gen, 8, 4), "permute_out_flag": True}


def gmm_alltoallv_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    counts = [1, 2, 0, 1, 1, 0, 2, 1] + [0] * 8
    return (_vals(gen, sum(counts), 8), _vals(gen, 2, 8, 4), "ep_group", 8, counts, counts), {
        "mm_x": _vals(gen, 3, 8), "mm_weight": _vals(gen, 8, 4)}


def all_gather_base_mm_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # k in [256, 65535): the doc's range
    return (_vals(gen, 2, 256) / 4, _vals(gen, 256, 4) / 4, "tp_group", 2), {}


def grouped_matmul_add_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_vals(gen, 3, 8, 5, dtype=_F32), _vals(gen, 6, 8), _vals(gen, 6, 5),
            torch.tensor([2, 2, 6])), {}


def _returns_none(*args: Any, **kwargs: Any) -> None:
    """What MindSpeed's in-place accumulations return (see the module docstring)."""
    return None


def matmul_add_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_vals(gen, 6, 8), _vals(gen, 6, 5), _vals(gen, 5, 8, dtype=_F32)), {}


def matmul_add_fp16_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The half-precision main_grad of npu_matmul_add_fp16 (MindSpeed's fp16 / bf16 path)."""
    return (_vals(gen, 6, 8), _vals(gen, 6, 5), _vals(gen, 5, 8)), {}


def groupmatmul_add_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_vals(gen, 6, 8), _vals(gen, 6, 5), torch.tensor([2, 2, 6]),
            _vals(gen, 3 * 8, 5, dtype=_F32)), {}


# --------------------------------------------------------------------------- MindSpeed's MC2
class LoopbackGroup:
    """A process group of ``size`` ranks in one process, for MindSpeed's MC2 wrappers (their
    references, examples and the emulation's stand-ins): what the wrappers read from a
    ``torch.distributed`` group (``ProcessGroup.size()``, ``.rank()``, ``.group_name``); the
    collectives over it are the loopback of the module docstring."""

    def __init__(self, size: int, rank: int = 0, name: str = "ep") -> None:
        self._size, self._rank, self.group_name = size, rank, name

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"LoopbackGroup(size={self._size}, rank={self._rank}, name={self.group_name!r})"


def group_info(group: Any) -> tuple[str, int]:
    """(communicator name, world size) of a process group, as MindSpeed's wrappers read them
    (the HCCL communicator's name stands in as the group's name)."""
    return str(getattr(group, "group_name", "") or "hcom"), int(group.size())


def all2all_grouped_matmul(
    inputs: torch.Tensor, weights: torch.Tensor, group: Any, send_counts: torch.Tensor,
    recv_counts: torch.Tensor, shared_inputs: torch.Tensor | None = None,
    shared_weight: torch.Tensor | None = None,
) -> Any:
    """MindSpeed's ``mindspeed.ops.grouped_matmul_mc2.all2all_grouped_matmul``: npu_alltoallv_gmm
    with ep_world_size = the group's size, the counts as lists, the weights not transposed;
    the experts' output, and the shared expert's as a pair when ``shared_inputs`` is given."""
    hcom, world = group_info(group)
    y, mm_y, _ = npu_alltoallv_gmm(inputs, weights, hcom, world, send_counts.tolist(),
                                   recv_counts.tolist(), mm_x=shared_inputs,
                                   mm_weight=shared_weight)
    return (y, mm_y) if shared_inputs is not None else y


def grouped_matmul_all2all(
    inputs: torch.Tensor, weights: torch.Tensor, group: Any, send_counts: torch.Tensor,
    recv_counts: torch.Tensor, shared_inputs: torch.Tensor | None = None,
    shared_weight: torch.Tensor | None = None,
) -> Any:
    """MindSpeed's ``grouped_matmul_all2all``: npu_gmm_alltoallv as all2all_grouped_matmul
    calls npu_alltoallv_gmm."""
    hcom, world = group_info(group)
    y, mm_y = npu_gmm_alltoallv(inputs, weights, hcom, world, send_counts.tolist(),
                                recv_counts.tolist(), mm_x=shared_inputs, mm_weight=shared_weight)
    return (y, mm_y) if shared_inputs is not None else y


# counts[r * e + j] for 8 ranks, 2 local experts (what rank 0 sends to / receives from each);
# the same both ways, so the loopback is the local part of a balanced exchange
MC2_COUNTS = (1, 2, 0, 1, 1, 0, 2, 1) + (0,) * 8


def all2all_grouped_matmul_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    counts = torch.tensor(MC2_COUNTS)
    return (_vals(gen, sum(MC2_COUNTS), 8), _vals(gen, 2, 8, 4), LoopbackGroup(8), counts,
            counts.clone()), {}


def grouped_matmul_all2all_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    counts = torch.tensor(MC2_COUNTS)
    return (_vals(gen, sum(MC2_COUNTS), 4), _vals(gen, 2, 4, 8), LoopbackGroup(8), counts,
            counts.clone()), {}


def _int_list(counts: Any) -> list[int]:
    return counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]


def alltoallv_permute_gmm(
    gmm1_inputs: torch.Tensor, weight1: torch.Tensor, ep_group: Any, group_list: Any,
    share_cached_fc1_input: torch.Tensor | None, share_expert_weight1: torch.Tensor | None,
    use_shared_experts: bool | None = False, send_counts: Any = None, recv_counts: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MindSpeed's ``mc2_fuse_a2a.AlltoallvPermuteGmm``: npu_alltoallv_gmm (no transposes),
    the shared expert's pair only with ``use_shared_experts``; (experts' output, shared
    expert's output or None)."""
    hcom, world = group_info(ep_group)
    mm_x, mm_w = ((share_cached_fc1_input, share_expert_weight1) if use_shared_experts
                  else (None, None))
    y, mm_y, _ = npu_alltoallv_gmm(gmm1_inputs, weight1, hcom, world, _int_list(send_counts),
                                   _int_list(recv_counts), mm_x=mm_x, mm_weight=mm_w)
    return y, mm_y


def gmm_unpermute_alltoallv(
    gmm2_inputs: torch.Tensor, weight2: torch.Tensor, ep_group: Any, group_list: Any,
    share_cached_fc2_input: torch.Tensor | None, share_expert_weight2: torch.Tensor | None,
    use_shared_experts: bool | None = False, send_counts: Any = None, recv_counts: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MindSpeed's ``mc2_fuse_a2a.GmmUnpermuteAlltoallv``: npu_gmm_alltoallv with the counts
    swapped (it sends recv_counts and receives send_counts)."""
    hcom, world = group_info(ep_group)
    mm_x, mm_w = ((share_cached_fc2_input, share_expert_weight2) if use_shared_experts
                  else (None, None))
    y, mm_y = npu_gmm_alltoallv(gmm2_inputs, weight2, hcom, world, _int_list(recv_counts),
                                _int_list(send_counts), mm_x=mm_x, mm_weight=mm_w)
    return y, mm_y


def _tokens_per_expert(e: int = 2) -> torch.Tensor:
    """The rows each local expert gets from every rank (Megatron's tokens_per_expert)."""
    return torch.tensor(_counts_per_expert(MC2_COUNTS, len(MC2_COUNTS) // e, e))


def alltoallv_permute_gmm_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # as experts.py calls it: no shared expert (None, None, None), the dispatcher's lists
    return (_vals(gen, sum(MC2_COUNTS), 8), _vals(gen, 2, 8, 4), LoopbackGroup(8),
            _tokens_per_expert(), None, None, None, list(MC2_COUNTS), list(MC2_COUNTS)), {}


def gmm_unpermute_alltoallv_example(gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_vals(gen, sum(MC2_COUNTS), 4), _vals(gen, 2, 4, 8), LoopbackGroup(8),
            _tokens_per_expert(), None, None, None, list(MC2_COUNTS), list(MC2_COUNTS)), {}


def column_seq_parallel_linear(
    input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
    all_gather_recomputation: bool = True, gradient_accumulation_fusion: bool = False,
) -> torch.Tensor:
    """MindSpeed's ``mc2_feature.linear_function.ColumnSeqParallelLinearFunction``: the
    sequence-parallel input (s, b, h) flattened to (s * b, h), all-gathered and multiplied by
    ``weight.t()`` in npu_all_gather_base_mm, the bias added after; (world * s, b, n)."""
    hcom, world = group_info(group)
    x = input_.reshape(input_.shape[0] * input_.shape[1], input_.shape[2])
    out, _ = npu_all_gather_base_mm(x, weight.t(), hcom, world, bias=None, gather_index=0,
                                    gather_output=not all_gather_recomputation)
    if bias is not None:
        out = out + bias
    return out.view(out.shape[0] // input_.shape[1], input_.shape[1], out.shape[1])


def column_seq_parallel_linear_example(
        gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # (s, b, h) = (2, 1, 256): h in the op's [256, 65535); a tensor-parallel group of 2.  The
    # weight reads 4 of the 256 features (+-1/4 each), so that every result is exact or one
    # rounding away in bf16: MindSpeed rounds twice where the reference (fp32) rounds once (the
    # bias added after the kernel, the reduce-scatter after the input-gradient matmul), which a
    # dense example turns into msprobe-sized differences on 16 elements
    weight = torch.zeros(4, 256)
    signs = torch.randint(0, 2, (4,), generator=gen) * 2 - 1
    weight[torch.arange(4), torch.randperm(256, generator=gen)[:4]] = signs / 4
    return (_vals(gen, 2, 1, 256) / 4, weight.to(torch.bfloat16), _vals(gen, 4),
            LoopbackGroup(2, name="tp"), True, False), {}


_MC2 = "MindSpeed master, mindspeed/"
_LOOP = "; the collectives a loopback in one process (LoopbackGroup)"


_MS = "MindSpeed master, docs/zh/ops/"
_NONE = ("; returns None as the op does: the accumulation goes into grad, which the compare "
         "does not judge (the stand-in runs matmul_add_fp32 / groupmatmul_add_fp32)")

REFERENCES: tuple[Reference, ...] = (
    Reference("mindspeed.npu_matmul_add_fp32", _returns_none, example=matmul_add_example,
              source=f"{_MS}npu_matmul_add.md{_NONE}"),
    Reference("mindspeed.npu_matmul_add_fp16", _returns_none, example=matmul_add_fp16_example,
              source="MindSpeed master 028de58c, mindspeed/ops/npu_matmul_add.py "
                     "(npu_matmul_add_fp16: grad.add_(grad_output.t().matmul(total_input))); "
                     "returns None as the op does: the accumulation goes into grad, which the "
                     "compare does not judge"),
    Reference("mindspeed.npu_groupmatmul_add_fp32", _returns_none,
              example=groupmatmul_add_example, source=f"{_MS}npu_groupmatmul_add.md{_NONE}"),
    Reference("npu_grouped_matmul_finalize_routing", npu_grouped_matmul_finalize_routing,
              example=finalize_routing_example,
              source=f"{_DOCS} (a8w8); CANN aclnnGroupedMatmulFinalizeRouting"),
    Reference("npu_alltoallv_gmm", npu_alltoallv_gmm, example=alltoallv_gmm_example,
              source=f"{_DOCS}, _meta_registrations.py (all-to-all as a loopback in one "
                     "process)"),
    Reference("npu_gmm_alltoallv", npu_gmm_alltoallv, example=gmm_alltoallv_example,
              source=f"{_DOCS}, _meta_registrations.py (all-to-all as a loopback in one "
                     "process)"),
    Reference("npu_all_gather_base_mm", npu_all_gather_base_mm,
              example=all_gather_base_mm_example,
              source=f"{_DOCS}, _meta_registrations.py (all-gather of identical shards in one "
                     "process)"),
    Reference("npu_grouped_matmul_add", npu_grouped_matmul_add,
              example=grouped_matmul_add_example, source=f"{_DOCS} (npu_grouped_matmul_add)"),
    Reference("mindspeed.all2all_grouped_matmul", all2all_grouped_matmul,
              example=all2all_grouped_matmul_example,
              source=f"{_MC2}ops/grouped_matmul_mc2.py over npu_alltoallv_gmm{_LOOP}"),
    Reference("mindspeed.grouped_matmul_all2all", grouped_matmul_all2all,
              example=grouped_matmul_all2all_example,
              source=f"{_MC2}ops/grouped_matmul_mc2.py over npu_gmm_alltoallv{_LOOP}"),
    Reference("mindspeed.AlltoallvPermuteGmm", alltoallv_permute_gmm,
              example=alltoallv_permute_gmm_example,
              source=f"{_MC2}core/transformer/moe/moe_feature/mc2moe/mc2_fuse_a2a.py over "
                     f"npu_alltoallv_gmm{_LOOP}"),
    Reference("mindspeed.GmmUnpermuteAlltoallv", gmm_unpermute_alltoallv,
              example=gmm_unpermute_alltoallv_example,
              source=f"{_MC2}core/transformer/moe/moe_feature/mc2moe/mc2_fuse_a2a.py over "
                     f"npu_gmm_alltoallv{_LOOP}"),
    Reference("mindspeed.ColumnSeqParallelLinearFunction", column_seq_parallel_linear,
              example=column_seq_parallel_linear_example,
              source=f"{_MC2}core/tensor_parallel/mc2_feature/linear_function.py over "
                     f"npu_all_gather_base_mm{_LOOP}"),
)
