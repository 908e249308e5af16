"""References of the attention family: the training kernels (``_attention``: fusion
attention, its v2 and their grad kernels) and the serving kernels (``_attention_infer``), their
example inputs, and one ``Reference`` entry per op in ``REFERENCES`` (``_table`` appends them).

Examples follow ``_examples``' conventions: small, conforming for the shipped contracts and read
correctly by every emulation profile, floating values multiples of 1/8 (exact in every float
dtype), every optional tensor argument the kernel reads given (so the probe varies its dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _attention, _attention_infer
from ._entry import Reference

__all__ = ["REFERENCES"]

Example = tuple[tuple[Any, ...], dict[str, Any]]
BF16 = torch.bfloat16

_DOCS = "torch_npu 2.14.0 _op_plugin_docs.py"
_META = "_meta_registrations.py"


def _vals(gen: torch.Generator, *shape: int, div: int = 8) -> torch.Tensor:
    return (torch.randint(-16, 17, shape, generator=gen) / div).to(BF16)


def _causal(sq: int, skv: int) -> torch.Tensor:
    return torch.ones(sq, skv, dtype=torch.bool).triu(1)


# --------------------------------------------------------------------------- training
def _tnd(gen: torch.Generator, heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    """Two packed sequences of 3 and 4 tokens: query, key, value (7, heads, dim)."""
    return tuple(_vals(gen, 7, heads, dim, div=32) for _ in range(3))


_SEQS = {"actual_seq_qlen": [3, 7], "actual_seq_kvlen": [3, 7]}


def fusion_attention(gen: torch.Generator) -> Example:
    """Varlen (TND), two sequences, with the SS mask tile of the longest (sparse_mode 0), pse
    (its rows per sequence) and a sink per head."""
    q, k, v = _tnd(gen)
    pse = _vals(gen, 1, 2, 4, 4)
    sink = torch.tensor([0.5, -0.25])
    return (q, k, v, 2, "TND"), {"pse": pse, "atten_mask": _causal(4, 4), "scale": 0.25,
                                 **_SEQS, "sparse_mode": 0, "sink": sink}


def fusion_attention_v2(gen: torch.Generator) -> Example:
    """Varlen (TND) with query_rope/key_rope (bf16; the doc: with the mask, no pse) and a sink."""
    q, k, v = _tnd(gen)
    q_rope, k_rope = (_vals(gen, 7, 2, 8, div=32) for _ in range(2))
    sink = torch.tensor([0.5, -0.25])
    return (q, k, v, 2, "TND"), {"atten_mask": _causal(4, 4), "query_rope": q_rope,
                                 "key_rope": k_rope, "scale": 0.25, **_SEQS, "sparse_mode": 0,
                                 "pse_type": 1, "sink": sink}


def _grad_of(example: Example, forward: Any) -> Example:
    """The forward example's inputs, its output and statistics, and an incoming gradient."""
    (q, k, v, n, layout), kw = example
    gen = torch.Generator().manual_seed(7)
    out, smax, ssum, sin, *_ = forward(q, k, v, n, layout, **kw)
    dy = _vals(gen, *out.shape)
    kw = dict(kw)
    kw["scale_value"] = kw.pop("scale")
    return (q, k, v, dy, n, layout), {**kw, "softmax_max": smax, "softmax_sum": ssum,
                                      "softmax_in": sin, "attention_in": out}


def fusion_attention_grad(gen: torch.Generator) -> Example:
    return _grad_of(fusion_attention(gen), _attention.npu_fusion_attention)


def fusion_attention_grad_v2(gen: torch.Generator) -> Example:
    return _grad_of(fusion_attention_v2(gen), _attention.npu_fusion_attention_v2)


# --------------------------------------------------------------------------- MindSpeed
_BIG = 2147483647


def mindspeed_fusion_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
    input_layout: str, *, pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
    scale: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = _BIG,
    next_tokens: int = _BIG, inner_precise: int = 0, prefix: Any = None,
    actual_seq_qlen: Any = None, actual_seq_kvlen: Any = None, sparse_mode: int = 0,
    gen_mask_parallel: bool = True, sync: bool = False, pse_type: int = 1,
    q_start_idx: Any = None, kv_start_idx: Any = None,
) -> tuple[Any, ...]:
    """MindSpeed's ``mindspeed.ops.fusion_attention_v2.npu_fusion_attention``: the v2 kernel."""
    return _attention.npu_fusion_attention_v2(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        sparse_mode=sparse_mode, pse_type=pse_type, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx)


def mindspeed_fusion_attention_grad(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad_outputs: torch.Tensor,
    head_num: int, input_layout: str, *, pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None, softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None, attention_in: torch.Tensor | None = None,
    scale: float = 1.0, keep_prob: float = 1.0, pre_tokens: int = _BIG,
    next_tokens: int = _BIG, inner_precise: int = 0, seed: int = 1234, offset: int = 0,
    numels: int = 0, prefix: Any = None, actual_seq_qlen: Any = None,
    actual_seq_kvlen: Any = None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False, pse_type: int = 1, q_start_idx: Any = None, kv_start_idx: Any = None,
) -> tuple[Any, ...]:
    """MindSpeed's ``npu_fusion_attention_grad``: (dq, dk, dv, dpse), dpse None without pse."""
    dq, dk, dv, dpse, *_ = _attention.npu_fusion_attention_grad_v2(
        query, key, value, grad_outputs, head_num, input_layout, pse=pse,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        attention_in=attention_in, scale_value=scale, pre_tokens=pre_tokens,
        next_tokens=next_tokens, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=pse_type,
        q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)
    return dq, dk, dv, (dpse if pse is not None else None)


