"""References of the attention ops op-plugin's newer tests call: ``npu_fusion_attention_v3``
(and its grad kernel) and torch_npu's own ``npu_ring_attention_update``.

* ``npu_fusion_attention_v3`` is ``npu_fusion_attention``'s kernel with the varlen lengths given
  as int64 tensors (``Tensor? actual_seq_qlen``) instead of ``int[]``, and the dropout seed and
  offset returned as tensors, without ``numels`` (torch_npu 2.14.0 schema; op-plugin
  ``test/test_custom_ops/test_npu_flash_attention.py`` compares it with the same golden as v1);
  ``npu_fusion_attention_grad_v3`` likewise takes the seed and offset as tensors.  The math is
  the v1 references' (``_attention``), dropout included: v3's schema has no seed or offset
  argument (the kernel draws them from the NPU generator), so the forward's reference takes
  them as two keyword arguments past the schema's, which the emulation fills with its draw.
* ``npu_ring_attention_update`` (torch_npu 2.14.0 schema: ``input_layout`` "SBH" or "TND",
  ``input_softmax_layout`` "" or "TND") merges two partial attention results by their softmax
  statistics, the MindSpeed op's math (``_attention.npu_ring_attention_update``); with
  ``input_softmax_layout="TND"`` the statistics are (T, N, 8) whatever the attention layout.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _attention
from ._entry import Reference
from ._fam_attention import fusion_attention

__all__ = ["REFERENCES", "npu_fusion_attention_grad_v3", "npu_fusion_attention_v3",
           "npu_ring_attention_update"]

Example = tuple[tuple[Any, ...], dict[str, Any]]
_BIG = 2147483647
_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"


def _lengths(t: Any) -> list[int] | None:
    if t is None:
        return None
    return [int(v) for v in (t.reshape(-1).tolist() if isinstance(t, torch.Tensor) else t)]


def npu_fusion_attention_v3(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
    input_layout: str, pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
    scale: float = 1.0, keep_prob: float = 1.0, pre_tockens: int = _BIG,
    next_tockens: int = _BIG, inner_precise: int = 0, prefix: Any = None,
    actual_seq_qlen: torch.Tensor | None = None, actual_seq_kvlen: torch.Tensor | None = None,
    sparse_mode: int = 0, gen_mask_parallel: bool = True, sync: bool = False,
    softmax_layout: str = "", sink: torch.Tensor | None = None, *, seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(attention_out, softmax_max, softmax_sum, softmax_in, seed, offset): v1's outputs with
    the seed and offset as int64 tensors (zero: no dropout).  ``seed`` / ``offset`` are not the
    schema's: the NPU generator's draw for the dropout (the module docstring)."""
    out, smax, ssum, sin, drawn_seed, drawn_offset, _ = _attention.npu_fusion_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tockens=pre_tockens,
        next_tockens=next_tockens, inner_precise=inner_precise, prefix=prefix,
        actual_seq_qlen=_lengths(actual_seq_qlen), actual_seq_kvlen=_lengths(actual_seq_kvlen),
        sparse_mode=sparse_mode, gen_mask_parallel=gen_mask_parallel, sync=sync,
        softmax_layout=softmax_layout, sink=sink, seed=seed, offset=offset)
    # the kernel's glue returns them as CPU tensors (op-plugin dropout_gen_mask_tensor)
    return (out, smax, ssum, sin, torch.tensor([drawn_seed], dtype=torch.int64),
            torch.tensor([drawn_offset], dtype=torch.int64))


def npu_fusion_attention_grad_v3(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dy: torch.Tensor,
    head_num: int, input_layout: str, *, pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None, softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None, attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0, keep_prob: float = 1.0, pre_tockens: int = _BIG,
    next_tockens: int = _BIG, inner_precise: int = 0, seed: torch.Tensor | None = None,
    offset: torch.Tensor | None = None, prefix: Any = None,
    actual_seq_qlen: torch.Tensor | None = None, actual_seq_kvlen: torch.Tensor | None = None,
    sparse_mode: int = 0, gen_mask_parallel: bool = True, sync: bool = False,
    softmax_layout: str = "", sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv, dpse, dsink): v1's grad kernel, the lengths read from their tensors."""
    return _attention.npu_fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        softmax_in=softmax_in, attention_in=attention_in, scale_value=scale_value,
        keep_prob=keep_prob, pre_tockens=pre_tockens, next_tockens=next_tockens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=_lengths(actual_seq_qlen),
        actual_seq_kvlen=_lengths(actual_seq_kvlen), sparse_mode=sparse_mode,
        gen_mask_parallel=gen_mask_parallel, sync=sync, softmax_layout=softmax_layout,
        sink=sink, seed=_scalar(seed), offset=_scalar(offset))


def _scalar(t: torch.Tensor | int | None) -> int:
    if t is None:
        return 0
    return int(t.reshape(-1)[0].item()) if isinstance(t, torch.Tensor) else int(t)


