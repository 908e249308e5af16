"""References of the fusion-attention training kernels (torch_npu ``npu_fusion_attention``,
``npu_fusion_attention_v2`` and their ``_grad`` kernels; torch_npu 2.14.0
``_op_plugin_docs.py`` and ``_meta_registrations.py``) and of MindSpeed's
``npu_ring_attention_update`` (MindSpeed master, docs/ops/npu_ring_attention_update.md).

Softmax attention in fp32 (fp64 for fp64 inputs), per the docs' formula
``Softmax(Mask(scale*(query*key^T + pse), atten_mask)) * value``:

* layouts BSH, SBH, BSND, BNSD (one dense block) and TND (varlen: one block per sequence of
  ``actual_seq_qlen`` / ``actual_seq_kvlen``, cumulative ends; a sequence of length 0 is
  skipped, trailing zeros end the batch, query rows past the last end give zeros);
* ``sparse_mode`` 0-8 as the doc describes them: 0 the mask (and the ``pre/next_tockens`` band,
  origin top left), 1 the mask alone, 2/3 causal from the top-left / bottom-right corner, 4 the
  band from the bottom-right corner, 5 the mask, 6 bottom-right causal plus ``prefix`` visible
  columns, 7/8 (varlen, a sequence cut across cards) causal with the last / first sequence a
  band.  Without ``atten_mask`` nothing is masked (the doc: the sparse arguments then do not
  apply).  For 2, 3, 4, 6, 7 and 8 the kernel builds the mask from its compressed 2048x2048 tile;
  the reference builds it from the mode, without reading the tile;
* in TND the kernel reads ``atten_mask`` as a (maxSq, maxSkv) tile (the doc: varlen takes the
  SS format only): the reference reads it the same way, so a mask of another shape is misread
  exactly as the kernel misreads it (no error), and a row it masks entirely (unsupported in
  varlen, the doc) turns into NaN, the unguarded 0/0 it is;
* GQA (key/value with fewer heads), ``pse`` (v2: ``pse_type`` 0-3, 2/3 an ALiBi bias from per-
  head slopes), ``sink`` (one extra logit per head, unscaled, with no value), v2's
  ``query_rope`` / ``key_rope``.

Dropout (``keep_prob`` < 1): the probabilities are multiplied by the kept bits of a mask over
(B, N, Sq, Skv) (TND: one (N, sq, skv) block per sequence, one after the other) and divided by
``keep_prob``, as op-plugin's tests build their golden; the statistics are those before the
dropout.  The mask is ``dropout_mask`` when given (the kernel's bit layout,
``_dropout``), else the one drawn at ``(seed, offset)``: the kernel's glue takes them from the
NPU generator, the emulation does the same, and the grad kernels draw the same mask again
from the ``seed`` / ``offset`` the forward returned.  The bits are the emulation's stream
(``_dropout``), not the hardware's, so on an NPU the reference cannot match a dropout call.
Not covered: ``inner_precise``, ALiBi-compressed ``pse`` outside TND.  ``softmax_max`` / ``softmax_sum`` are the real per-row statistics, broadcast to
8 lanes: (B, N, Sq, 8), and (T, N, 8) in TND (the meta kernel's shapes); they carry no gradient
(torch_npu's backward takes the gradient of the attention output only).  The ``_grad``
references compute the gradients from the saved statistics and ``attention_in`` when given,
as the kernel does, else recompute them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._dropout import keep_mask, mask_bytes
from ._util import acc_dtype

__all__ = ["LAYOUTS", "attention_heads", "attention_layout_to_bnsd", "attention_scores",
           "bnsd_to_attention_layout", "expand_kv", "npu_fusion_attention",
           "npu_fusion_attention_grad", "npu_fusion_attention_grad_v2",
           "npu_fusion_attention_v2", "npu_ring_attention_update", "varlen_bounds"]

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
BIG = 2147483647
_TILE_MODES = (2, 3, 4, 6, 7, 8)


# --------------------------------------------------------------------------- layouts
def attention_layout_to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """(B, N, S, D) view of a query/key/value in a dense ``layout`` (``heads`` for BSH/SBH)."""
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
    raise NotImplementedError(f"input_layout {layout!r} is not a dense layout (BSH, SBH, BSND, "
                              "BNSD)")


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
    layout = layout.upper()
    if layout in ("BSH", "SBH"):
        head_dim = max(query.size(-1) // max(head_num, 1), 1)
        return head_num, key.size(-1) // head_dim
    if layout == "TND":
        return query.size(1), key.size(1)
    return query.size(-2 if layout == "BSND" else 1), key.size(-2 if layout == "BSND" else 1)


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Nkv, S, D) repeated to ``heads`` heads (GQA: each kv head serves heads/Nkv)."""
    return t.repeat_interleave(heads // t.size(1), dim=1) if t.size(1) != heads else t


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    pse: torch.Tensor | None,
    atten_mask: torch.Tensor | None,
    sparse_mode: int,
) -> torch.Tensor:
    """``scale * (q k^T + pse)`` with masked positions (mask != 0, or the causal structure of
    sparse modes 2/3) set to the dtype's minimum; dense (B, N, Sq, Skv) blocks."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    if pse is not None:
        scores = scores + pse.to(scores.dtype)
    scores = scores * scale
    sq, skv = scores.shape[-2:]
    mask = _structure(sq, skv, sparse_mode, BIG, BIG, 0, 0, 1, q.device)
    if atten_mask is not None and mask is None:
        mask = atten_mask != 0
    if mask is not None and atten_mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    return scores


def varlen_bounds(cum: Sequence[int] | None, total: int) -> list[tuple[int, int]]:
    """Per sequence, the rows ``[start, end)`` of the cumulative ends ``cum`` (TND).

    A length of 0 gives an empty sequence; a 0 after a positive end starts the trailing
    sequences that take no part (the doc: ``[2, 5, 9, 0, 0]``); ends are clipped to ``total``
    and never go back (garbage lengths give empty sequences, never an error)."""
    out: list[tuple[int, int]] = []
    prev = 0
    for v in cum or ():
        end = int(v)
        if end == 0 and prev > 0:
            break
        end = min(max(end, prev), total)
        out.append((prev, end))
        prev = end
    return out


# --------------------------------------------------------------------------- blocks
@dataclass
class _Block:
    """One attention block: the dense batch, or one TND sequence (b = 1)."""

    q: torch.Tensor          # (b, N, sq, D) in the accumulation dtype
    k: torch.Tensor          # (b, Nkv, skv, D)
    v: torch.Tensor          # (b, Nkv, skv, Dv)
    index: int               # the sequence's batch index (0 for the dense block)
    q_rows: tuple[int, int] | None = None    # TND: rows of query / key-value
    kv_rows: tuple[int, int] | None = None
    q_rope: torch.Tensor | None = None
    k_rope: torch.Tensor | None = None


@dataclass
class _Call:
    """Everything but the tensors' values that the blocks need."""

    layout: str
    heads: int
    kv_heads: int
    blocks: list[_Block]
    varlen: bool
    total_q: int = 0
    total_kv: int = 0
    max_sq: int = 0
    max_skv: int = 0