def ms_fusion_attention(gen: torch.Generator) -> Example:
    """MindSpeed's: varlen (TND) with pse and the SS mask tile, bf16 (no sink, no float32)."""
    (q, k, v, n, layout), kw = fusion_attention(gen)
    kw.pop("sink")
    return (q, k, v, n, layout), {**kw, "pse_type": 1}


def ms_fusion_attention_grad(gen: torch.Generator) -> Example:
    (q, k, v, dy, n, layout), kw = _grad_of(ms_fusion_attention(gen),
                                            mindspeed_fusion_attention)
    kw["scale"] = kw.pop("scale_value")
    return (q, k, v, dy, n, layout), kw


_MS = "MindSpeed master, docs/zh/ops/fusion_attention.md"

# --------------------------------------------------------------------------- serving
def _paged(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A decode step on a paged KV cache: query (2, 2, 1, 8) BNSD; key/value caches of 6
    blocks of 4 tokens, (6, 4, 16); two sequences of 6 and 3 tokens in blocks [3, 1], [0, 5]."""
    q = _vals(gen, 2, 2, 1, 8, div=32)
    k, v = (_vals(gen, 6, 4, 16, div=32) for _ in range(2))
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    pse = _vals(gen, 2, 2, 1, 8)
    mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    mask[0, ..., 1] = True  # one masked position of the first sequence
    return q, k, v, table, pse, mask


def prompt_flash_attention(gen: torch.Generator) -> Example:
    """Prefill, BNSD, the causal mask (sparse_mode 0), pse_shift, a shorter second query."""
    q, k, v = (_vals(gen, 2, 2, 4, 8, div=32) for _ in range(3))
    return (q, k, v), {"atten_mask": _causal(4, 4), "pse_shift": _vals(gen, 1, 2, 4, 4),
                       "actual_seq_lengths": [4, 3], "actual_seq_lengths_kv": [4, 4],
                       "num_heads": 2, "scale_value": 0.25, "input_layout": "BNSD",
                       "num_key_value_heads": 2, "sparse_mode": 0}


def incre_flash_attention(gen: torch.Generator) -> Example:
    q, k, v, table, pse, mask = _paged(gen)
    return (q, k, v), {"atten_mask": mask, "pse_shift": pse, "actual_seq_lengths": [6, 3],
                       "block_table": table, "num_heads": 2, "scale_value": 0.25,
                       "input_layout": "BNSD", "num_key_value_heads": 2, "block_size": 4}


def fused_infer_attention_score(gen: torch.Generator) -> Example:
    q, k, v, table, pse, mask = _paged(gen)
    return (q, k, v), {"atten_mask": mask, "pse_shift": pse, "actual_seq_lengths_kv": [6, 3],
                       "block_table": table, "num_heads": 2, "scale": 0.25,
                       "input_layout": "BNSD", "num_key_value_heads": 2, "block_size": 4,
                       "softmax_lse_flag": True}


_FA = f"{_DOCS} (npu_fusion_attention), {_META}"
_FA2 = f"{_DOCS} (npu_fusion_attention_v2), {_META}"

REFERENCES: tuple[Reference, ...] = (
    Reference("npu_fusion_attention", _attention.npu_fusion_attention,
              backward=_attention.fusion_attention_backward, example=fusion_attention,
              source=f"{_FA} (softmax attention, all layouts incl. TND, sparse modes, sink; "
                     "dropout not covered)"),
    Reference("npu_fusion_attention_grad", _attention.npu_fusion_attention_grad,
              example=fusion_attention_grad, grad_of="npu_fusion_attention",
              source=f"{_FA} (derivatives of npu_fusion_attention; op-plugin derivatives.yaml "
                     "passes it the forward's outputs)"),
    Reference("npu_fusion_attention_v2", _attention.npu_fusion_attention_v2,
              backward=_attention.fusion_attention_v2_backward, example=fusion_attention_v2,
              source=f"{_FA2} (pse_type 0-3, query_rope/key_rope; dropout not covered)"),
    Reference("npu_fusion_attention_grad_v2", _attention.npu_fusion_attention_grad_v2,
              example=fusion_attention_grad_v2, grad_of="npu_fusion_attention_v2",
              source=f"{_FA2} (derivatives of npu_fusion_attention_v2)"),
    Reference("mindspeed.npu_fusion_attention", mindspeed_fusion_attention,
              example=ms_fusion_attention,
              source=f"{_MS} (the CANN v2 kernels: torch_npu's npu_fusion_attention_v2 reference)"),
    Reference("mindspeed.npu_fusion_attention_grad", mindspeed_fusion_attention_grad,
              example=ms_fusion_attention_grad, grad_of="mindspeed.npu_fusion_attention",
              source=f"{_MS} (反向接口; npu_fusion_attention_grad_v2's reference)"),
    Reference("npu_prompt_flash_attention", _attention_infer.npu_prompt_flash_attention,
              example=prompt_flash_attention,
              source=f"{_DOCS} (npu_prompt_flash_attention), {_META} (float paths; the "
                     "quantized modes not covered)"),
    Reference("npu_incre_flash_attention", _attention_infer.npu_incre_flash_attention,
              example=incre_flash_attention,
              source=f"{_DOCS} (npu_incre_flash_attention), {_META}; CANN AscendAntiQuant "
                     "(KV antiquant); full quantization not covered"),
    Reference("npu_fused_infer_attention_score",
              _attention_infer.npu_fused_infer_attention_score,
              example=fused_infer_attention_score,
              source=f"{_DOCS} (npu_fused_infer_attention_score), {_META}; CANN "
                     "AscendAntiQuant (KV antiquant); full quantization not covered"),
)
