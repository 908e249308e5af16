"""Emulated ops of the attention family: one ``EmulatedOp`` entry per op (see
``_family``); their references live in ``opcontracts.reference._fam_attention``.

Backward: ``npu_fusion_attention`` and ``npu_fusion_attention_v2`` have backward kernels of
their own in torch_npu (op-plugin's ``derivatives.yaml``: ``npu_fusion_attention_grad`` gets the
forward's inputs, its output and softmax statistics; MindSpeed's ``FusionAttentionV2Function``
calls ``npu_fusion_attention_grad_v2`` the same way).  So their emulated backward calls those
ops as the C++ nodes do, through the ``OpOverload`` captured at install (``_captured``), as the
permute/unpermute backward does: the patch's dispatcher guard on the grad op sees the backward
call (nested under the forward's record), the grad
kernel's own dtype profile applies, the NaN sentinel and the shadow compare name the grad
kernel, and ``torch.compile`` traces it through its fake.  MindSpeed's ring attention calls the
grad kernels directly, so they need contracts and emulation of their own anyway.

Fakes follow the meta kernels (torch_npu 2.14.0 ``_meta_registrations.py``): attention_out in
query's dtype with value's head dim, softmax statistics fp32 (B, N, Sq, 8) or (T, N, 8) in TND,
an empty softmax_in; the grad kernels return dq/dk/dv in query's dtype and shapes of
query/key/value, dpse in pse's (empty without), dsink in sink's (empty without).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..reference import _attention as R
from ..reference import _attention_infer as RI
from ..reference import _fam_attention_v3 as R3
from . import _captured
from ._family import EmulatedOp

__all__ = ["OPS"]

FLOATS = ("bf16", "fp16", "fp32")
MASKS = ("bool", "uint8")
FP32 = ("fp32",)
_F32 = torch.float32


# --------------------------------------------------------------------------- fakes
def _fake_of(reference: Callable[..., Any], body: Callable[[dict[str, Any]], Any]
             ) -> Callable[..., Any]:
    """A fake with the reference's (the schema's) parameters: the registration maps every
    argument by name to the dtype the kernel assumes (``_raw.fake_view``) before ``body`` sees
    them, so a misread input gives the fake the output dtypes the kernel gives."""
    sig = inspect.signature(reference)

    def fake(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(bound.arguments)

    fake.__signature__ = sig  # type: ignore[attr-defined]
    fake.__name__ = f"{reference.__name__}_fake"
    return fake


def _heads(query: torch.Tensor, key: torch.Tensor, head_num: int, layout: str) -> tuple[Any, Any]:
    if layout in ("BSH", "SBH"):
        d = query.size(2) // head_num
        return head_num, key.size(2) // d
    if layout == "TND":
        return query.size(1), key.size(1)
    i = 2 if layout == "BSND" else 1
    return query.size(i), key.size(i)


def _attention_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                   layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention_out, softmax statistic) fakes of one forward call."""
    layout = layout.upper()
    n, nkv = _heads(query, key, head_num, layout)
    if layout == "TND":
        out = query.new_empty((query.size(0), n, value.size(2)))
        stats = query.new_empty((query.size(0), n, 8), dtype=_F32)
        return out, stats
    if layout in ("BSH", "SBH"):
        dv = value.size(2) // nkv
        out = query.new_empty((query.size(0), query.size(1), n * dv))
        b, s = (query.size(0), query.size(1)) if layout == "BSH" else (query.size(1), query.size(0))
    else:
        shape = list(query.shape)
        shape[3] = value.size(3)
        out = query.new_empty(shape)
        b, s = (query.size(0), query.size(2)) if layout == "BNSD" else (query.size(0), query.size(1))
    return out, query.new_empty((b, n, s, 8), dtype=_F32)


def _fa(a: dict[str, Any]) -> tuple[Any, ...]:
    out, stats = _attention_out(a["query"], a["key"], a["value"], a["head_num"],
                                a["input_layout"])
    return (out, stats, stats.new_empty(stats.shape), a["query"].new_empty((0,)), 0, 0, 0)


def _fa3(a: dict[str, Any]) -> tuple[Any, ...]:
    out, stats = _attention_out(a["query"], a["key"], a["value"], a["head_num"],
                                a["input_layout"])
    seed = a["query"].new_empty((1,), dtype=torch.int64)
    return (out, stats, stats.new_empty(stats.shape), a["query"].new_empty((0,)), seed,
            seed.new_empty((1,)))