def _tnd(t: torch.Tensor, rows: tuple[int, int], acc: torch.dtype) -> torch.Tensor:
    return t[rows[0]:rows[1]].to(acc).permute(1, 0, 2).unsqueeze(0)  # (1, N, s, D)


def _blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
            layout: str, seq_q: Sequence[int] | None, seq_kv: Sequence[int] | None,
            acc: torch.dtype, query_rope: torch.Tensor | None = None,
            key_rope: torch.Tensor | None = None) -> _Call:
    layout = layout.upper()
    if layout not in LAYOUTS:
        raise NotImplementedError(f"input_layout {layout!r} is not covered ({', '.join(LAYOUTS)})")
    heads, kv_heads = attention_heads(query, key, head_num, layout)
    if layout != "TND":
        q = attention_layout_to_bnsd(query, layout, heads).to(acc)
        k = attention_layout_to_bnsd(key, layout, kv_heads).to(acc)
        v = attention_layout_to_bnsd(value, layout, kv_heads).to(acc)
        return _Call(layout, heads, kv_heads, [_Block(q, k, v, 0)], False)
    qb = varlen_bounds(seq_q, query.size(0))
    kb = varlen_bounds(seq_kv, key.size(0))
    blocks = []
    for i, (qr, kr) in enumerate(zip(qb, kb)):
        if qr[1] == qr[0]:
            continue
        blocks.append(_Block(_tnd(query, qr, acc), _tnd(key, kr, acc), _tnd(value, kr, acc), i,
                             qr, kr,
                             _tnd(query_rope, qr, acc) if query_rope is not None else None,
                             _tnd(key_rope, kr, acc) if key_rope is not None else None))
    lens_q = [e - s for s, e in qb] or [0]
    lens_kv = [e - s for s, e in kb] or [0]
    return _Call(layout, heads, kv_heads, blocks, True, query.size(0), key.size(0),
                 max(lens_q), max(lens_kv))


