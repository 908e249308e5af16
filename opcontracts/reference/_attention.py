"""References of ``npu_fusion_attention`` (torch_npu 2.13/2.14 ``_op_plugin_docs.py``) and of
MindSpeed's ``npu_ring_attention_update`` (MindSpeed master, docs/ops/npu_ring_attention_update.md):
softmax attention in fp32 (fp64 for fp64 inputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._util import acc_dtype

__all__ = ["attention_heads", "attention_layout_to_bnsd", "attention_scores",
           "bnsd_to_attention_layout", "expand_kv", "npu_fusion_attention",
           "npu_ring_attention_update"]


def attention_layout_to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """(B, N, S, D) view of a query/key/value in ``layout`` (``heads`` used for BSH/SBH)."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)
    raise NotImplementedError(f"input_layout {layout!r} is not covered (BSH, SBH, BSND, BNSD)")


def bnsd_to_attention_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of :func:`attention_layout_to_bnsd`."""
    b, n, s, d = t.shape
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def attention_heads(
    query: torch.Tensor, key: torch.Tensor, head_num: int, layout: str
) -> tuple[int, int]:
    """(query heads, key/value heads); BSH/SBH derive the kv heads from the query head dim."""
    if layout in ("BSH", "SBH"):
        head_dim = query.size(-1) // head_num
        return head_num, key.size(-1) // head_dim
    return query.size(-2 if layout == "BSND" else 1), key.size(-2 if layout == "BSND" else 1)


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    pse: torch.Tensor | None,
    atten_mask: torch.Tensor | None,
    sparse_mode: int,
) -> torch.Tensor:
    """``scale * q k^T + pse`` in q's dtype, masked positions (mask != 0) set to its minimum."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if pse is not None:
        scores = scores + pse.to(scores.dtype)
    sq, skv = scores.shape[-2:]
    mask: torch.Tensor | None = None
    if sparse_mode in (2, 3):  # left-up / right-down causal, mask argument is a compressed tile
        offset = 0 if sparse_mode == 2 else skv - sq
        mask = torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(1 + offset)
    elif atten_mask is not None:
        mask = atten_mask != 0
    if mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    return scores


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.size(1), dim=1) if t.size(1) != heads else t


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Softmax attention; returns (out, softmax_max, softmax_sum, softmax_in, seed, offset, numels).

    softmax_max / softmax_sum are the real per-row statistics, broadcast to (B, N, Sq, 8) fp32
    as on the NPU (no gradient flows through them); softmax_in is empty and seed/offset/numels
    are 0. Dropout (keep_prob), the token windows (pre/next_tockens) and TND layouts are not
    covered.
    """
    acc = acc_dtype(query)
    heads, k_heads = attention_heads(query, key, head_num, input_layout)
    q = attention_layout_to_bnsd(query, input_layout, heads).to(acc)
    k = expand_kv(attention_layout_to_bnsd(key, input_layout, k_heads).to(acc), heads)
    v = expand_kv(attention_layout_to_bnsd(value, input_layout, k_heads).to(acc), heads)
    scores = attention_scores(q, k, scale, pse, atten_mask, sparse_mode)
    row_max = scores.amax(dim=-1, keepdim=True)
    exp = torch.exp(scores - row_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    out = torch.matmul(exp / row_sum, v)
    out = bnsd_to_attention_layout(out, input_layout).to(query.dtype).contiguous()
    stats_shape = (*row_max.shape[:-1], 8)
    # the statistics carry no gradient: torch_npu's backward (npu_fusion_attention_grad) takes
    # the gradient of the attention output only
    return (
        out,
        row_max.detach().expand(stats_shape).contiguous(),
        row_sum.detach().expand(stats_shape).contiguous(),
        query.new_empty((0,)),
        0,
        0,
        0,
    )


def npu_ring_attention_update(
    prev_attn_out: torch.Tensor,
    prev_softmax_max: torch.Tensor,
    prev_softmax_sum: torch.Tensor,
    cur_attn_out: torch.Tensor,
    cur_softmax_max: torch.Tensor,
    cur_softmax_sum: torch.Tensor,
    actual_seq_qlen: torch.Tensor | None = None,
    layout: str = "SBH",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge two partial attention results by their softmax statistics.

    Layout "SBH": attn_out (S, B, H), stats (B, N, S, 8); layout "TND": attn_out (T, N, D),
    stats (T, N, 8). Returns (attn_out, softmax_max, softmax_sum).
    """
    new_max = torch.maximum(prev_softmax_max, cur_softmax_max)
    prev_scaled = prev_softmax_sum * torch.exp(prev_softmax_max - new_max)
    cur_scaled = cur_softmax_sum * torch.exp(cur_softmax_max - new_max)
    new_sum = prev_scaled + cur_scaled
    prev_w, cur_w = prev_scaled / new_sum, cur_scaled / new_sum
    if layout == "SBH":
        seq, batch, hidden = prev_attn_out.shape
        heads = prev_softmax_max.size(1)

        def spread(w: torch.Tensor) -> torch.Tensor:  # (B, N, S, 8) -> (S, B, H)
            per_head = w[..., 0].permute(2, 0, 1).unsqueeze(-1)
            return per_head.expand(seq, batch, heads, hidden // heads).reshape(seq, batch, hidden)

    elif layout == "TND":

        def spread(w: torch.Tensor) -> torch.Tensor:  # (T, N, 8) -> (T, N, D)
            return w[..., :1].expand_as(prev_attn_out)

    else:
        raise NotImplementedError(f"layout {layout!r} is not covered (SBH, TND)")
    acc = acc_dtype(prev_attn_out)
    out = prev_attn_out.to(acc) * spread(prev_w) + cur_attn_out.to(acc) * spread(cur_w)
    return out.to(prev_attn_out.dtype), new_max, new_sum