def _ring(a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return (a["prev_attn_out"].new_empty(a["prev_attn_out"].shape),
            a["prev_softmax_max"].new_empty(a["prev_softmax_max"].shape),
            a["prev_softmax_sum"].new_empty(a["prev_softmax_sum"].shape))


def _grads(a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    query, pse, sink = a["query"], a["pse"], a["sink"]
    dq = query.new_empty(query.shape)
    dk = query.new_empty(a["key"].shape)
    dv = query.new_empty(a["value"].shape)
    dpse = pse.new_empty(pse.shape) if pse is not None else query.new_empty((0,))
    dsink = sink.new_empty(sink.shape) if sink is not None else query.new_empty((0,), dtype=_F32)
    return dq, dk, dv, dpse, dsink


def _grads_v2(a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    dq, dk, dv, dpse, dsink = _grads(a)
    query, qr, kr = a["query"], a["query_rope"], a["key_rope"]
    dqr = query.new_empty(qr.shape) if qr is not None else query.new_empty((0,))
    dkr = query.new_empty(kr.shape) if kr is not None else query.new_empty((0,))
    return dq, dk, dv, dpse, dqr, dkr, dsink


# --------------------------------------------------------------------------- serving fakes
def _infer_dtype(a: dict[str, Any], rope: torch.Tensor | None = None) -> torch.dtype:
    """The meta kernels' output dtype: int8 with quant_scale2, float16 (or query_rope's) for an
    int8 query, else query's."""
    q = a["query"]
    if a.get("quant_scale2") is not None:
        return torch.int8
    if q.dtype == torch.int8:
        return rope.dtype if rope is not None else torch.float16
    return q.dtype


def _pfa(a: dict[str, Any]) -> torch.Tensor:
    q, layout = a["query"], a["input_layout"]
    shape: list[Any] = list(q.shape)
    if layout == "BNSD_BSND":
        shape = [q.size(0), q.size(2), q.size(1), q.size(3)]
    elif layout == "TND":
        shape = [q.size(0), q.size(1), a["value"].size(2)]
    return q.new_empty(shape, dtype=_infer_dtype(a))


def _ifa(a: dict[str, Any]) -> torch.Tensor:
    return a["query"].new_empty(a["query"].shape, dtype=_infer_dtype(a))


def _fia(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu 2.14.0's meta kernel: the out layout of input_layout, value's head dim."""
    q, value, heads = a["query"], a["value"], a["num_heads"]
    kv_heads = a["num_key_value_heads"] or heads
    q_layout, out_layout = RI.split_layout(a["input_layout"])
    if a["block_table"] is not None:
        dv = value.size(2) // kv_heads if value.dim() == 3 else (
            value.size(3) if value.dim() == 4 else value.size(2) * value.size(4))
    elif q_layout == "BSH":
        dv = value.size(2) // kv_heads
    elif q_layout in ("BNSD", "BSND"):
        dv = value.size(3)
    else:
        dv = value.size(2)
    if value.dtype == torch.int32:  # int4 carried in int32
        dv = dv * 8
    if q_layout in ("TND", "NTD"):
        t, n, d = (q.size(0), q.size(1), q.size(2)) if q_layout == "TND" else \
            (q.size(1), q.size(0), q.size(2))
        b = s = 0
    else:
        b, s, n, d = {"BSH": lambda: (q.size(0), q.size(1), heads, q.size(2) // heads),
                      "BSND": lambda: (q.size(0), q.size(1), q.size(2), q.size(3)),
                      "BNSD": lambda: (q.size(0), q.size(2), q.size(1), q.size(3)),
                      "NSD": lambda: (1, q.size(1), q.size(0), q.size(2))}[q_layout]()
    dv = dv if dv != 0 and d != 0 else d
    shape: list[Any] = {"BSH": lambda: [b, s, n * dv], "BSND": lambda: [b, s, n, dv],
                        "BNSD": lambda: [b, n, s, dv], "NBSD": lambda: [n, b, s, dv],
                        "TND": lambda: [t, n, dv], "NTD": lambda: [n, t, dv],
                        "NSD": lambda: [n, s, dv]}[out_layout]()
    out = q.new_empty(shape, dtype=_infer_dtype(a, a["query_rope"]))
    if not a["softmax_lse_flag"]:
        return out, q.new_empty((0,), dtype=_F32)
    if q_layout in ("TND", "NTD"):
        return out, q.new_empty((t, n, 1), dtype=_F32)
    return out, q.new_empty((b, n, s, 1), dtype=_F32)


# --------------------------------------------------------------------------- backward
def _dy(outputs: Any, grads: Any) -> torch.Tensor:
    g = grads[0]
    return g if g is not None else torch.zeros_like(outputs[0])


def _fa_grad(kernel: str, inputs: dict[str, Any], outputs: Any, grads: Any,
             **extra: Any) -> dict[str, Any]:
    """torch_npu's autograd formula (op-plugin derivatives.yaml): the grad ``kernel`` on the
    forward's inputs, attention_out (result0), softmax statistics (result1-3) and the dropout
    seed and offset (result4-5)."""
    i = inputs
    dq, dk, dv, dpse, dsink = _captured.call(kernel,
        i["query"], i["key"], i["value"], _dy(outputs, grads), i["head_num"], i["input_layout"],
        pse=i["pse"], padding_mask=i["padding_mask"], atten_mask=i["atten_mask"],
        softmax_max=outputs[1], softmax_sum=outputs[2], softmax_in=outputs[3],
        attention_in=outputs[0], scale_value=i["scale"], keep_prob=i["keep_prob"],
        pre_tockens=i["pre_tockens"], next_tockens=i["next_tockens"],
        inner_precise=i["inner_precise"], seed=outputs[4], offset=outputs[5], **extra,
        prefix=i["prefix"], actual_seq_qlen=i["actual_seq_qlen"],
        actual_seq_kvlen=i["actual_seq_kvlen"], sparse_mode=i["sparse_mode"],
        gen_mask_parallel=i["gen_mask_parallel"], sync=i["sync"],
        softmax_layout=i["softmax_layout"], sink=i["sink"])
    return {"query": dq, "key": dk, "value": dv,
            "pse": dpse if i["pse"] is not None else None,
            "sink": dsink if i["sink"] is not None else None}


def _fa_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """v1: the grad kernel, with the dropout mask's element count (result6)."""
    return _fa_grad("npu_fusion_attention_grad", inputs, outputs, grads, numels=outputs[6])


def _fa_v3_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """v1's formula through the v3 grad kernel (the seed and offset as tensors)."""
    return _fa_grad("npu_fusion_attention_grad_v3", inputs, outputs, grads)


def _fa_v2_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """MindSpeed's FusionAttentionV2Function.backward: the v2 grad kernel, same arguments."""
    i = inputs
    dq, dk, dv, dpse, dqr, dkr, dsink = _captured.call("npu_fusion_attention_grad_v2",
        i["query"], i["key"], i["value"], _dy(outputs, grads), i["head_num"], i["input_layout"],
        pse=i["pse"], padding_mask=i["padding_mask"], atten_mask=i["atten_mask"],
        softmax_max=outputs[1], softmax_sum=outputs[2], softmax_in=outputs[3],
        attention_in=outputs[0], query_rope=i["query_rope"], key_rope=i["key_rope"],
        scale_value=i["scale"], keep_prob=i["keep_prob"], pre_tokens=i["pre_tokens"],
        next_tokens=i["next_tokens"], inner_precise=i["inner_precise"], seed=outputs[4],
        offset=outputs[5], numels=outputs[6], prefix=i["prefix"],
        actual_seq_qlen=i["actual_seq_qlen"], actual_seq_kvlen=i["actual_seq_kvlen"],
        sparse_mode=i["sparse_mode"], gen_mask_parallel=i["gen_mask_parallel"], sync=i["sync"],
        pse_type=i["pse_type"], q_start_idx=i["q_start_idx"], kv_start_idx=i["kv_start_idx"],
        softmax_layout=i["softmax_layout"], sink=i["sink"])
    return {"query": dq, "key": dk, "value": dv,
            "pse": dpse if i["pse"] is not None else None,
            "query_rope": dqr if i["query_rope"] is not None else None,
            "key_rope": dkr if i["key_rope"] is not None else None,
            "sink": dsink if i["sink"] is not None else None}


# --------------------------------------------------------------------------- the ops
_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"
# query/key/value/pse fp16/bf16/fp32, atten_mask bool/uint8 (every doc since 2.5.1); sink fp32
# (the v2 doc: "数据类型仅支持float32"; the v1 doc's sink example passes float32)
_FA_DTYPES = {"query": FLOATS, "key": FLOATS, "value": FLOATS, "pse": FLOATS,
              "atten_mask": MASKS, "sink": FP32}
# the grad kernels: the forward's inputs, dy and attention_in like query, the statistics fp32
_FA_GRAD_DTYPES = {**_FA_DTYPES, "dy": FLOATS, "attention_in": FLOATS,
                   "softmax_max": FP32, "softmax_sum": FP32}

# v2: query_rope/key_rope bfloat16 only (the v2 doc)
_FA2_DTYPES = {**_FA_DTYPES, "query_rope": ("bf16",), "key_rope": ("bf16",)}
_FA2_GRAD_DTYPES = {**_FA_GRAD_DTYPES, "query_rope": ("bf16",), "key_rope": ("bf16",)}

# serving (Atlas A2/A3 tables): float16/bfloat16 query; int8 key/value read correctly (the
# antiquant mode); the quantized query modes are not emulated (the reference raises)
HALVES = ("bf16", "fp16")
_INFER_MASK = ("bool", "int8", "uint8")
_PFA_DTYPES = {"query": HALVES, "key": HALVES, "value": HALVES, "pse_shift": HALVES,
               "atten_mask": _INFER_MASK}
_IFA_DTYPES = {"query": HALVES, "key": (*HALVES, "int8"), "value": (*HALVES, "int8"),
               "pse_shift": HALVES, "atten_mask": _INFER_MASK, "block_table": ("int32",),
               "antiquant_scale": HALVES, "antiquant_offset": HALVES}
_FIA_DTYPES = {**_IFA_DTYPES, "query_rope": HALVES, "key_rope": HALVES}

OPS: tuple[EmulatedOp, ...] = (
    EmulatedOp("npu_fusion_attention", fake=_fake_of(R.npu_fusion_attention, _fa),
               dtypes=_FA_DTYPES, backward=_fa_backward,
               source=f"{_DOCS} (npu_fusion_attention)"),
    EmulatedOp("npu_fusion_attention_grad", fake=_fake_of(R.npu_fusion_attention_grad, _grads),
               dtypes=_FA_GRAD_DTYPES,
               source=f"{_DOCS} (npu_fusion_attention: its backward kernel has no doc)"),
    EmulatedOp("npu_fusion_attention_v2", fake=_fake_of(R.npu_fusion_attention_v2, _fa),
               dtypes=_FA2_DTYPES, backward=_fa_v2_backward,
               source=f"{_DOCS} (npu_fusion_attention_v2)"),
    EmulatedOp("npu_fusion_attention_grad_v2",
               fake=_fake_of(R.npu_fusion_attention_grad_v2, _grads_v2),
               dtypes=_FA2_GRAD_DTYPES,
               source=f"{_DOCS} (npu_fusion_attention_v2: its backward kernel has no doc)"),
    # v3: v1's kernel with int64 length tensors (their values read, as v1's int[] lists: no
    # dtype of theirs is misread), seed / offset tensors (torch_npu 2.14.0 schema)
    EmulatedOp("npu_fusion_attention_v3", fake=_fake_of(R3.npu_fusion_attention_v3, _fa3),
               dtypes=_FA_DTYPES, backward=_fa_v3_backward, source=f"{_DOCS} (npu_fusion_attention_v3)"),
    EmulatedOp("npu_fusion_attention_grad_v3",
               fake=_fake_of(R3.npu_fusion_attention_grad_v3, _grads),
               dtypes=_FA_GRAD_DTYPES,
               source=f"{_DOCS} (npu_fusion_attention_v3: its backward kernel has no doc)"),
    # attention out fp16/fp32/bf16, the statistics fp32, actual_seq_qlen int64 (the doc)
    EmulatedOp("npu_ring_attention_update", fake=_fake_of(R3.npu_ring_attention_update, _ring),
               dtypes={"prev_attn_out": FLOATS, "cur_attn_out": FLOATS,
                       "prev_softmax_max": FP32, "prev_softmax_sum": FP32,
                       "cur_softmax_max": FP32, "cur_softmax_sum": FP32,
                       "actual_seq_qlen": ("int64",)},
               source=f"{_DOCS} (npu_ring_attention_update)"),
    EmulatedOp("npu_prompt_flash_attention",
               fake=_fake_of(RI.npu_prompt_flash_attention, _pfa), dtypes=_PFA_DTYPES,
               source=f"{_DOCS} (npu_prompt_flash_attention)"),
    EmulatedOp("npu_incre_flash_attention",
               fake=_fake_of(RI.npu_incre_flash_attention, _ifa), dtypes=_IFA_DTYPES,
               source=f"{_DOCS} (npu_incre_flash_attention)"),
    EmulatedOp("npu_fused_infer_attention_score",
               fake=_fake_of(RI.npu_fused_infer_attention_score, _fia), dtypes=_FIA_DTYPES,
               source=f"{_DOCS} (npu_fused_infer_attention_score)"),
)