def _structure(sq: int, skv: int, mode: int, pre: int, nxt: int, prefix: int, index: int,
               n_blocks: int, device: torch.device) -> torch.Tensor | None:
    """The (sq, skv) mask (True = masked) the kernel derives from ``sparse_mode`` itself, or
    None for the modes that read ``atten_mask`` (0, 1, 5)."""
    if mode not in _TILE_MODES:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(skv, device=device).unsqueeze(0)
    d = skv - sq
    left_up = j > i
    right_down = j > i + d
    band = (j > i + d + nxt) | (j < i + d - pre)
    if mode == 2:
        return left_up
    if mode == 3:
        return right_down
    if mode == 4:
        return band
    if mode == 6:
        return right_down & (j >= prefix)
    if mode == 7:  # a sequence cut across cards: the last one is a band, the others causal
        return band if index == n_blocks - 1 else right_down
    return band if index == 0 else left_up  # mode 8


def _given_mask(atten_mask: torch.Tensor, call: _Call, blk: _Block, sq: int, skv: int,
                mode: int, pre: int, nxt: int) -> torch.Tensor:
    """The mask the kernel reads from ``atten_mask`` for one block (modes 0, 1, 5)."""
    m = atten_mask != 0
    if call.varlen:  # the SS tile (maxSq, maxSkv), read as flat memory: what the kernel does
        need = call.max_sq * call.max_skv
        flat = m.reshape(-1)
        if flat.numel() < need:  # past the end of the buffer: nothing masked there
            flat = torch.cat([flat, flat.new_zeros(need - flat.numel())])
        tile = flat[:need].view(call.max_sq, call.max_skv)
        mask = tile[:sq, :skv]
    else:
        b, n = blk.q.shape[:2]
        ok = m.dim() == 2 or (m.dim() == 4 and m.size(0) in (1, b) and m.size(1) in (1, n))
        if not ok or tuple(m.shape[-2:]) != (sq, skv):
            raise ValueError(f"get unsupported atten_mask shape {tuple(m.shape)}: BNSS, B1SS, "
                             f"11SS or SS with S = ({sq}, {skv}) (torch_npu doc)")
        mask = m
    if mode == 0 and (pre < BIG or nxt < BIG):  # the band around the mask, origin top left
        i = torch.arange(sq, device=m.device).unsqueeze(1)
        j = torch.arange(skv, device=m.device).unsqueeze(0)
        mask = mask | (j > i + nxt) | (j < i - pre)
    return mask


def _mask_for(atten_mask: torch.Tensor | None, call: _Call, blk: _Block, mode: int, pre: int,
              nxt: int, prefix: Sequence[int] | None) -> torch.Tensor | None:
    if atten_mask is None:
        return None
    sq, skv = blk.q.size(2), blk.k.size(2)
    pfx = int(prefix[blk.index]) if prefix is not None and blk.index < len(prefix) else 0
    built = _structure(sq, skv, mode, pre, nxt, pfx, blk.index, len(call.blocks), blk.q.device)
    if built is not None:
        return built
    return _given_mask(atten_mask, call, blk, sq, skv, mode, pre, nxt)


def _pse_for(pse: torch.Tensor | None, call: _Call, blk: _Block, pse_type: int,
             q_start: Sequence[int] | None, kv_start: Sequence[int] | None) -> torch.Tensor | None:
    """The bias added to one block's scores, (b|1, N|1, sq, skv), differentiable in ``pse``."""
    if pse is None:
        return None
    b, n, sq, _ = blk.q.shape
    skv = blk.k.size(2)
    acc = blk.q.dtype
    if pse_type in (2, 3):  # ALiBi slopes [B, N] or [N], generated inside the kernel
        slopes = pse.to(acc)
        slopes = slopes.view(1, -1) if slopes.dim() == 1 else slopes
        if call.varlen:
            slopes = slopes[blk.index:blk.index + 1] if slopes.size(0) > 1 else slopes
        qs = int(q_start[0]) if q_start else 0
        ks = int(kv_start[0]) if kv_start else 0
        i = torch.arange(sq, device=pse.device, dtype=acc).unsqueeze(1)
        j = torch.arange(skv, device=pse.device, dtype=acc).unsqueeze(0)
        dist = (j - (i + qs - ks)).abs()
        if pse_type == 3:
            dist = dist.sqrt()
        return -slopes[:, :, None, None] * dist
    if call.varlen:  # (B|1, N, R, Skv): the last sq rows (ALiBi-compressed) of the sequence's
        p = pse[blk.index:blk.index + 1] if pse.size(0) > 1 else pse
        rows = p.size(2)
        return p[:, :, max(rows - sq, 0):rows, :skv].to(acc)
    ok = pse.dim() == 4 and pse.size(0) in (1, b) and pse.size(1) in (1, n) and \
        pse.size(2) in (1, sq) and pse.size(3) == skv
    if not ok:
        raise NotImplementedError(f"pse of shape {tuple(pse.shape)} is not covered (BNSS, BN1Skv, "
                                  f"1NSS with S = ({sq}, {skv}); ALiBi-compressed pse only in TND)")
    return pse.to(acc)


