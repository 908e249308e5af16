"""References of the serving attention kernels (torch_npu 2.14.0 ``_op_plugin_docs.py`` and
``_meta_registrations.py``): ``npu_prompt_flash_attention`` (prefill), ``npu_incre_flash_attention``
(decode) and ``npu_fused_infer_attention_score`` (both, by the query's S), in fp32.

``attention_out = softmax(scale * query key^T + pse_shift, masked) value`` per batch and head:

* layouts: query BSH, BSND, BNSD, NSD, TND, NTD, and the output layouts of the fused op's
  ``<query>_<out>`` forms (BNSD_BSND, BSH_NBSD, TND_NTD, ...: the meta kernel's table); in TND /
  NTD ``actual_seq_lengths`` / ``actual_seq_lengths_kv`` are cumulative ends;
* ``actual_seq_lengths`` / ``actual_seq_lengths_kv`` (one value for every batch, or the first B):
  query rows past a batch's length give zeros, key/value positions past it take no part;
  ``query_padding_size`` / ``kv_padding_size`` move the valid window to the end (left padding);
* PageAttention: ``block_table`` (B, blocks per sequence) into a KV cache of shape
  (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D), lengths from the kv lengths
  (the decode kernel's ``actual_seq_lengths``); block ids are not checked (the doc): an id past
  the cache reads zeros here, garbage on the NPU;
* masks: ``atten_mask`` (nonzero = masked) of shape (Q_S, KV_S), (B, KV_S) for Q_S = 1,
  (B|1, Q_S, KV_S), (B|1, 1|N, Q_S, KV_S), cut to the sizes (the doc lets S be padded up);
  ``sparse_mode`` 0 (the mask, with the pre/next_tokens band from the top left), 1 and 9 (the
  mask), 2/3 (causal from the top left / bottom right) and 4 (the band from the bottom right),
  the last three built from the mode (the compressed 2048x2048 tile is not read);
* GQA (``num_key_value_heads``), MLA's ``query_rope`` / ``key_rope`` (their product joins the
  scores), ``key_shared_prefix`` / ``value_shared_prefix`` (before every batch's key/value);
* KV antiquant (int8 key/value): ``scale * (x + offset)`` (CANN's AscendAntiQuant), per-channel /
  per-tensor (``antiquant_scale``/``antiquant_offset`` of shape (2, ...), key first), per-token
  (``antiquant_mode`` 1, or ``key_/value_antiquant_*``: (B, KV_S) float32).

Not covered (the reference raises NotImplementedError, so the emulated kernel does too): the
full-quant path (int8 query with ``dequant_scale1``/``quant_scale1``/``dequant_scale2``), the
int8 output of ``quant_scale2`` / ``quant_offset2``, int4 key/value (int32-packed), the NZ
(5-D) KV cache, the other antiquant modes of the fused op, tensor lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._attention import BIG
from ._util import acc_dtype

__all__ = ["FIA_LAYOUTS", "npu_fused_infer_attention_score", "npu_incre_flash_attention",
           "npu_prompt_flash_attention", "split_layout"]

# the fused op's meta kernel (torch_npu 2.14.0): input_layout -> (query layout, output layout)
FIA_LAYOUTS: dict[str, tuple[str, str]] = {
    "BSH": ("BSH", "BSH"), "BSND": ("BSND", "BSND"), "BNSD": ("BNSD", "BNSD"),
    "TND": ("TND", "TND"), "NTD": ("NTD", "NTD"), "NSD": ("NSD", "NSD"),
    "BNSD_BSND": ("BNSD", "BSND"), "BSH_BNSD": ("BSH", "BNSD"), "BSND_BNSD": ("BSND", "BNSD"),
    "NTD_TND": ("NTD", "TND"), "BSH_NBSD": ("BSH", "NBSD"), "BSND_NBSD": ("BSND", "NBSD"),
    "BNSD_NBSD": ("BNSD", "NBSD"), "TND_NTD": ("TND", "NTD"),
}


def split_layout(input_layout: str) -> tuple[str, str]:
    """(query layout, output layout) of an ``input_layout``."""
    if input_layout not in FIA_LAYOUTS:
        raise NotImplementedError(f"input_layout {input_layout!r} is not covered "
                                  f"({', '.join(FIA_LAYOUTS)})")
    return FIA_LAYOUTS[input_layout]


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // max(heads, 1)).transpose(1, 2)
    if layout == "NSD":
        return t.unsqueeze(0)
    raise NotImplementedError(f"layout {layout!r}")


def _from_bnsd(o: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = o.shape
    if layout == "BNSD":
        return o
    if layout == "BSND":
        return o.transpose(1, 2)
    if layout == "BSH":
        return o.transpose(1, 2).reshape(b, s, n * d)
    if layout == "NBSD":
        return o.permute(1, 0, 2, 3)
    if layout == "NSD":
        return o[0]
    raise NotImplementedError(f"output layout {layout!r}")


def _per_batch(lengths: Sequence[Any] | None, b: int, default: int) -> list[int]:
    """One length per batch: none given -> the full size; one -> every batch; else the first
    B (the docs)."""
    if lengths is None or len(lengths) == 0:
        return [default] * b
    vals = [int(x) for x in lengths]
    if len(vals) == 1:
        return vals * b
    return (vals + [default] * b)[:b]


def _cum_bounds(cum: Sequence[Any] | None, total: int) -> list[tuple[int, int]]:
    out, prev = [], 0
    for v in cum or ():
        end = min(max(int(v), prev), total)
        out.append((prev, end))
        prev = end
    return out


def _antiquant(x: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
               which: int, acc: torch.dtype) -> torch.Tensor:
    """``scale * (x + offset)``, per-channel / per-tensor (scale (2, ...): key 0, value 1)."""
    xf = x.to(acc)
    if scale is None:
        return xf
    s = scale[which].to(acc)
    o = offset[which].to(acc) if offset is not None else 0.0
    return s * (xf + o)


def _mask_block(mask: torch.Tensor | None, b: int, n_b: int, sq: int, skv: int, mode: int,
                pre: int, nxt: int, qs_full: int) -> torch.Tensor | None:
    """One batch's (N|1, sq, skv) mask, True = masked."""
    if mask is None:
        return None
    dev = mask.device
    i = torch.arange(sq, device=dev).unsqueeze(1)
    j = torch.arange(skv, device=dev).unsqueeze(0)
    d = skv - sq
    if mode == 2:
        return (j > i).unsqueeze(0)
    if mode == 3:
        return (j > i + d).unsqueeze(0)
    if mode == 4:
        return ((j > i + d + nxt) | (j < i + d - pre)).unsqueeze(0)
    m = mask != 0
    if m.dim() == 2 and qs_full == 1 and m.size(0) == n_b and m.size(0) != 1:
        m = m[b].view(1, 1, -1)  # (B, KV_S) for the decode step
    elif m.dim() == 2:
        m = m.unsqueeze(0)
    elif m.dim() == 3:
        m = m[b if m.size(0) > 1 else 0].unsqueeze(0)
    elif m.dim() == 4:
        m = m[b if m.size(0) > 1 else 0]
    else:
        raise NotImplementedError(f"atten_mask of shape {tuple(mask.shape)}")
    if m.size(-2) < sq or m.size(-1) < skv:
        raise ValueError(f"atten_mask {tuple(mask.shape)} is smaller than ({sq}, {skv})")
    m = m[..., :sq, :skv]
    if mode == 0 and (pre < BIG or nxt < BIG):
        m = m | (j > i + nxt) | (j < i - pre)
    return m