def fusion_attention_v3_backward(inputs: dict[str, Any], outputs: Any, grads: Any
                                 ) -> dict[str, Any]:
    """Autograd of v3 (as v1's: op-plugin derivatives.yaml passes the forward's outputs to the
    grad kernel)."""
    i = inputs
    dy = grads[0] if grads[0] is not None else torch.zeros_like(outputs[0])
    dq, dk, dv, dpse, dsink = npu_fusion_attention_grad_v3(
        i["query"], i["key"], i["value"], dy, i["head_num"], i["input_layout"], pse=i["pse"],
        padding_mask=i["padding_mask"], atten_mask=i["atten_mask"], softmax_max=outputs[1],
        softmax_sum=outputs[2], softmax_in=outputs[3], attention_in=outputs[0],
        scale_value=i["scale"], keep_prob=i["keep_prob"], pre_tockens=i["pre_tockens"],
        next_tockens=i["next_tockens"], inner_precise=i["inner_precise"], seed=outputs[4],
        offset=outputs[5], prefix=i["prefix"],
        actual_seq_qlen=i["actual_seq_qlen"], actual_seq_kvlen=i["actual_seq_kvlen"],
        sparse_mode=i["sparse_mode"], softmax_layout=i["softmax_layout"], sink=i["sink"])
    return {"query": dq, "key": dk, "value": dv,
            "pse": dpse if i["pse"] is not None else None,
            "sink": dsink if i["sink"] is not None else None}


def npu_ring_attention_update(
    prev_attn_out: torch.Tensor, prev_softmax_max: torch.Tensor,
    prev_softmax_sum: torch.Tensor, cur_attn_out: torch.Tensor,
    cur_softmax_max: torch.Tensor, cur_softmax_sum: torch.Tensor, *,
    actual_seq_qlen: torch.Tensor | None = None, input_layout: str = "SBH",
    input_softmax_layout: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attn_out, softmax_max, softmax_sum), see the module docstring."""
    if input_layout == "SBH" and input_softmax_layout == "TND":
        raise NotImplementedError("npu_ring_attention_update: input_layout 'SBH' with "
                                  "input_softmax_layout 'TND' is not emulated")
    return _attention.npu_ring_attention_update(
        prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
        cur_softmax_sum, actual_seq_qlen, input_layout)


# --------------------------------------------------------------------------- examples
def _v3(example: Example) -> Example:
    args, kw = example
    return args, {**kw, **{k: torch.tensor(kw[k], dtype=torch.int64)
                           for k in ("actual_seq_qlen", "actual_seq_kvlen") if k in kw}}


def fusion_attention_v3(gen: torch.Generator) -> Example:
    return _v3(fusion_attention(gen))


def fusion_attention_grad_v3(gen: torch.Generator) -> Example:
    (q, k, v, n, layout), kw = fusion_attention_v3(gen)
    out, smax, ssum, sin, seed, off = npu_fusion_attention_v3(q, k, v, n, layout, **kw)
    dy = (torch.randint(-16, 17, out.shape, generator=torch.Generator().manual_seed(7)) / 8
          ).to(out.dtype)
    kw = dict(kw)
    kw["scale_value"] = kw.pop("scale")
    return (q, k, v, dy, n, layout), {**kw, "softmax_max": smax, "softmax_sum": ssum,
                                      "softmax_in": sin, "attention_in": out, "seed": seed,
                                      "offset": off}


def ring_attention_update(gen: torch.Generator) -> Example:
    """SBH: attn (S, B, H) with N heads, statistics (B, N, S, 8) (the last axis repeated)."""
    s, b, n, d = 3, 2, 2, 8
    attn = [(torch.randint(-16, 17, (s, b, n * d), generator=gen) / 8).to(torch.bfloat16)
            for _ in range(2)]
    stats = [(torch.rand(b, n, s, 1, generator=gen) + 0.5).expand(b, n, s, 8).contiguous()
             for _ in range(4)]
    return (attn[0], stats[0], stats[1], attn[1], stats[2], stats[3]), {"input_layout": "SBH"}


_FA3 = f"{_DOCS} (npu_fusion_attention_v3), torch_npu 2.14.0 schema"

REFERENCES: tuple[Reference, ...] = (
    Reference("npu_fusion_attention_v3", npu_fusion_attention_v3,
              backward=fusion_attention_v3_backward, example=fusion_attention_v3,
              source=f"{_FA3} (npu_fusion_attention's math; dropout not covered)"),
    Reference("npu_fusion_attention_grad_v3", npu_fusion_attention_grad_v3,
              example=fusion_attention_grad_v3, grad_of="npu_fusion_attention_v3",
              source=f"{_FA3} (npu_fusion_attention_grad's math)"),
    Reference("npu_ring_attention_update", npu_ring_attention_update,
              example=ring_attention_update,
              source=f"{_DOCS} (npu_ring_attention_update); MindSpeed "
                     "docs/ops/npu_ring_attention_update.md (the same kernel)"),
)