@dataclass
class _Opts:
    scale: float
    pse: torch.Tensor | None
    pse_type: int
    atten_mask: torch.Tensor | None
    sparse_mode: int
    pre: int
    nxt: int
    prefix: Sequence[int] | None
    q_start: Sequence[int] | None
    kv_start: Sequence[int] | None
    sink: torch.Tensor | None
    keep_prob: float = 1.0
    keep: torch.Tensor | None = None  # the kept bits, flat over every block (None: no dropout)


_EPSILON = 1e-9  # op-plugin's get_dropout_status


def dropout_numels(call: _Call) -> int:
    """The mask's element count: B * N * Sq * Skv, or N * sum(sq * skv) over TND sequences."""
    if not call.varlen:
        blk = call.blocks[0]
        return int(blk.q.size(0) * call.heads * blk.q.size(2) * blk.k.size(2))
    return int(call.heads * sum(b.q.size(2) * b.k.size(2) for b in call.blocks))


def _with_dropout(o: _Opts, call: _Call, keep_prob: float, dropout_mask: torch.Tensor | None,
                  seed: int, offset: int) -> tuple[_Opts, int]:
    """``o`` with the dropout's kept bits (none when ``keep_prob`` is 1), and the numels."""
    kp = float(keep_prob)
    if abs(kp - 1.0) < _EPSILON or not call.blocks:
        return o, 0
    numels = dropout_numels(call)
    device = call.blocks[0].q.device
    if abs(kp) < _EPSILON:  # DROPOUT_ALL: a zero mask
        keep = torch.zeros(numels, dtype=torch.bool, device=device)
    elif dropout_mask is not None:
        keep = keep_mask(dropout_mask.to(device), numels)
    else:
        keep = keep_mask(mask_bytes(numels, 1.0 - kp, seed, offset, device), numels)
    o.keep_prob, o.keep = kp, keep
    return o, numels


def _dropped(p: torch.Tensor, o: _Opts, call: _Call, blk: _Block) -> torch.Tensor | None:
    """The block's (b, N, sq, skv) dropout factor: kept bits / keep_prob (None: no dropout)."""
    if o.keep is None:
        return None
    b, n, sq, skv = p.shape
    start = 0
    if call.varlen:
        start = n * sum(x.q.size(2) * x.k.size(2) for x in call.blocks if x.index < blk.index)
    bits = o.keep[start:start + b * n * sq * skv].view(b, n, sq, skv)
    scale = 0.0 if o.keep_prob < _EPSILON else 1.0 / o.keep_prob
    return bits.to(p.dtype) * scale


def _logits(call: _Call, blk: _Block, o: _Opts) -> tuple[torch.Tensor, torch.Tensor | None,
                                                         torch.Tensor | None]:
    """Scores of one block after bias, scale and mask; also the bias and the mask."""
    k = expand_kv(blk.k, call.heads)
    s = torch.matmul(blk.q, k.transpose(-1, -2))
    if blk.q_rope is not None and blk.k_rope is not None:
        s = s + torch.matmul(blk.q_rope, expand_kv(blk.k_rope, call.heads).transpose(-1, -2))
    bias = _pse_for(o.pse, call, blk, o.pse_type, o.q_start, o.kv_start)
    if bias is None:
        s = s * o.scale
    elif o.pse_type == 1:
        s = (s + bias) * o.scale
    else:
        s = s * o.scale + bias
    mask = _mask_for(o.atten_mask, call, blk, o.sparse_mode, o.pre, o.nxt, o.prefix)
    if mask is not None:
        # varlen: a fully masked row is unsupported; -inf lets it become the NaN it is
        fill = float("-inf") if call.varlen else torch.finfo(s.dtype).min
        s = s.masked_fill(mask, fill)
    return s, bias, mask