def _pse_block(pse: torch.Tensor | None, b: int, sq: int, skv: int, acc: torch.dtype
               ) -> torch.Tensor | None:
    if pse is None:
        return None
    p = pse[b if pse.size(0) > 1 else 0]
    return p[..., :sq, :skv].to(acc)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None, pse: torch.Tensor | None,
            qr: torch.Tensor | None = None, kr: torch.Tensor | None = None,
            scores_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, sq, D) x (Nkv, skv, D) -> (N, sq, Dv) and the log-sum-exp (N, sq, 1);
    ``scores_dtype``: the dtype ``q k^T`` is rounded to before the scale (None: none)."""
    n, nkv = q.size(0), k.size(0)
    if nkv != n:
        k, v = k.repeat_interleave(n // nkv, 0), v.repeat_interleave(n // nkv, 0)
        if kr is not None and kr.size(0) != n:
            kr = kr.repeat_interleave(n // kr.size(0), 0)
    s = torch.matmul(q, k.transpose(-1, -2))
    if qr is not None and kr is not None:
        s = s + torch.matmul(qr, kr.transpose(-1, -2))
    if scores_dtype is not None:
        s = s.to(scores_dtype).to(q.dtype)
    s = s * scale
    if pse is not None:
        s = s + pse
    if mask is not None:
        s = s.masked_fill(mask, torch.finfo(s.dtype).min)
    if s.size(-1) == 0:
        return q.new_zeros((n, q.size(1), v.size(-1))), q.new_zeros((n, q.size(1), 1))
    return torch.matmul(torch.softmax(s, -1), v), torch.logsumexp(s, -1, keepdim=True)


def _infer(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, num_heads: int,
           num_kv_heads: int, scale: float, input_layout: str, pse: torch.Tensor | None,
           atten_mask: torch.Tensor | None, seq_q: Sequence[Any] | None,
           seq_kv: Sequence[Any] | None, sparse_mode: int, pre: int, nxt: int,
           block_table: torch.Tensor | None = None, q_pad: torch.Tensor | None = None,
           kv_pad: torch.Tensor | None = None, antiquant_scale: torch.Tensor | None = None,
           antiquant_offset: torch.Tensor | None = None, per_token: bool = False,
           key_scale: torch.Tensor | None = None, key_offset: torch.Tensor | None = None,
           value_scale: torch.Tensor | None = None, value_offset: torch.Tensor | None = None,
           prefix_k: torch.Tensor | None = None, prefix_v: torch.Tensor | None = None,
           prefix_len: Sequence[Any] | None = None, query_rope: torch.Tensor | None = None,
           key_rope: torch.Tensor | None = None, scores_dtype: torch.dtype | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(attention_out in the accumulation dtype and the output layout, lse (B, N, S, 1) or
    (T, N, 1), the output layout)."""
    if key.dtype == torch.int32 or value.dtype == torch.int32:
        raise NotImplementedError("int4 (int32-packed) key/value are not covered")
    if key.dim() == 5:
        raise NotImplementedError("the NZ (5-D) KV cache is not covered")
    acc = acc_dtype(query)
    q_layout, out_layout = split_layout(input_layout)
    heads = num_heads
    kv_heads = num_kv_heads or num_heads
    per_channel = antiquant_scale is not None and not per_token
    k_all = _antiquant(key, antiquant_scale if per_channel else None,
                       antiquant_offset if per_channel else None, 0, acc)
    v_all = _antiquant(value, antiquant_scale if per_channel else None,
                       antiquant_offset if per_channel else None, 1, acc)
    kr_all = key_rope.to(acc) if key_rope is not None else None
    varlen = q_layout in ("TND", "NTD")
    # ---- per batch: (N, sq, D) query, (Nkv, skv, D) key/value
    if varlen:
        qt = query if q_layout == "TND" else query.transpose(0, 1)
        qrt = None if query_rope is None else (
            query_rope if q_layout == "TND" else query_rope.transpose(0, 1))
        q_rows = _cum_bounds(seq_q, qt.size(0))
        n_b = len(q_rows)
        qs_full = max((e - s for s, e in q_rows), default=0)
        qs = [qt[s:e].to(acc).transpose(0, 1) for s, e in q_rows]
        qrs = [None if qrt is None else qrt[s:e].to(acc).transpose(0, 1) for s, e in q_rows]
    else:
        q4 = _to_bnsd(query, q_layout, heads).to(acc)
        qr4 = None if query_rope is None else _to_bnsd(query_rope, q_layout, heads).to(acc)
        n_b, qs_full = q4.size(0), q4.size(2)
        q_lens = _per_batch(seq_q, n_b, qs_full)
        starts = [0] * n_b
        if q_pad is not None and seq_q is not None:
            pads = _per_batch(q_pad.reshape(-1).tolist(), n_b, 0)
            starts = [max(qs_full - max(p, 0) - n, 0) for p, n in zip(pads, q_lens)]
        q_rows = [(s, min(s + n, qs_full)) for s, n in zip(starts, q_lens)]
        qs = [q4[b, :, s:e] for b, (s, e) in enumerate(q_rows)]
        qrs = [None if qr4 is None else qr4[b, :, s:e] for b, (s, e) in enumerate(q_rows)]
    ks, vs, krs = _kv_blocks(k_all, v_all, kr_all, q_layout, kv_heads, n_b, seq_kv, block_table,
                             kv_pad, varlen)
    outs, lses = [], []
    for b in range(n_b):
        k, v, kr = ks[b], vs[b], krs[b]
        if per_token or key_scale is not None:
            k, v = _per_token(k, v, b, antiquant_scale, antiquant_offset, key_scale, key_offset,
                              value_scale, value_offset, acc)
        if prefix_k is not None and prefix_v is not None:
            plen = _per_batch(prefix_len, 1, prefix_k.shape[-2])[0]
            pk = _to_bnsd(prefix_k, q_layout, kv_heads)[0, :, :plen].to(acc)
            pv = _to_bnsd(prefix_v, q_layout, kv_heads)[0, :, :plen].to(acc)
            k, v = torch.cat([pk, k], 1), torch.cat([pv, v], 1)
        sq, skv = qs[b].size(1), k.size(1)
        mask = _mask_block(atten_mask, b, n_b, sq, skv, sparse_mode, pre, nxt, qs_full)
        o, lse = _attend(qs[b], k, v, scale, mask, _pse_block(pse, b, sq, skv, acc), qrs[b], kr,
                         scores_dtype)
        outs.append(o)
        lses.append(lse)
    dv = vs[0].size(-1) if vs else value.size(-1)
    if varlen:
        t = qt.size(0)
        out = torch.zeros((t, heads, dv), dtype=acc, device=query.device)
        lse_t = torch.zeros((t, heads, 1), dtype=acc, device=query.device)
        for (s, e), o, lse in zip(q_rows, outs, lses):
            out = out.index_copy(0, torch.arange(s, e, device=out.device), o.transpose(0, 1))
            lse_t = lse_t.index_copy(0, torch.arange(s, e, device=out.device),
                                     lse.transpose(0, 1))
        if out_layout == "NTD":
            out = out.transpose(0, 1)
        return out, lse_t, out_layout
    full = torch.zeros((n_b, heads, qs_full, dv), dtype=acc, device=query.device)
    lse4 = torch.zeros((n_b, heads, qs_full, 1), dtype=acc, device=query.device)
    rows = []
    for (s, e), o, lse in zip(q_rows, outs, lses):
        pad_o = torch.nn.functional.pad(o, (0, 0, s, qs_full - e))
        pad_l = torch.nn.functional.pad(lse, (0, 0, s, qs_full - e))
        rows.append((pad_o, pad_l))
    if rows:
        full = torch.stack([r[0] for r in rows])
        lse4 = torch.stack([r[1] for r in rows])
    return _from_bnsd(full, out_layout), lse4, out_layout


