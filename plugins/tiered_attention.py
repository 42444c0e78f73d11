"""TieredAttention — reference semantics (float32, readable). The ONNX function and the
CUDA kernel of this op must match it.

Attention of new queries over a *selection of pages* of a paged K/V pool, with a page
mask that removes pages which are not selected or not resident, returning besides the
output the log-sum-exp per query (so partial results over page blocks merge exactly,
flash-decoding style) and the attention probability each page received.
"""

from __future__ import annotations

import torch


#: page_index of a padding column of a page list: past any sequence, so none of its keys is valid
PAD_PAGE_INDEX = 1 << 40


def as_mask(page_mask: torch.Tensor) -> torch.Tensor:
    """A page mask as bool: the ops take bool or an integer mask (nonzero = kept; the int32
    form is what the ONNX nodes and TensorRT plugins take, which accept no bool I/O)."""
    return page_mask if page_mask.dtype == torch.bool else page_mask != 0


def tiered_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                     page_mask: torch.Tensor, page_index: torch.Tensor, seq_len: torch.Tensor, past: torch.Tensor,
                     *, scale: float | None = None, with_lse: bool = True, warm_pool: torch.Tensor | None = None,
                     warm_row: torch.Tensor | None = None, warm_codec: str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Paged attention with a residency/selection mask.

    Shapes and layout (B sequences, H query heads, KVH kv heads, T new queries per sequence,
    D head dim, C pool pages, P page size, M pages listed per sequence):

    * ``q`` [B, H, T, D] — rotated queries; query t of sequence b sits at position ``past[b] + t``.
    * ``k_pool``, ``v_pool`` [C, KVH, P, D] — page pool; slot o of page c holds one token.
    * ``page_table`` [B, M] int64 — pool slot of each listed page (padding: any valid slot).
    * ``page_mask`` [B, M] bool or int32 — False (0) removes the page (not selected, not
      resident, padding); or [B, KVH, M], a mask per kv head (the ``kv-head`` selection:
      each kv head's query group sees its own pages; the PyTorch reference only).
    * ``page_index`` [B, M] int64 — the page's logical index in its sequence: slot o of the
      page holds the token at position ``page_index * P + o``.
    * ``seq_len`` [B] int64 — tokens in the sequence; positions ``>= seq_len`` are empty slots.
    * ``past`` [B] int64 — causal: query t sees a key at position p iff ``p <= past + t``.

    Warm (compressed) pages, optional — all three or none:

    * ``warm_codec`` — the KV codec of the warm pages (a name of ``codec.CODECS``);
    * ``warm_pool`` [W, NB] uint8 — W pages encoded with that codec in the byte layout of
      ``codec.encode_pages`` (page shape [KVH, P, D] of the pools; NB = ``codec.page_bytes``),
      or the same bytes as int32 words [W, NB / 4] (``codec.as_words``: the form of the ONNX
      node and the TensorRT plugin);
    * ``warm_row`` [B, M] int64 — the warm-pool row holding listed page m, or -1 when the page
      is read from the pools. For a page with ``warm_row >= 0`` the K/V are
      ``codec.decode_pages(warm_pool[warm_row])`` and its ``page_table`` entry is ignored (any
      valid slot); only pages that ``page_mask`` keeps are decoded.

    Returns ``out`` [B, H, T, D] (query dtype; zeros for a query that sees no key),
    ``lse`` [B, H, T] float32 (natural-log sum of exp(scaled logits); -inf when nothing is
    seen; an empty tensor with ``with_lse=False``, when no block merge follows) and
    ``page_probs`` [B, H, T, M] float32 (softmax mass on each listed page; sums to 1 over
    pages for every query that sees a key).
    """
    k_pages, v_pages = k_pool[page_table], v_pool[page_table]
    page_mask = as_mask(page_mask)
    if (warm_pool is None) != (warm_row is None) or (warm_pool is None) != (warm_codec is None):
        raise ValueError("warm_pool, warm_row and warm_codec go together: pass all three or none")
    if warm_pool is not None:
        kept = page_mask if page_mask.dim() == 2 else page_mask.any(1)  # a page some kv head attends
        k_pages, v_pages = _with_warm_pages(k_pages, v_pages, kept, warm_pool, warm_row, warm_codec)
    return attention_over_pages(q, k_pages, v_pages, page_mask, page_index, seq_len, past, scale=scale,
                                with_lse=with_lse)


def _with_warm_pages(k_pages: torch.Tensor, v_pages: torch.Tensor, page_mask: torch.Tensor, warm_pool: torch.Tensor,
                     warm_row: torch.Tensor, warm_codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered pages [B, M, KVH, P, D] with the kept warm ones replaced by their decoded K/V."""
    from tieredkv.plugins.codec import CODECS, as_bytes, decode_pages

    if warm_codec not in CODECS:
        raise ValueError(f"warm_codec: unknown codec {warm_codec!r}; expected one of {sorted(CODECS)}")
    take = page_mask & (warm_row >= 0)
    if not bool(take.any()):
        return k_pages, v_pages
    warm_pool = as_bytes(warm_pool)
    k_dec, v_dec = decode_pages(warm_pool[warm_row[take]], CODECS[warm_codec], tuple(k_pages.shape[2:]))
    k_pages, v_pages = k_pages.clone(), v_pages.clone()
    k_pages[take], v_pages[take] = k_dec.to(k_pages.dtype), v_dec.to(v_pages.dtype)
    return k_pages, v_pages


def attention_over_pages(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_mask: torch.Tensor,
                         page_index: torch.Tensor, seq_len: torch.Tensor, past: torch.Tensor, *,
                         scale: float | None = None, with_lse: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tiered_attention` after the page-table gather: ``k_pages``, ``v_pages`` are
    [B, M, KVH, P, D], the listed pages in order (a caller that already holds the pages
    gathered skips a copy). ``page_mask`` may also be [B, KVH, M], one mask per kv head (each kv
    head's query group attends its own pages: the ``kv-head`` selection; the PyTorch reference
    only). Same returns."""
    b, h, t, d = q.shape
    _, m, kvh, p, _ = k_pages.shape
    g = h // kvh
    scale = d ** -0.5 if scale is None else scale
    page_mask = as_mask(page_mask)
    k = k_pages.permute(0, 2, 1, 3, 4).reshape(b, kvh, m * p, d).float()
    v = v_pages.permute(0, 2, 1, 3, 4).reshape(b, kvh, m * p, d).float()
    key_pos = (page_index.unsqueeze(-1) * p + torch.arange(p, device=page_index.device)).reshape(b, m * p)
    causal = key_pos.unsqueeze(1) <= (past.view(b, 1, 1) + torch.arange(t, device=past.device).view(1, t, 1))
    in_seq = key_pos < seq_len.view(b, 1)
    if page_mask.dim() == 3:  # one mask per kv head: [B, KVH, M]
        valid = page_mask.repeat_interleave(p, dim=2) & in_seq.unsqueeze(1)  # [B, KVH, M*P]
        allowed = (valid.unsqueeze(2) & causal.unsqueeze(1)).view(b, kvh, 1, t, m * p)
    else:
        valid = page_mask.repeat_interleave(p, dim=1) & in_seq
        allowed = (valid.unsqueeze(1) & causal).view(b, 1, 1, t, m * p)
    logits = torch.einsum("bkgtd,bksd->bkgts", q.float().view(b, kvh, g, t, d), k) * scale
    logits.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    seen = allowed.any(-1)  # [B, 1 or KVH, 1, T]: queries that see at least one key
    if not bool(seen.all()):
        probs = torch.where(seen.unsqueeze(-1), probs, torch.zeros_like(probs))  # softmax of all -inf is nan
    lse = torch.logsumexp(logits, dim=-1) if with_lse else torch.empty(0)
    out = torch.einsum("bkgts,bksd->bkgtd", probs, v).reshape(b, h, t, d).to(q.dtype)
    page_probs = probs.view(b, kvh, g, t, m, p).sum(-1).reshape(b, h, t, m)
    return out, (lse.reshape(b, h, t) if with_lse else lse), page_probs


def merge_attention(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Combine attention computed over disjoint key blocks: out = sum_i w_i * out_i with
    w_i = exp(lse_i - lse) and lse = logsumexp_i(lse_i). Returns (out, lse, weights);
    ``page_probs_i * weights_i.unsqueeze(-1)`` rescales each block's page masses."""
    stacked = torch.stack(lses)  # [N, B, H, T]
    lse = torch.logsumexp(stacked, dim=0)
    weights = torch.exp(stacked - lse).nan_to_num(0.0)
    out = sum(w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs)).to(outs[0].dtype)
    return out, lse, list(weights)