def _softmax(s: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """(probabilities, row max, row sum); the sink logit joins max and sum, not the output."""
    m = s.amax(dim=-1, keepdim=True).detach()  # a shift: softmax does not depend on it
    sink_b = None
    if sink is not None:
        sink_b = sink.to(s.dtype).view(1, -1, 1, 1)
        m = torch.maximum(m, sink_b.detach())
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    if sink_b is not None:
        total = total + torch.exp(sink_b - m)
    return e / total, m, total


def _stats(x: torch.Tensor) -> torch.Tensor:
    return x.expand(*x.shape[:-1], 8).contiguous()


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
             input_layout: str, o: _Opts, seq_q: Sequence[int] | None,
             seq_kv: Sequence[int] | None, query_rope: torch.Tensor | None = None,
             key_rope: torch.Tensor | None = None, keep_prob: float = 1.0,
             dropout_mask: torch.Tensor | None = None, seed: int = 0, offset: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    acc = acc_dtype(query)
    call = _blocks(query, key, value, head_num, input_layout, seq_q, seq_kv, acc, query_rope,
                   key_rope)
    o, numels = _with_dropout(o, call, keep_prob, dropout_mask, seed, offset)
    drawn = (int(seed), int(offset), numels) if numels else (0, 0, 0)
    outs, maxes, sums = [], [], []
    for blk in call.blocks:
        s, _, _ = _logits(call, blk, o)
        p, m, total = _softmax(s, o.sink)
        drop = _dropped(p, o, call, blk)
        outs.append(torch.matmul(p if drop is None else p * drop, expand_kv(blk.v, call.heads)))
        maxes.append(m.detach())  # the statistics carry no gradient (torch_npu's backward
        sums.append(total.detach())  # takes the gradient of the attention output only)
    if not call.varlen:
        out = bnsd_to_attention_layout(outs[0], call.layout).to(query.dtype).contiguous()
        return (out, _stats(maxes[0]), _stats(sums[0]), query.new_empty((0,)), *drawn)
    n = call.heads
    out = _scatter_rows([(b.q_rows, x[0].permute(1, 0, 2)) for b, x in zip(call.blocks, outs)],
                        call.total_q, (n, value.size(-1)), acc, query.device).to(query.dtype)
    smax = _scatter_rows([(b.q_rows, x[0].permute(1, 0, 2)) for b, x in zip(call.blocks, maxes)],
                         call.total_q, (n, 1), acc, query.device)
    ssum = _scatter_rows([(b.q_rows, x[0].permute(1, 0, 2)) for b, x in zip(call.blocks, sums)],
                         call.total_q, (n, 1), acc, query.device)
    return (out.contiguous(), _stats(smax), _stats(ssum), query.new_empty((0,)), *drawn)


def _scatter_rows(parts: list[tuple[tuple[int, int] | None, torch.Tensor]], total: int,
                  tail: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rows [start, end) of a (total, *tail) tensor from ``parts``, zeros elsewhere (out of
    place and differentiable: a concatenation)."""
    pieces: list[torch.Tensor] = []
    at = 0
    for rows, x in parts:
        assert rows is not None
        if rows[0] > at:
            pieces.append(torch.zeros((rows[0] - at, *tail), dtype=dtype, device=device))
        pieces.append(x.to(dtype))
        at = rows[1]
    if total > at:
        pieces.append(torch.zeros((total - at, *tail), dtype=dtype, device=device))
    if not pieces:
        return torch.zeros((total, *tail), dtype=dtype, device=device)
    return torch.cat(pieces, 0)


def _opts(scale: float, pse: torch.Tensor | None, pse_type: int,
          atten_mask: torch.Tensor | None, sparse_mode: int, pre: int, nxt: int,
          prefix: Sequence[int] | None, q_start: Sequence[int] | None = None,
          kv_start: Sequence[int] | None = None, sink: torch.Tensor | None = None) -> _Opts:
    return _Opts(float(scale), pse, int(pse_type), atten_mask, int(sparse_mode), int(pre),
                 int(nxt), prefix, q_start, kv_start, sink)


# --------------------------------------------------------------------------- forward kernels
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
    pre_tockens: int = BIG,
    next_tockens: int = BIG,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Returns (attention_out, softmax_max, softmax_sum, softmax_in, seed, offset, numels):
    softmax_in is empty; seed/offset/numels are the dropout's (0 without dropout); see the
    module docstring."""
    o = _opts(scale, pse, 1, atten_mask, sparse_mode, pre_tockens, next_tockens, prefix, sink=sink)
    return _forward(query, key, value, head_num, input_layout, o, actual_seq_qlen,
                    actual_seq_kvlen, keep_prob=keep_prob, dropout_mask=dropout_mask,
                    seed=seed, offset=offset)


def npu_fusion_attention_v2(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tokens: int = BIG,
    next_tokens: int = BIG,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    pse_type: int = 1,
    q_start_idx: Sequence[int] | None = None,
    kv_start_idx: Sequence[int] | None = None,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """v2 (torch_npu 2.14.0 doc): ``pse_type`` 0 adds pse after the scale, 1 before it, 2/3 an
    ALiBi bias generated from per-head slopes; ``query_rope``/``key_rope`` (TND) add
    ``query_rope * key_rope^T`` to the scores.  Outputs as :func:`npu_fusion_attention`."""
    o = _opts(scale, pse, pse_type, atten_mask, sparse_mode, pre_tokens, next_tokens, prefix,
              q_start_idx, kv_start_idx, sink)
    return _forward(query, key, value, head_num, input_layout, o, actual_seq_qlen,
                    actual_seq_kvlen, query_rope, key_rope, keep_prob=keep_prob,
                    dropout_mask=dropout_mask, seed=seed, offset=offset)


# --------------------------------------------------------------------------- backward kernels
def _block_stats(stat: torch.Tensor | None, call: _Call, blk: _Block) -> torch.Tensor | None:
    """A saved softmax statistic ((B, N, Sq, 8), or (T, N, 8) in TND) for one block, as
    (b, N, sq, 1); None when it was not given or does not fit."""
    if stat is None or stat.numel() == 0:
        return None
    acc = blk.q.dtype
    if call.varlen:
        assert blk.q_rows is not None
        if stat.dim() != 3 or stat.size(0) < blk.q_rows[1]:
            return None
        part = stat[blk.q_rows[0]:blk.q_rows[1], :, :1].to(acc)  # (sq, N, 1)
        return part.permute(1, 0, 2).unsqueeze(0)
    if stat.dim() != 4 or tuple(stat.shape[:3]) != tuple(blk.q.shape[:3]):
        return None
    return stat[..., :1].to(acc)


def _block_rows(t: torch.Tensor | None, call: _Call, blk: _Block, heads: int
                ) -> torch.Tensor | None:
    """dy / attention_in of one block as (b, N, sq, Dv)."""
    if t is None or t.numel() == 0:
        return None
    acc = blk.q.dtype
    if call.varlen:
        assert blk.q_rows is not None
        return _tnd(t, blk.q_rows, acc)
    return attention_layout_to_bnsd(t, call.layout, heads).to(acc)


def _reduce_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    if g.size(1) == kv_heads:
        return g
    return g.unflatten(1, (kv_heads, g.size(1) // kv_heads)).sum(2)


def _reduce_to(grad: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Sum ``grad`` over the dimensions broadcast from ``shape`` (same rank)."""
    for d, size in enumerate(shape):
        if size == 1 and grad.size(d) != 1:
            grad = grad.sum(d, keepdim=True)
    return grad


def _backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dy: torch.Tensor,
              head_num: int, input_layout: str, o: _Opts, seq_q: Sequence[int] | None,
              seq_kv: Sequence[int] | None, softmax_max: torch.Tensor | None,
              softmax_sum: torch.Tensor | None, attention_in: torch.Tensor | None,
              query_rope: torch.Tensor | None = None, key_rope: torch.Tensor | None = None,
              keep_prob: float = 1.0, seed: int = 0, offset: int = 0
              ) -> dict[str, torch.Tensor | None]:
    """dq, dk, dv, dpse, dsink, dq_rope, dk_rope (the accumulation dtype; None when absent).
    With dropout, the mask is drawn again at the forward's ``seed`` / ``offset``."""
    acc = acc_dtype(query)
    call = _blocks(query, key, value, head_num, input_layout, seq_q, seq_kv, acc, query_rope,
                   key_rope)
    o, _ = _with_dropout(o, call, keep_prob, None, seed, offset)
    nq, nkv = call.heads, call.kv_heads
    parts: dict[str, list[tuple[_Block, torch.Tensor]]] = {
        k: [] for k in ("dq", "dk", "dv", "dqr", "dkr")}
    dpse: torch.Tensor | None = None
    if o.pse is not None:
        dpse = torch.zeros(o.pse.shape, dtype=acc, device=o.pse.device)
    dsink = torch.zeros(o.sink.shape, dtype=acc, device=o.sink.device) if o.sink is not None \
        else None
    for blk in call.blocks:
        s, bias, _ = _logits(call, blk, o)
        m, total = _block_stats(softmax_max, call, blk), _block_stats(softmax_sum, call, blk)
        if m is None or total is None:  # not saved: recompute them
            p, m, total = _softmax(s, o.sink)
        else:  # the kernel's way: probabilities from the saved statistics
            p = torch.exp(s - m) / total
        v = expand_kv(blk.v, nq)
        g = _block_rows(dy, call, blk, nq)
        assert g is not None
        drop = _dropped(p, o, call, blk)
        kept = p if drop is None else p * drop  # the probabilities the output was made of
        out = _block_rows(attention_in, call, blk, nq)
        if out is None:
            out = torch.matmul(kept, v)
        rowdot = (g * out).sum(-1, keepdim=True)
        dp = torch.matmul(g, v.transpose(-1, -2))
        if drop is not None:
            dp = dp * drop
        ds = p * (dp - rowdot)  # d loss / d scores after scale
        if o.sink is not None and dsink is not None:
            p_sink = torch.exp(o.sink.to(acc).view(1, -1, 1, 1) - m) / total
            dsink = dsink - (p_sink * rowdot).sum(dim=(0, 2, 3)).to(acc)
        dscore = ds * o.scale
        if dpse is not None and bias is not None:
            dbias = dscore if o.pse_type == 1 else ds
            dpse = dpse + _pse_grad(dbias, o, call, blk, dpse.shape)
        k = expand_kv(blk.k, nq)
        parts["dq"].append((blk, torch.matmul(dscore, k)))
        parts["dk"].append((blk, _reduce_heads(torch.matmul(dscore.transpose(-1, -2), blk.q),
                                               nkv)))
        parts["dv"].append((blk, _reduce_heads(torch.matmul(kept.transpose(-1, -2), g), nkv)))
        if blk.q_rope is not None and blk.k_rope is not None:
            kr = expand_kv(blk.k_rope, nq)
            parts["dqr"].append((blk, torch.matmul(dscore, kr)))
            parts["dkr"].append((blk, _reduce_heads(
                torch.matmul(dscore.transpose(-1, -2), blk.q_rope), nkv)))

    def assemble(name: str, like: torch.Tensor | None, heads: int, kv: bool
                 ) -> torch.Tensor | None:
        if like is None:
            return None
        if not call.varlen:
            if not parts[name]:
                return torch.zeros(like.shape, dtype=acc, device=like.device)
            return bnsd_to_attention_layout(parts[name][0][1], call.layout)
        rows = [((b.kv_rows if kv else b.q_rows), x[0].permute(1, 0, 2)) for b, x in parts[name]]
        return _scatter_rows(rows, like.size(0), tuple(like.shape[1:]), acc, like.device)

    return {"dq": assemble("dq", query, nq, False), "dk": assemble("dk", key, nkv, True),
            "dv": assemble("dv", value, nkv, True), "dpse": dpse, "dsink": dsink,
            "dq_rope": assemble("dqr", query_rope, nq, False),
            "dk_rope": assemble("dkr", key_rope, nkv, True)}


def _pse_grad(dbias: torch.Tensor, o: _Opts, call: _Call, blk: _Block,
              shape: Sequence[int]) -> torch.Tensor:
    """One block's gradient of the bias, placed into a zero tensor of ``pse``'s shape."""
    assert o.pse is not None
    acc = dbias.dtype
    b, n, sq, skv = dbias.shape
    if o.pse_type in (2, 3):  # d/d slope of -slope * dist
        qs = int(o.q_start[0]) if o.q_start else 0
        ks = int(o.kv_start[0]) if o.kv_start else 0
        i = torch.arange(sq, device=dbias.device, dtype=acc).unsqueeze(1)
        j = torch.arange(skv, device=dbias.device, dtype=acc).unsqueeze(0)
        dist = (j - (i + qs - ks)).abs()
        if o.pse_type == 3:
            dist = dist.sqrt()
        g = -(dbias * dist).sum(dim=(2, 3))  # (b, N)
        if len(shape) == 1:
            return g.sum(0)
        out = torch.zeros(tuple(shape), dtype=acc, device=dbias.device)
        if call.varlen and shape[0] > 1:
            return out.index_add(0, torch.tensor([blk.index], device=dbias.device), g)
        return out + (g.sum(0, keepdim=True) if shape[0] == 1 else g)
    if call.varlen:
        rows = shape[2]
        top = max(rows - sq, 0)
        pad = (0, shape[3] - skv, top, rows - top - sq)
        g = torch.nn.functional.pad(dbias, pad)  # (1, N, R, C)
        out = torch.zeros(tuple(shape), dtype=acc, device=dbias.device)
        at = blk.index if shape[0] > 1 else 0
        return out.index_add(0, torch.tensor([at], device=dbias.device), g)
    return _reduce_to(dbias, shape)


def _grad_outputs(r: dict[str, torch.Tensor | None], query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, pse: torch.Tensor | None, sink: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dpse, dsink) in the meta kernel's dtypes: dq/dk/dv in query's, dpse in
    pse's (empty without pse), dsink in sink's (empty without sink)."""
    dt = query.dtype
    dq, dk, dv = r["dq"], r["dk"], r["dv"]
    assert dq is not None and dk is not None and dv is not None
    dpse = r["dpse"].to(pse.dtype) if pse is not None and r["dpse"] is not None \
        else query.new_empty((0,))
    dsink = r["dsink"].to(sink.dtype) if sink is not None and r["dsink"] is not None \
        else query.new_empty((0,), dtype=torch.float32)
    return (dq.to(dt).contiguous(), dk.to(dt).contiguous(), dv.to(dt).contiguous(), dpse, dsink)


def npu_fusion_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = BIG,
    next_tockens: int = BIG,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel torch_npu's autograd of npu_fusion_attention calls: (dq, dk, dv, dpse,
    dsink) from the forward's inputs, its output (``attention_in``) and statistics."""
    o = _opts(scale_value, pse, 1, atten_mask, sparse_mode, pre_tockens, next_tockens, prefix,
              sink=sink)
    r = _backward(query, key, value, dy, head_num, input_layout, o, actual_seq_qlen,
                  actual_seq_kvlen, softmax_max, softmax_sum, attention_in, keep_prob=keep_prob,
                  seed=seed, offset=offset)
    return _grad_outputs(r, query, key, value, pse, sink)


def npu_fusion_attention_grad_v2(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tokens: int = BIG,
    next_tokens: int = BIG,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    pse_type: int = 1,
    q_start_idx: Sequence[int] | None = None,
    kv_start_idx: Sequence[int] | None = None,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv, dpse, dq_rope, dk_rope, dsink), the order of the meta kernel; the rope
    gradients are empty without rope inputs."""
    o = _opts(scale_value, pse, pse_type, atten_mask, sparse_mode, pre_tokens, next_tokens,
              prefix, q_start_idx, kv_start_idx, sink)
    r = _backward(query, key, value, dy, head_num, input_layout, o, actual_seq_qlen,
                  actual_seq_kvlen, softmax_max, softmax_sum, attention_in, query_rope, key_rope,
                  keep_prob=keep_prob, seed=seed, offset=offset)
    dq, dk, dv, dpse, dsink = _grad_outputs(r, query, key, value, pse, sink)
    empty = query.new_empty((0,))
    dqr = r["dq_rope"].to(query.dtype).contiguous() if r["dq_rope"] is not None else empty
    dkr = r["dk_rope"].to(query.dtype).contiguous() if r["dk_rope"] is not None else empty
    return (dq, dk, dv, dpse, dqr, dkr, dsink)


# --------------------------------------------------------------------------- backward formulas
def fusion_attention_backward(inputs: dict[str, Any], outputs: Any, grads: Any) -> dict[str, Any]:
    """npu_fusion_attention's backward as a composite formula: the grad kernel's reference on
    the forward's inputs, output and statistics (what torch_npu's autograd passes it)."""
    i = inputs
    dq, dk, dv, dpse, dsink = npu_fusion_attention_grad(
        i["query"], i["key"], i["value"], grads[0], i["head_num"], i["input_layout"],
        pse=i["pse"], padding_mask=i["padding_mask"], atten_mask=i["atten_mask"],
        softmax_max=outputs[1], softmax_sum=outputs[2], softmax_in=outputs[3],
        attention_in=outputs[0], scale_value=i["scale"], keep_prob=i["keep_prob"],
        pre_tockens=i["pre_tockens"], next_tockens=i["next_tockens"],
        inner_precise=i["inner_precise"], seed=outputs[4], offset=outputs[5],
        numels=outputs[6], prefix=i["prefix"],
        actual_seq_qlen=i["actual_seq_qlen"], actual_seq_kvlen=i["actual_seq_kvlen"],
        sparse_mode=i["sparse_mode"], softmax_layout=i["softmax_layout"], sink=i["sink"])
    return {"query": dq, "key": dk, "value": dv,
            "pse": dpse if i["pse"] is not None else None,
            "sink": dsink if i["sink"] is not None else None}


def fusion_attention_v2_backward(inputs: dict[str, Any], outputs: Any, grads: Any
                                 ) -> dict[str, Any]:
    """npu_fusion_attention_v2's backward: its grad kernel's reference (MindSpeed's
    FusionAttentionV2Function.backward passes the same)."""
    i = inputs
    dq, dk, dv, dpse, dqr, dkr, dsink = npu_fusion_attention_grad_v2(
        i["query"], i["key"], i["value"], grads[0], i["head_num"], i["input_layout"],
        pse=i["pse"], padding_mask=i["padding_mask"], atten_mask=i["atten_mask"],
        softmax_max=outputs[1], softmax_sum=outputs[2], softmax_in=outputs[3],
        attention_in=outputs[0], query_rope=i["query_rope"], key_rope=i["key_rope"],
        scale_value=i["scale"], keep_prob=i["keep_prob"], pre_tokens=i["pre_tokens"],
        next_tokens=i["next_tokens"], inner_precise=i["inner_precise"], seed=outputs[4],
        offset=outputs[5], numels=outputs[6], prefix=i["prefix"],
        actual_seq_qlen=i["actual_seq_qlen"], actual_seq_kvlen=i["actual_seq_kvlen"],
        sparse_mode=i["sparse_mode"], pse_type=i["pse_type"], q_start_idx=i["q_start_idx"],
        kv_start_idx=i["kv_start_idx"], softmax_layout=i["softmax_layout"], sink=i["sink"])
    return {"query": dq, "key": dk, "value": dv,
            "pse": dpse if i["pse"] is not None else None,
            "query_rope": dqr if i["query_rope"] is not None else None,
            "key_rope": dkr if i["key_rope"] is not None else None,
            "sink": dsink if i["sink"] is not None else None}


# --------------------------------------------------------------------------- ring attention
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