def _kv_blocks(k_all: torch.Tensor, v_all: torch.Tensor, kr_all: torch.Tensor | None,
               q_layout: str, kv_heads: int, n_b: int, seq_kv: Sequence[Any] | None,
               block_table: torch.Tensor | None, kv_pad: torch.Tensor | None, varlen: bool
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
    if block_table is not None:  # PageAttention: gather each sequence's blocks
        lens = _per_batch(seq_kv, n_b, 0)
        ks, vs, krs = [], [], []
        for b in range(n_b):
            ids = block_table[b].long().clamp(min=0)
            ok = ids < k_all.size(0)
            ks.append(_gather(k_all, ids, ok, kv_heads, lens[b]))
            vs.append(_gather(v_all, ids, ok, kv_heads, lens[b]))
            krs.append(None if kr_all is None else _gather(kr_all, ids, ok, kv_heads, lens[b]))
        return ks, vs, krs
    if varlen:
        kt = k_all if q_layout == "TND" else k_all.transpose(0, 1)
        vt = v_all if q_layout == "TND" else v_all.transpose(0, 1)
        krt = None if kr_all is None else (kr_all if q_layout == "TND" else kr_all.transpose(0, 1))
        rows = _cum_bounds(seq_kv, kt.size(0)) if seq_kv is not None else \
            [(0, kt.size(0))] * n_b
        rows = (rows + [(0, 0)] * n_b)[:n_b]
        return ([kt[s:e].transpose(0, 1) for s, e in rows],
                [vt[s:e].transpose(0, 1) for s, e in rows],
                [None if krt is None else krt[s:e].transpose(0, 1) for s, e in rows])
    k4, v4 = _to_bnsd(k_all, q_layout, kv_heads), _to_bnsd(v_all, q_layout, kv_heads)
    kr4 = None if kr_all is None else _to_bnsd(kr_all, q_layout, kv_heads)
    skv = k4.size(2)
    lens = _per_batch(seq_kv, n_b, skv)
    starts = [0] * n_b
    if kv_pad is not None and seq_kv is not None:
        pads = _per_batch(kv_pad.reshape(-1).tolist(), n_b, 0)
        starts = [max(skv - max(p, 0) - n, 0) for p, n in zip(pads, lens)]
    bidx = [b if k4.size(0) > 1 else 0 for b in range(n_b)]
    return ([k4[i, :, s:min(s + n, skv)] for i, s, n in zip(bidx, starts, lens)],
            [v4[i, :, s:min(s + n, skv)] for i, s, n in zip(bidx, starts, lens)],
            [None if kr4 is None else kr4[i, :, s:min(s + n, skv)]
             for i, s, n in zip(bidx, starts, lens)])


def _gather(cache: torch.Tensor, ids: torch.Tensor, ok: torch.Tensor, kv_heads: int, n: int
            ) -> torch.Tensor:
    """One sequence's first n positions from the blocks ``ids`` of a KV cache, (Nkv, n, D)."""
    safe = torch.where(ok, ids, torch.zeros_like(ids))
    blocks = cache.index_select(0, safe)
    zero = (~ok).view(-1, *([1] * (cache.dim() - 1)))
    blocks = blocks.masked_fill(zero, 0)
    if cache.dim() == 3:  # (blocknum, blocksize, H)
        rows = blocks.reshape(-1, cache.size(-1))[:n]
        heads = kv_heads or 1
        return rows.view(rows.size(0), heads, -1).transpose(0, 1)
    # (blocknum, KV_N, blocksize, D)
    return blocks.permute(1, 0, 2, 3).reshape(cache.size(1), -1, cache.size(-1))[:, :n]


def _per_token(k: torch.Tensor, v: torch.Tensor, b: int, scale: torch.Tensor | None,
               offset: torch.Tensor | None, key_scale: torch.Tensor | None,
               key_offset: torch.Tensor | None, value_scale: torch.Tensor | None,
               value_offset: torch.Tensor | None, acc: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token antiquant of one batch: scales (B, KV_S) per position ((2, B, KV_S) together)."""
    ks = key_scale if key_scale is not None else (scale[0] if scale is not None else None)
    vs = value_scale if value_scale is not None else (scale[1] if scale is not None else None)
    ko = key_offset if key_offset is not None else (offset[0] if offset is not None else None)
    vo = value_offset if value_offset is not None else (offset[1] if offset is not None else None)
    n = k.size(1)

    def apply(x: torch.Tensor, s: torch.Tensor | None, o: torch.Tensor | None) -> torch.Tensor:
        if s is None:
            return x
        sb = s[b, :n].to(acc).view(1, -1, 1)
        ob = o[b, :n].to(acc).view(1, -1, 1) if o is not None else 0.0
        return sb * (x + ob)

    return apply(k, ks, ko), apply(v, vs, vo)


def _not_quantized(query: torch.Tensor, **scales: Any) -> None:
    given = [k for k, v in scales.items() if v is not None]
    if query.dtype == torch.int8 or given:
        raise NotImplementedError("the quantized modes (int8 query, "
                                  + ", ".join(given or ["dequant scales"])
                                  + ") are not covered by the reference")


def _cast_out(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    return out.to(query.dtype).contiguous()


# --------------------------------------------------------------------------- the kernels
def npu_prompt_flash_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
    padding_mask: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
    pse_shift: torch.Tensor | None = None, actual_seq_lengths: Sequence[int] | None = None,
    deq_scale1: torch.Tensor | None = None, quant_scale1: torch.Tensor | None = None,
    deq_scale2: torch.Tensor | None = None, quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None, num_heads: int = 1, scale_value: float = 1.0,
    pre_tokens: int = BIG, next_tokens: int = 0, input_layout: str = "BSH",
    num_key_value_heads: int = 0, actual_seq_lengths_kv: Sequence[int] | None = None,
    sparse_mode: int = 0,
) -> torch.Tensor:
    """Prefill attention: the output in query's layout (BSND for BNSD_BSND) and dtype.

    float16 query / key without ``pse_shift`` run the kernel's high-performance mode (the doc:
    only with ``pse_shift`` does float16 default to high precision): ``q k^T`` is rounded to
    float16 before the scale, as op-plugin's test golden computes it (float16 matmul, then the
    scale, softmax in float32)."""
    _not_quantized(query, deq_scale1=deq_scale1, quant_scale1=quant_scale1,
                   deq_scale2=deq_scale2, quant_scale2=quant_scale2)
    fast = query.dtype == key.dtype == torch.float16 and pse_shift is None
    out, _, _ = _infer(query, key, value, num_heads=num_heads, num_kv_heads=num_key_value_heads,
                       scale=scale_value, input_layout=input_layout, pse=pse_shift,
                       atten_mask=atten_mask, seq_q=actual_seq_lengths,
                       seq_kv=actual_seq_lengths_kv, sparse_mode=sparse_mode, pre=pre_tokens,
                       nxt=next_tokens, scores_dtype=torch.float16 if fast else None)
    return _cast_out(out, query)


def npu_incre_flash_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
    padding_mask: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
    pse_shift: torch.Tensor | None = None, actual_seq_lengths: Sequence[int] | None = None,
    antiquant_scale: torch.Tensor | None = None, antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None, dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None, dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None, quant_offset2: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None, num_heads: int = 1, scale_value: float = 1.0,
    input_layout: str = "BSH", num_key_value_heads: int = 0, block_size: int = 0,
    inner_precise: int = 1,
) -> torch.Tensor:
    """Decode attention (query S = 1): ``actual_seq_lengths`` are the key/value lengths."""
    _not_quantized(query, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
                   dequant_scale2=dequant_scale2, quant_scale2=quant_scale2)
    out, _, _ = _infer(query, key, value, num_heads=num_heads, num_kv_heads=num_key_value_heads,
                       scale=scale_value, input_layout=input_layout, pse=pse_shift,
                       atten_mask=atten_mask, seq_q=None, seq_kv=actual_seq_lengths,
                       sparse_mode=0, pre=BIG, nxt=BIG, block_table=block_table,
                       kv_pad=kv_padding_size, antiquant_scale=antiquant_scale,
                       antiquant_offset=antiquant_offset)
    return _cast_out(out, query)


def npu_fused_infer_attention_score(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
    pse_shift: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    dequant_scale1: torch.Tensor | None = None, quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None, quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None, antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None, key_antiquant_scale: torch.Tensor | None = None,
    key_antiquant_offset: torch.Tensor | None = None,
    value_antiquant_scale: torch.Tensor | None = None,
    value_antiquant_offset: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    query_padding_size: torch.Tensor | None = None, kv_padding_size: torch.Tensor | None = None,
    key_shared_prefix: torch.Tensor | None = None, value_shared_prefix: torch.Tensor | None = None,
    actual_shared_prefix_len: Sequence[int] | None = None,
    query_rope: torch.Tensor | None = None, key_rope: torch.Tensor | None = None,
    key_rope_antiquant_scale: torch.Tensor | None = None, num_heads: int = 1,
    scale: float = 1.0, pre_tokens: int = BIG, next_tokens: int = BIG,
    input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
    inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0,
    key_antiquant_mode: int = 0, value_antiquant_mode: int = 0, softmax_lse_flag: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill and decode: (attention_out, softmax_lse); softmax_lse is log(sum(exp)) + max per
    row, fp32 (B, N, S, 1) or (T, N, 1) with ``softmax_lse_flag``, else empty (the meta kernel)."""
    _not_quantized(query, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
                   dequant_scale2=dequant_scale2, quant_scale2=quant_scale2)
    if key_antiquant_scale is not None and (key_antiquant_mode, value_antiquant_mode) != (1, 1) \
            and not (key_antiquant_mode == 0 and value_antiquant_mode == 1):
        raise NotImplementedError(f"key/value antiquant modes {key_antiquant_mode}/"
                                  f"{value_antiquant_mode} are not covered (per-token only)")
    out, lse, _ = _infer(
        query, key, value, num_heads=num_heads, num_kv_heads=num_key_value_heads, scale=scale,
        input_layout=input_layout, pse=pse_shift, atten_mask=atten_mask,
        seq_q=actual_seq_lengths, seq_kv=actual_seq_lengths_kv, sparse_mode=sparse_mode,
        pre=pre_tokens, nxt=next_tokens, block_table=block_table, q_pad=query_padding_size,
        kv_pad=kv_padding_size, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        per_token=antiquant_mode == 1, key_scale=key_antiquant_scale,
        key_offset=key_antiquant_offset, value_scale=value_antiquant_scale,
        value_offset=value_antiquant_offset, prefix_k=key_shared_prefix,
        prefix_v=value_shared_prefix, prefix_len=actual_shared_prefix_len,
        query_rope=query_rope, key_rope=key_rope)
    lse_out = lse.float().detach() if softmax_lse_flag else query.new_empty((0,),
                                                                          dtype=torch.float32)
    return _cast_out(out, query), lse_out
